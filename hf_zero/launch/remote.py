"""What runs on each node of a hostfile launch, and what the head node checks before starting it.

Every node runs the same thing a user would type there by hand: ``hf-zero launch --num_nodes N --node_rank R
--master_addr A ...`` (which becomes torchrun), inside a shell line that first exports the variables DeepSpeed's
runner forwards and moves to the launch directory. Keeping the per-node launch the one-node command means a node's
GPU count, its CPU fallback and its errors are the same as when it is started alone.

What is forwarded is DeepSpeed 0.19.8's rule (``deepspeed/launcher/runner.py``): every variable whose name starts
with ``NCCL`` (the CUDA accelerator's prefix), ``PYTHON``, ``MLFLOW``, ``MV2`` or ``UCX``, except ``NCCL_IB_HCA``
and ``UCX_NET_DEVICES`` when ``AISC_JOB_NAME`` is set (each node there picks its own); ``PYTHONPATH`` with the
launch directory put first; then the lines ``KEY=VALUE`` of ``.deepspeed_env`` in the home folder and then in the
launch directory (the file name is ``DS_ENV_FILE`` when set). The launcher's variables go over exactly as they are;
a ``.deepspeed_env`` value is written in double quotes as DeepSpeed writes it, so ``$VAR`` in it expands on the node.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from hf_zero.errors import LaunchError

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX")
AISC_PER_NODE = ("NCCL_IB_HCA", "UCX_NET_DEVICES")  # not exported when AISC_JOB_NAME is set, as DeepSpeed
ENV_FILE_DEFAULT = ".deepspeed_env"
PID_MARK = "HF_ZERO_REMOTE_PID"  # the remote shell's first line: the pid torchrun will have, to end it by id
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN = re.compile(r"[\w@%+=:,./-]*")
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY", re.IGNORECASE)


def env_files(environ: Mapping[str, str], cwd: str) -> list[str]:
    """The ``.deepspeed_env`` files read, home folder first (the launch directory's lines win)."""
    name = environ.get("DS_ENV_FILE", ENV_FILE_DEFAULT)
    found: list[str] = []
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.path.realpath(path) not in map(os.path.realpath, found):
            found.append(path)
    return found


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (blank lines and ``#`` comments skipped); a malformed line is one sentence naming it."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f.read().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, eq, value = line.partition("=")
            key = key.strip().removeprefix("export ").strip()
            if not eq or not _NAME.fullmatch(key):
                raise LaunchError(f"{path} line {number} {line!r} is not KEY=VALUE; write one variable a line.")
            out[key] = value.strip()
    return out


def exports(environ: Mapping[str, str], cwd: str) -> list[str]:
    """The ``export K=V`` statements every node's shell runs before its launch, in DeepSpeed's order."""
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
    skipped = AISC_PER_NODE if "AISC_JOB_NAME" in env else ()
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()
             if k.startswith(EXPORT_PREFIXES) and k not in skipped and _NAME.fullmatch(k)]
    for path in env_files(environ, cwd):
        for key, value in read_env_file(path).items():
            lines.append(f"export {key}={_double_quoted(value)}")
    return lines


def redact(export_lines: Sequence[str]) -> list[str]:
    """``export_lines`` as the launcher prints them: a variable named like a secret (``HF_TOKEN``, ``..._PASSWORD``)
    shows ``***``. The nodes get the real value; only the printed command hides it."""
    out = []
    for line in export_lines:
        key = line.removeprefix("export ").split("=", 1)[0]
        out.append(f"export {key}=***" if _SECRET.search(key) else line)
    return out


def _double_quoted(value: str) -> str:
    """DeepSpeed's quoting of a ``.deepspeed_env`` value: plain words bare, anything else in double quotes."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value  # already quoted for the shell by its author
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'


def node_flags(slots: Sequence[int]) -> list[str]:
    """The flags that give one node its slots: ``--num_gpus N`` for slots ``0..N-1``, else ``--include localhost:...``."""
    if list(slots) == list(range(len(slots))):
        return ["--num_gpus", str(len(slots))]
    return ["--include", "localhost:" + ",".join(str(s) for s in slots)]


def node_shell_line(*, export_lines: Sequence[str], cwd: str, launch_args: Sequence[str], node_rank: str, master: str,
                    flags_by_rank: Sequence[Sequence[str]] | None, flags: Sequence[str], mark_pid: bool,
                    venv_script: str | None = None) -> str:
    """One node's shell line: exports, ``cd``, then ``exec hf-zero launch`` (so torchrun keeps the shell's pid).

    ``node_rank`` and ``master`` are shell words: a literal (``3``, a quoted address) or what the remote side puts
    there (pdsh's ``%n``, ``"$SLURM_NODEID"``, a ``$(scontrol ...)``). When nodes differ in slots and one line serves
    them all (pdsh), ``flags_by_rank`` picks each node's flags with a ``case`` on the rank; otherwise ``flags`` are
    every node's. With ``mark_pid`` the shell first prints :data:`PID_MARK` and its pid, which the head reads to end
    exactly that process (the launch ``exec``s into torchrun, which keeps the pid) on a failure or a signal.
    ``venv_script`` (DeepSpeed's ``--venv_script``) is sourced first; the line stops if it fails.
    """
    launch = [sys.executable, "-u", "-m", "hf_zero.launch.cli", "launch", f"--node_rank={node_rank}", f"--master_addr={master}"]
    head = shlex.join(launch[:5]) + " " + " ".join(launch[5:])  # the last two hold shell words, unquoted on purpose
    parts = [f". {shlex.quote(venv_script)} || exit 1;"] if venv_script else []
    parts += [*(line + ";" for line in export_lines), f"cd {shlex.quote(cwd)} &&"]
    if mark_pid:
        parts.append(f"echo {PID_MARK} $$ &&")
    if flags_by_rank is not None:
        cases = " ".join(f"{r}) set -- {shlex.join(f)};;" for r, f in enumerate(flags_by_rank))
        parts.append(f"case {node_rank} in {cases} esac &&")
        parts.append(f'exec {head} "$@" {shlex.join(launch_args)}')
    else:
        parts.append(f"exec {head} {shlex.join([*flags, *launch_args])}")
    return " ".join(parts)


def ssh_command(host: str, ssh_port: int | None, extra: Sequence[str] = ()) -> list[str]:
    """``ssh [-p PORT] [launcher args] HOST``: the prefix of every command run on ``host``."""
    return ["ssh", *(["-p", str(ssh_port)] if ssh_port is not None else []), *extra, host]


def check_reachable(hosts: Sequence[str], ssh_port: int | None, extra: Sequence[str], hostfile: str,
                    timeout_s: float = 60.0) -> None:
    """Run ``hostname`` on every host over ssh, as DeepSpeed checks its first host; refuse in one sentence if any fails.

    All hosts are asked at once (a cluster of many nodes is not checked one by one), non-interactively: a host that
    would ask for a password is as unreachable as one that is down.
    """
    def probe(host: str) -> tuple[str, list[str], int, str]:
        cmd = ssh_command(host, ssh_port, ["-o", "PasswordAuthentication=no", "-o", "ConnectTimeout=10", *extra])
        cmd.append("hostname")
        try:
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return host, cmd, -1, f"no answer in {timeout_s:.0f} s"
        except OSError as e:
            return host, cmd, -1, str(e)
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return host, cmd, done.returncode, last

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        answers = list(pool.map(probe, hosts))
    failed = [a for a in answers if a[2] != 0]
    if failed:
        host, cmd, code, why = failed[0]
        others = f" (nor are {', '.join(a[0] for a in failed[1:])})" if len(failed) > 1 else ""
        said = f"exited with {code}" if code >= 0 else "failed"
        raise LaunchError(
            f"host {host} of hostfile {hostfile} is not reachable over ssh{others}: `{shlex.join(cmd)}` {said}"
            f"{': ' + why if why else ''}; set up passwordless ssh to it, or leave it out (--exclude {host}), "
            "or pass --no_ssh_check to skip this check."
        )


def master_address(host: str, ssh_port: int | None, extra: Sequence[str]) -> str:
    """The first address ``hostname -I`` gives on ``host`` (DeepSpeed's way to find the master), else ``host`` itself."""
    cmd = [*ssh_command(host, ssh_port, extra), "hostname", "-I"]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise LaunchError(f"`{shlex.join(cmd)}` failed ({e}); pass --master_addr, the address of {host}.") from e
    words = done.stdout.split()
    if done.returncode != 0 or not words:
        return host
    return words[0]
