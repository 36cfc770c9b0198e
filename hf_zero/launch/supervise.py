"""Running a :class:`~hf_zero.launch.job.MultiNodeJob` from the head node until every node is done.

The head starts the ssh (or pdsh, or srun) processes, each in a session of its own so that a Ctrl-C at the terminal
reaches only the head, and copies their output to its own, each ssh line prefixed with its host (pdsh prefixes its
own). It returns non-zero when any node's launch fails, and then ends the others rather than leave them waiting in a
collective for a peer that is gone (torchrun does the same to the processes of one node). A SIGINT or SIGTERM ends
every node the same way.

Ending a node is precise: its shell line printed its pid first (``remote.PID_MARK``) and then became torchrun
(``exec``), so the head runs ``kill -TERM PID`` on that host, and torchrun stops its workers as it does on any
SIGTERM. Closing an ssh connection alone would not do it (a command without a terminal gets no hangup). srun
forwards a SIGTERM to its tasks itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from hf_zero.launch.job import MultiNodeJob, describe
from hf_zero.launch.remote import PID_MARK

GRACE_S = 60.0  # how long ended nodes get to stop (torchrun gives its workers 30 s) before the head drops them
_PDSH_FAILED = re.compile(r"^pdsh@[^:]*: (\S+): ssh exited with exit code (\d+)")


def _say(text: str) -> None:
    print(f"hf-zero launch: {text}", file=sys.stderr, flush=True)


class _Supervisor:
    def __init__(self, job: MultiNodeJob) -> None:
        self.job = job
        self.pids: dict[str, int] = {}  # host -> the pid its launch runs as
        self.failed: tuple[str, int] | None = None  # the first node that failed, and its exit code
        self.lock = threading.Lock()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.signalled: int | None = None
        self.ending_since: float | None = None

    # ----------------------------------------------------------------- output
    def _pump(self, stream: IO[bytes], out: IO[str], host: str) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            text = line.split(": ", 1)[1] if not host and ": " in line else line
            if text.startswith(PID_MARK + " "):
                origin = host or line.split(": ", 1)[0]
                try:
                    self.pids[origin] = int(text.split()[1])
                except (IndexError, ValueError):
                    pass
                continue
            if not host:
                failed = _PDSH_FAILED.match(line)
                if failed and int(failed.group(2)) != 0:  # end the others now, not when pdsh is done
                    threading.Thread(target=self._node_failed, args=(failed.group(1), int(failed.group(2))),
                                     daemon=True).start()
            with self.lock:
                out.write((f"{host}: " if host else "") + line + "\n")
                out.flush()
        stream.close()

    # ----------------------------------------------------------------- ending
    def _node_failed(self, host: str, code: int) -> None:
        with self.lock:
            if self.failed is not None or self.signalled is not None:
                return
            self.failed = (host, code)
        others = [h for h in self.job.hosts if h != host]
        _say(f"{host or self.job.launcher} exited with code {code}; ending the job"
             + (f" on {', '.join(others)}" if others else ""))
        self._end(skip=host)

    def _end(self, skip: str = "") -> None:
        """Ask every node still running (but ``skip``, the one that failed) to stop, once; the main loop waits."""
        if self.ending_since is not None:
            return
        self.ending_since = time.monotonic()
        if self.job.launcher == "slurm":
            for _, proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # srun forwards it to every task
            return
        running = {h for h, p in self.procs if p.poll() is None} if self.job.launcher == "ssh" else set(self.job.hosts)
        killers = []
        for host, proc in self.procs:
            if host in running and host not in self.pids and proc.poll() is None:
                proc.terminate()  # no pid reported yet: without its ssh the remote line fails at its first write
        for host in self.job.hosts:
            pid = self.pids.get(host)
            if host in running and host != skip and pid is not None and host in self.job.kill_prefix:
                argv = [*self.job.kill_prefix[host], f"kill -TERM {pid}"]
                killers.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL, env={**os.environ, **self.job.env_updates},
                                                start_new_session=True))
        for k in killers:
            try:
                k.wait(timeout=30)
            except subprocess.TimeoutExpired:
                k.kill()
                k.wait()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signalled is None:
            self.signalled = signum
            _say(f"got {signal.Signals(signum).name}: ending the job on every node")
            threading.Thread(target=self._end, daemon=True).start()
        else:  # a second one: stop waiting
            for _, proc in self.procs:
                if proc.poll() is None:
                    proc.kill()

    # ----------------------------------------------------------------- run
    def run(self) -> int:
        if self.job.notice:
            _say(self.job.notice)
        for line in describe(self.job):
            _say(line)
        env = {**os.environ, **self.job.env_updates}
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        pumps = []
        try:
            for host, argv in self.job.commands:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env=env, start_new_session=True)
                self.procs.append((host, proc))
                for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                    t = threading.Thread(target=self._pump, args=(stream, out, host), daemon=True)
                    t.start()
                    pumps.append(t)
            codes: dict[int, int] = {}
            while len(codes) < len(self.procs):
                for i, (host, proc) in enumerate(self.procs):
                    if i not in codes and proc.poll() is not None:
                        codes[i] = proc.returncode
                        if proc.returncode != 0:
                            threading.Thread(target=self._node_failed, args=(host, proc.returncode),
                                             daemon=True).start()
                if self.ending_since is not None and time.monotonic() - self.ending_since > GRACE_S:
                    for _, proc in self.procs:
                        if proc.poll() is None:
                            _say(f"a node did not stop within {GRACE_S:.0f} s; leaving it")
                            proc.kill()
                time.sleep(0.1)
            for t in pumps:
                t.join(timeout=5)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.signalled is not None:
            return 128 + self.signalled
        if self.failed is not None:
            return self.failed[1] or 1
        bad = [c for c in codes.values() if c != 0]
        return bad[0] if bad else 0


def run(job: MultiNodeJob) -> int:
    """Start ``job`` on every node and wait; the exit code is the first failed node's (0 when all succeeded)."""
    return _Supervisor(job).run()
