"""Preemption: a scheduler's SIGTERM (or SIGUSR1) becomes a resume checkpoint and an exit a launcher understands.

[Note: the life of a preemption]

1. **A signal arrives** (``checkpoint.save_on_signal`` names which). The handler only records it:
   nothing that allocates, takes locks held by the training code or talks to other ranks runs inside
   a signal handler. The signal is read from :func:`signal.set_wakeup_fd`'s socket by a watcher thread,
   so it is seen at once even while the main thread sits in a long C call (a collective, a file write)
   that would hold back a Python handler until it returns.
2. **The same signal twice within** :data:`SAME_DELIVERY_S` **is one delivery.** Under SLURM the
   scheduler signals every process of the job step, workers included, and torchrun (which starts its
   workers in sessions of their own) forwards the SIGTERM it got to each worker too: a worker sees two
   SIGTERMs milliseconds apart. A later or different signal is a second request and exits at once
   (``os._exit(128 + signum)``), as does ``checkpoint.grace_seconds`` running out after the first.
   torchrun itself SIGKILLs its workers 30 s after it forwarded a signal (``--shutdown_timeout`` /
   ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` change that), and it forwards SIGUSR1 only when
   ``--signals_to_handle`` names it.
3. **The ranks agree, one collective, no host stall** (:class:`Agreement`): on every accumulation-
   boundary step each rank puts the signal it got (0 for none) into a one-element tensor, launches an
   all-reduce MAX over the ranks that save a checkpoint together, and copies the result to host memory
   behind it; the value is read at the *next* boundary, when that point of the stream has long passed.
   So every rank decides at the same step from the same number, at most two optimizer steps after the
   signal, whichever rank got it (a signal sent to one rank only stops them all).
4. **Then** the engine saves a resume checkpoint and exits with ``128 + signum`` (``ZeroEngine``), or
   hands the decision to its owner (hf_zero's ``Trainer`` saves ``checkpoint-<step>`` with its trainer
   state instead).

Handlers are installed while at least one training engine watches (the main thread only) and the
previous ones come back when the last stops watching (``engine.destroy()``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("hf_zero")

SAME_DELIVERY_S = 1.0
TRAINER_DEFAULT = ("SIGTERM", "SIGUSR1")


def signal_numbers(names: Iterable[str]) -> list[int]:
    """The numbers of signal names this platform has (a name it lacks, such as SIGUSR1 on Windows, is left out)."""
    return [int(getattr(signal, n)) for n in dict.fromkeys(names) if hasattr(signal, n)]


def exit_status(signum: int) -> int:
    """What a shell reports for a process killed by ``signum``: a launcher's restart logic reads it the same way."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(text: str) -> None:
    """One line on stderr, from a signal handler or the watcher thread (no logging locks there)."""
    try:
        os.write(2, f"[hf_zero] {text}\n".encode())
    except OSError:
        pass


class _Watch:
    """The process-wide record of the signals received, and the handlers that feed it (one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.signals: set[int] = set()
        self.previous: dict[int, Any] = {}
        self.grace: float | None = None
        self.first: tuple[int, float] | None = None  # (signum, monotonic time) of the first delivery
        self.done = False  # the decision was acted on: the process is on its way out
        self.wake: tuple[socket.socket, socket.socket] | None = None
        self.previous_wakeup = -1
        self.thread: threading.Thread | None = None
        self.timer: threading.Timer | None = None
        self.exit: Callable[[int], None] = os._exit  # replaced by tests that must not end their process

    # ----------------------------------------------------------- deliveries

    def record(self, signum: int) -> None:
        """One delivery of ``signum`` (from the watcher thread, or the handler when the wakeup socket is not ours)."""
        now = time.monotonic()
        with self.lock:
            first = self.first
            if first is None:
                self.first = (signum, now)
                grace = f"; after {self.grace:g} s (checkpoint.grace_seconds) it exits regardless" if self.grace else ""
                if self.grace is not None:
                    self.timer = threading.Timer(self.grace, self.grace_over)
                    self.timer.daemon = True
                    self.timer.start()
                _say(f"rank {_rank()} received {signal_name(signum)}: the ranks agree at the next optimizer step, save a "
                     f"resume checkpoint and exit with status {exit_status(signum)}; a second signal exits at once{grace}")
                return
            if signum == first[0] and now - first[1] < SAME_DELIVERY_S:
                return  # the scheduler's and torchrun's copies of one request
        _say(f"rank {_rank()} received {signal_name(signum)} again ({now - first[1]:.1f} s after the first): exiting at once "
             f"with status {exit_status(signum)}; a checkpoint being written is left unpublished")
        self.exit(exit_status(signum))

    def grace_over(self) -> None:
        signum = self.first[0] if self.first else signal.SIGTERM
        _say(f"rank {_rank()}: checkpoint.grace_seconds ({self.grace:g} s) ran out after {signal_name(signum)}: exiting at once "
             f"with status {exit_status(signum)}; a checkpoint being written is left unpublished")
        self.exit(exit_status(signum))

    def _handler(self, signum: int, frame: Any) -> None:
        del frame
        if not self._wakeup_is_ours():  # someone (an asyncio loop) took the wakeup fd: record it here instead
            self.record(signum)

    def _wakeup_is_ours(self) -> bool:
        if self.wake is None:
            return False
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(current)
        return current == self.wake[1].fileno()

    def _listen(self, sock: socket.socket) -> None:
        """The watcher thread: every byte is a signal number, written by the C-level handler the moment it arrives."""
        while True:
            try:
                data = sock.recv(64)
            except OSError:
                return
            if not data:
                return  # closed: the last engine stopped watching
            for signum in data:
                if signum in self.signals:
                    self.record(signum)

    # ------------------------------------------------------------- install

    def start(self, signums: list[int], grace: float | None) -> bool:
        """Watch ``signums`` (one more user); False where handlers cannot be installed (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("checkpoint.save_on_signal: the engine was built outside the main thread, where Python cannot "
                           "install signal handlers; %s will end the run without a resume checkpoint",
                           ", ".join(signal_name(s) for s in signums))
            return False
        with self.lock:
            self.users += 1
            if grace is not None:
                self.grace = grace if self.grace is None else min(self.grace, grace)
            new = [s for s in signums if s not in self.signals]
            self.signals.update(new)
        for s in new:
            self.previous[s] = signal.signal(s, self._handler)
        if self.wake is None:
            r, w = socket.socketpair()
            r.setblocking(True)
            w.setblocking(False)
            self.previous_wakeup = signal.set_wakeup_fd(w.fileno())
            self.wake = (r, w)
            if self.previous_wakeup != -1:  # taken already (an asyncio loop): the handler records instead
                signal.set_wakeup_fd(self.previous_wakeup)
            self.thread = threading.Thread(target=self._listen, args=(r,), name="hf_zero-signals", daemon=True)
            self.thread.start()
        return True

    def release(self) -> None:
        """The run is failing (a peer died): the signals act as before hf_zero watched them, so torchrun's SIGTERM
        to the survivors stops them as it did; one that already arrived is delivered again now."""
        if self.users == 0 or threading.current_thread() is not threading.main_thread():
            return
        for s in list(self.signals):
            if signal.getsignal(s) == self._handler:
                signal.signal(s, self.previous.get(s, signal.SIG_DFL))
        if self._wakeup_is_ours():
            signal.set_wakeup_fd(-1)
        first, self.first, self.done = self.first, None, True
        if first is not None:
            signal.raise_signal(first[0])

    def stop(self) -> None:
        """One user fewer; the last one puts the previous handlers back."""
        with self.lock:
            self.users -= 1
            if self.users > 0:
                return
            signums, self.signals = list(self.signals), set()
        for s in signums:
            if signal.getsignal(s) == self._handler:
                signal.signal(s, self.previous.pop(s, signal.SIG_DFL))
        if self.first is not None and not self.done:
            logger.warning("%s arrived after the last optimizer step the ranks could agree on; no preemption checkpoint "
                           "was saved", signal_name(self.first[0]))
        if self.wake is not None:
            r, w = self.wake
            if self._wakeup_is_ours():
                signal.set_wakeup_fd(-1)
            w.close()  # the watcher's recv returns b"" and the thread ends
            if self.thread is not None:
                self.thread.join(timeout=5)
            r.close()
        if self.timer is not None:
            self.timer.cancel()
        self.wake, self.thread, self.timer, self.first, self.grace, self.done = None, None, None, None, None, False

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) must die of SIGTERM as before and must not write into our socket."""
        if self.wake is None:
            return
        for s in list(self.signals):
            try:
                signal.signal(s, self.previous.get(s, signal.SIG_DFL))
            except (ValueError, OSError):
                pass
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
        self.users, self.signals, self.wake, self.thread, self.first = 0, set(), None, None, None


_WATCH = _Watch()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _WATCH.after_fork_in_child())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def received() -> int | None:
    """The signal this process received (its first delivery), or None."""
    first = _WATCH.first
    return first[0] if first is not None else None


def watching() -> bool:
    """Whether any engine of this process watches signals now."""
    return _WATCH.users > 0


def release() -> None:
    """A peer failed or the script is dying of an exception: no preemption save can happen any more, so the
    watched signals get their previous handlers back (see :meth:`_Watch.release`)."""
    _WATCH.release()


def acting() -> None:
    """The agreed decision is being carried out (a save, then the exit): no warning about an unused signal."""
    _WATCH.done = True


# --------------------------------------------------------------------- agreement


class Agreement:
    """One engine's view of a preemption: the all-reduce that makes every rank decide at the same step.

    ``poll()`` is called on every accumulation boundary. It reads the result of the all-reduce the
    previous boundary launched (on GPU: an event recorded after the copy into pinned memory, which that
    step's kernels passed long ago, so the host does not wait for the current step), then launches this
    boundary's. A nonzero result (the largest signal number any rank got) is the decision, the same on
    every rank; no new all-reduce is launched after it. At world size 1 there is nothing to agree on.
    """

    def __init__(self, signals: list[int], grace: float | None) -> None:
        self.signals = signals
        self.active = _WATCH.start(signals, grace)
        self.decided: int | None = None
        self._pending: Any = None  # (work, device tensor, host copy, event) of the last boundary
        self._flag: torch.Tensor | None = None
        self._host: torch.Tensor | None = None

    def poll(self, group: dist.ProcessGroup | None, device: torch.device) -> int | None:
        """The agreed signal number once every rank has seen it (None before); collective over ``group``."""
        if not self.active or self.decided is not None:
            return self.decided
        mine = received() or 0
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            self.decided = mine or None
            return self.decided
        agreed = self._collect()
        if agreed:
            self.decided = agreed
            return agreed
        self._launch(mine, group, device)
        return None

    def _collect(self) -> int:
        if self._pending is None:
            return 0
        work, flag, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # the point after the previous boundary's copy, not this step's kernels
            return int(host[0])
        work.wait()
        return int(flag[0])

    def _launch(self, mine: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        on_gpu = dist.get_backend(group) == "nccl"
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device if on_gpu else "cpu")
            if on_gpu:
                self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._flag.fill_(mine)  # a kernel with the value as its argument: no copy from pageable memory
        work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        event = None
        if on_gpu:
            work.wait()  # the current stream waits for the all-reduce; the host does not
            assert self._host is not None
            self._host.copy_(self._flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = (work, self._flag, self._host, event)

    def close(self) -> None:
        """Stop watching: finish an all-reduce still in flight (every rank launched it) and give the handlers back."""
        if self._pending is not None:
            try:
                self._collect()
            except Exception:  # noqa: BLE001 - a peer gone at teardown; nothing to agree on any more
                pass
        if self.active:
            self.active = False
            _WATCH.stop()
