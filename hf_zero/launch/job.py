"""From ``hf-zero launch``'s flags to a multi-node job: which hosts, over what, running which line.

:func:`plan` returns either the flags of a launch on this node only (no hostfile, a hostfile of one host, or
``--no_ssh``: what ``local.plan_launch`` turns into one torchrun) or a :class:`MultiNodeJob`: the commands that start
``hf-zero launch --node_rank R`` on every host, over

- ``pdsh`` (DeepSpeed's default, when it is installed): one ``pdsh -S -f 1024 -w h0,h1,...`` whose line takes its
  node rank from pdsh's ``%n`` (the host's index in the ``-w`` list, the hostfile's order);
- ``ssh`` (when pdsh is not installed, or asked for): one ``ssh HOST LINE`` per host, its rank written in;
- ``slurm``: one ``srun --nodes N --ntasks-per-node 1 sh -c LINE`` whose line takes its rank from ``SLURM_NODEID``.

Before ssh or pdsh start anything, every host is asked for ``hostname`` over ssh (DeepSpeed asks only the first),
and without ``--master_addr`` the first host's ``hostname -I`` names the master, as in DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hf_zero.errors import LaunchError
from hf_zero.launch import hostfile as hf
from hf_zero.launch import remote

DEFAULT_MASTER_PORT = 29500
PDSH_FAN_OUT = 1024  # DeepSpeed's: every host at once
LAUNCHERS = ("pdsh", "ssh", "slurm")
_MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")
# flags that only mean something when this node starts the others
_HOST_FLAGS = ("hostfile", "launcher", "launcher_args", "ssh_port", "force_multi", "venv_script")


@dataclass(frozen=True)
class MultiNodeJob:
    """The processes the head node runs to start (and, on failure or a signal, end) every node's launch."""

    launcher: str  # pdsh, ssh or slurm
    hosts: list[str]  # node rank order (slurm without a hostfile: empty, the allocation decides)
    commands: list[tuple[str, list[str]]]  # (host, argv) per ssh; one ("", argv) for pdsh or srun
    env_updates: dict[str, str] = field(default_factory=dict)  # for the pdsh / srun process (PDSH_RCMD_TYPE, ...)
    kill_prefix: dict[str, list[str]] = field(default_factory=dict)  # host -> argv that runs a command there
    notice: str = ""
    shown: list[tuple[str, list[str]]] = field(default_factory=list)  # ``commands`` with secret values as ***


def _given(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name, None) not in (None, False, "")


def _ssh_port(args: argparse.Namespace) -> int | None:
    if args.ssh_port is None:
        return None
    try:
        return int(args.ssh_port)
    except ValueError:
        raise LaunchError(f"--ssh_port: got {args.ssh_port!r}, expected a port number such as 22.") from None


def _launcher_args(args: argparse.Namespace) -> list[str]:
    try:
        return shlex.split(args.launcher_args or "")
    except ValueError as e:
        raise LaunchError(f"--launcher_args {args.launcher_args!r} is not a valid shell word list ({e}).") from None


def _local(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    """``args`` for a launch of this node only: the host flags cleared, ``changes`` applied."""
    cleared = dict.fromkeys(_HOST_FLAGS)
    return argparse.Namespace(**{**vars(args), **cleared, **changes})


def _slot_changes(slots: list[int]) -> dict[str, object]:
    flags = remote.node_flags(slots)
    if flags[0] == "--num_gpus":
        return {"num_gpus": int(flags[1]), "include": "", "exclude": ""}
    return {"num_gpus": None, "include": flags[1], "exclude": ""}


def plan(args: argparse.Namespace, environ: Mapping[str, str], *, cwd: str | None = None,
         which: Callable[[str], str | None] = shutil.which, probe: bool = True) -> MultiNodeJob | argparse.Namespace:
    """The job ``args`` ask for; ``probe=False`` skips the ssh reachability check and the master lookup (tests)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    if getattr(args, "config_file", None) is not None:
        given = [n for n in _HOST_FLAGS if _given(args, n)]
        if given:
            raise LaunchError(f"--{given[0]} cannot be used with --config_file (an Accelerate YAML); start each machine "
                              "with hf-zero launch --config_file ... --machine_rank R, or drop --config_file.")
        return args
    launcher = (args.launcher or "").lower() or None
    if launcher in _MPI_LAUNCHERS:
        raise LaunchError(f"--launcher {launcher} starts one process per GPU through mpirun, which hf-zero does not do "
                          "(torchrun starts each node's processes): use --launcher pdsh, ssh or slurm.")
    if launcher is not None and launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {args.launcher}: expected one of {', '.join(LAUNCHERS)}.")
    if launcher == "slurm":
        return _slurm(args, environ, cwd)
    if args.no_ssh and args.hostfile is None:
        return _local(args)  # this node only, as asked by hand (the node line of a hostfile launch comes here too)
    path = hf.find_hostfile(args.hostfile)
    if path is None:
        given = [n for n in _HOST_FLAGS if _given(args, n)]
        if given:
            raise LaunchError(f"--{given[0]} is for starting the hosts of a hostfile, and there is none: pass --hostfile H "
                              f"(lines 'HOSTNAME slots=N'; default {hf.DEFAULT_HOSTFILE}).")
        return args
    hosts = hf.resolve(path, args.include, args.exclude, args.num_nodes, args.num_gpus)
    names = list(hosts)
    if args.no_ssh:
        if args.node_rank is None or not 0 <= args.node_rank < len(names):
            raise LaunchError(f"--no_ssh starts this node only: pass --node_rank, its index in [0, {len(names)}) "
                              f"among the hosts of hostfile {path}.")
        return _local(args, num_nodes=len(names), master_addr=args.master_addr or names[0],
                      **_slot_changes(hosts[names[args.node_rank]]))
    if args.node_rank is not None:
        raise LaunchError("--node_rank is for a node started by hand; with a hostfile the launcher numbers the hosts "
                          "(drop --node_rank, or add --no_ssh to start only this node).")
    if len(names) == 1 and not args.force_multi:
        # DeepSpeed's rule: a hostfile of one host is this machine, started without ssh.
        return _local(args, num_nodes=None, **_slot_changes(hosts[names[0]]))
    return _over_ssh(args, environ, cwd, path, hosts, launcher, which, probe)


def _launch_args(args: argparse.Namespace, nodes: int) -> list[str]:
    """The flags every node's ``hf-zero launch`` gets besides its rank, its slots and the master address."""
    out = ["--no_ssh", "--num_nodes", str(nodes),
           "--master_port", str(DEFAULT_MASTER_PORT if args.master_port is None else args.master_port),
           "--max_restarts", str(args.max_restarts)]
    if args.module:
        out.append("--module")
    if args.no_python:
        out.append("--no_python")
    return [*out, args.script, *args.script_args]


def _over_ssh(args: argparse.Namespace, environ: Mapping[str, str], cwd: str, path: str, hosts: hf.Hosts,
              launcher: str | None, which: Callable[[str], str | None], probe: bool) -> MultiNodeJob:
    if launcher == "pdsh" and which("pdsh") is None:
        raise LaunchError("--launcher pdsh: pdsh is not installed on this node; install it, or use --launcher ssh.")
    launcher = launcher or ("pdsh" if which("pdsh") else "ssh")
    if which("ssh") is None:
        raise LaunchError(f"--hostfile {path} starts its hosts over ssh, and ssh is not installed on this node.")
    port, extra = _ssh_port(args), _launcher_args(args)
    names = list(hosts)
    ssh_extra = extra if launcher == "ssh" else []  # pdsh's launcher_args are pdsh's options, not ssh's
    if probe and not args.no_ssh_check:
        remote.check_reachable(names, port, ssh_extra, path)
    if args.master_addr:
        master, found = args.master_addr, ""
    elif probe:
        master = remote.master_address(names[0], port, ssh_extra)
        found = f"master address {master} (`hostname -I` on {names[0]})"
    else:
        master, found = names[0], ""
    launch_args = _launch_args(args, len(names))
    flags = [remote.node_flags(hosts[h]) for h in names]
    where = f"{len(names)} nodes of hostfile {path} over {launcher}: " + ", ".join(
        f"{h} ({len(hosts[h])} slot{'s' if len(hosts[h]) > 1 else ''})" for h in names)
    notice = "; ".join(filter(None, [where, found]))
    exports = remote.exports(environ, cwd)
    if launcher == "ssh":
        def per_host(export_lines: list[str]) -> list[tuple[str, list[str]]]:
            return [(h, [*remote.ssh_command(h, port, extra), remote.node_shell_line(
                export_lines=export_lines, cwd=cwd, launch_args=launch_args, node_rank=str(r), master=shlex.quote(master),
                flags_by_rank=None, flags=flags[r], mark_pid=True, venv_script=args.venv_script)])
                for r, h in enumerate(names)]
        kill = {h: remote.ssh_command(h, port, extra) for h in names}
        return MultiNodeJob("ssh", names, per_host(exports), {}, kill, notice, per_host(remote.redact(exports)))
    same = all(f == flags[0] for f in flags)
    pdsh = ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", ",".join(names), *extra]

    def one(export_lines: list[str]) -> list[tuple[str, list[str]]]:
        return [("", [*pdsh, remote.node_shell_line(
            export_lines=export_lines, cwd=cwd, launch_args=launch_args, node_rank="%n", master=shlex.quote(master),
            flags_by_rank=None if same else flags, flags=flags[0], mark_pid=True, venv_script=args.venv_script)])]
    env = {"PDSH_RCMD_TYPE": "ssh"}
    if port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')} -p {port}".strip()
    kill = {h: ["pdsh", "-S", "-w", h, *extra] for h in names}
    return MultiNodeJob("pdsh", names, one(exports), env, kill, notice, one(remote.redact(exports)))


def _slurm(args: argparse.Namespace, environ: Mapping[str, str], cwd: str) -> MultiNodeJob:
    """``srun`` one task per node, each running ``hf-zero launch --node_rank $SLURM_NODEID``."""
    if args.node_rank is not None or args.no_ssh:
        raise LaunchError("--launcher slurm numbers the nodes itself (SLURM_NODEID): drop --node_rank/--no_ssh.")
    if args.ssh_port is not None:
        raise LaunchError("--ssh_port is for the pdsh/ssh launchers; --launcher slurm starts nodes through srun.")
    path = hf.find_hostfile(args.hostfile)
    extra = _launcher_args(args)
    srun = ["srun"]
    if path is not None:
        hosts = hf.resolve(path, args.include, args.exclude, args.num_nodes, args.num_gpus)
        counts = {len(s) for s in hosts.values()}
        odd = [h for h, s in hosts.items() if s != list(range(len(s)))]
        if odd or len(counts) > 1:
            what = f"GPU ids {hosts[odd[0]]} on {odd[0]}" if odd else f"{sorted(counts)} slots on different hosts"
            raise LaunchError(f"--launcher slurm starts the same processes on every node and cannot select {what}; "
                              "keep the first N slots of every host (--num_gpus N), or use --launcher pdsh/ssh.")
        nodes, flags = len(hosts), remote.node_flags(next(iter(hosts.values())))
        srun += ["--nodes", str(nodes), "--ntasks-per-node", "1", "--nodelist", ",".join(hosts)]
        where = f"{nodes} nodes of hostfile {path} through srun"
    else:
        if args.include or args.exclude:
            raise LaunchError("--include/--exclude filter a hostfile's hosts; under --launcher slurm without a "
                              "hostfile, choose nodes with --launcher_args (e.g. \"--nodelist=a,b\").")
        nodes = args.num_nodes or int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or 0)
        if nodes < 1:
            raise LaunchError("--launcher slurm needs the number of nodes: pass --num_nodes N (or run inside an "
                              "allocation, whose SLURM_NNODES is used), or a --hostfile.")
        flags = [] if args.num_gpus is None else ["--num_gpus", str(args.num_gpus)]
        srun += ["--nodes", str(nodes), "--ntasks-per-node", "1"]
        where = f"{nodes} nodes through srun"
    if args.num_gpus is not None:
        srun += ["--gpus-per-node", str(args.num_gpus)]  # as DeepSpeed's slurm runner asks for them
    srun += ["--kill-on-bad-exit=1", *extra]
    master = shlex.quote(args.master_addr) if args.master_addr else \
        '"$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1)"'
    def one(export_lines: list[str]) -> list[tuple[str, list[str]]]:
        return [("", [*srun, "sh", "-c", remote.node_shell_line(
            export_lines=export_lines, cwd=cwd, launch_args=_launch_args(args, nodes), node_rank='"$SLURM_NODEID"',
            flags_by_rank=None, flags=flags, mark_pid=False, master=master, venv_script=args.venv_script)])]
    exports = remote.exports(environ, cwd)
    return MultiNodeJob("slurm", [], one(exports), {}, {}, where, one(remote.redact(exports)))


def describe(job: MultiNodeJob) -> list[str]:
    """The commands as shell lines, for the one line each the launcher prints before starting them (secrets hidden)."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(job.env_updates.items()))
    return [(f"{host}: " if host else "") + (prefix + " " if prefix else "") + shlex.join(argv)
            for host, argv in (job.shown or job.commands)]

