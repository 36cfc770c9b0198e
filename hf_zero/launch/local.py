"""One node's ``hf-zero launch``: parsed flags to one torchrun command, then this process becomes it.

``hf-zero launch`` is a translation, not a launcher of its own: it maps DeepSpeed's
flags one to one onto ``torch.distributed.run`` and then *becomes* that process (``exec``), so
torchrun's exit code, signal handling and restarts are exactly torchrun's. The command it runs
is printed on one line to stderr, so the mapping is never hidden. The flags themselves are
:mod:`hf_zero.launch.flags`' table; a hostfile's nodes each end here through :mod:`hf_zero.launch.remote`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from hf_zero.errors import LaunchError
from hf_zero.integrations import accelerate_launch
from hf_zero.launch.flags import UNSUPPORTED_FLAGS

DEFAULT_MASTER_PORT = 29500  # DeepSpeed's (and torch's) default rendezvous port


@dataclass(frozen=True)
class LaunchPlan:
    """What ``hf-zero launch`` will run: torchrun's argv and the variables it adds to the environment."""

    argv: list[str]
    env_updates: dict[str, str] = field(default_factory=dict)
    notice: str = ""  # said once, before the command, when the launch is not what the flags suggest

    def command_line(self) -> str:
        """The command as one shell line, with the variables it sets in front."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env_updates.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def _visible_devices(environ: Mapping[str, str], gpu_count: int) -> list[str]:
    """GPU ids this process may use, as CUDA_VISIBLE_DEVICES names them."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        return [d.strip() for d in visible.split(",") if d.strip()][:gpu_count]
    return [str(i) for i in range(gpu_count)]


def _parse_node_filter(text: str, flag: str) -> list[str] | None:
    """Slots named by a DeepSpeed ``NAME[:SLOT,...][@NAME...]`` filter for this node; None means all."""
    from hf_zero.launch.hostfile import parse_filter

    local_names = {"localhost", "127.0.0.1", socket.gethostname()}
    named = parse_filter(text, flag)
    for name in named:
        if name not in local_names:
            raise LaunchError(
                f"{flag} {text!r} names host {name!r}, but hf-zero launch only selects GPUs of this node "
                '(write e.g. "localhost:0,1" and run hf-zero launch on each node).'
            )
    if any(not slots for slots in named.values()):
        return None  # a name without slots: the whole node
    return list(dict.fromkeys(str(s) for slots in named.values() for s in slots))


def _select_devices(include: str, exclude: str, available: list[str]) -> list[str]:
    """Apply --include/--exclude to this node's GPUs, the way DeepSpeed filters a hostfile's slots."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive.")
    if not available:
        raise LaunchError("--include/--exclude select GPUs, but this machine has no visible GPU.")
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    slots = _parse_node_filter(text, flag)
    unknown = [s for s in (slots or []) if s not in available]
    if unknown:
        raise LaunchError(
            f"{flag} {text!r} names GPU {unknown[0]}, but the visible GPUs are {','.join(available)}."
        )
    if include:
        return available if slots is None else slots
    chosen = [] if slots is None else [d for d in available if d not in slots]
    if not chosen:
        raise LaunchError(f"--exclude {text!r} leaves no GPU to run on.")
    return chosen


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str], gpu_count: int) -> LaunchPlan:
    """Translate parsed ``hf-zero launch`` flags into a torchrun command; pure, so it is unit-testable.

    ``gpu_count`` is what ``torch.cuda.device_count()`` reports (0 on a CPU machine). With
    ``--config_file`` (an Accelerate YAML of ``distributed_type: DEEPSPEED``) the YAML and Accelerate's
    flags are translated first (:mod:`hf_zero.integrations.accelerate_launch`) into these same flags.
    """
    if getattr(args, "config_file", None) is not None:
        launch, env, notice = accelerate_launch.translate(args, environ)
        plan = plan_launch(launch, environ, gpu_count)
        return LaunchPlan(argv=plan.argv, env_updates={**plan.env_updates, **env},
                          notice="; ".join(filter(None, [notice, plan.notice])))
    given = accelerate_launch.accelerate_flags_given(args)
    if given:
        raise LaunchError(f"{given[0]} is an accelerate launch flag, read with --config_file (an Accelerate YAML); "
                          "without one use DeepSpeed's flags (--num_gpus, --num_nodes, --node_rank, --master_addr).")
    for name in ("hostfile", "launcher", "launcher_args", "ssh_port", "force_multi", "venv_script"):
        if getattr(args, name, None) is not None:  # hf_zero.launch.job.plan resolves these before this node's plan
            raise LaunchError(f"--{name} starts other hosts; plan_launch plans this node only (use hf_zero.launch.job.plan).")
    for name in UNSUPPORTED_FLAGS:
        if getattr(args, name) is not None:
            raise LaunchError(f"--{name} is a DeepSpeed launcher flag that hf-zero launch does not support.")
    num_nodes = 1 if args.num_nodes is None else args.num_nodes
    if num_nodes < 1:
        raise LaunchError(f"--num_nodes: got {num_nodes}, expected an integer >= 1.")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together.")
    if num_nodes > 1:
        if not args.master_addr and args.node_rank is None:
            raise LaunchError(f"--num_nodes {num_nodes} needs the nodes: pass --hostfile H (lines 'HOSTNAME slots=N') to "
                              "start them all from here, or run hf-zero launch on each with --node_rank R --master_addr A.")
        if not args.master_addr:
            raise LaunchError("a multi-node run needs --master_addr, the address of the node with --node_rank 0.")
        if args.node_rank is None:
            raise LaunchError("a multi-node run needs --node_rank on each node (0 on the node at --master_addr).")
    node_rank = 0 if args.node_rank is None else args.node_rank
    if not 0 <= node_rank < num_nodes:
        raise LaunchError(f"--node_rank: got {node_rank}, expected a value in [0, {num_nodes}).")

    env_updates: dict[str, str] = {}
    notice = ""
    available = _visible_devices(environ, gpu_count)
    if args.include or args.exclude:
        if args.num_gpus is not None:
            raise LaunchError(
                "--num_gpus cannot be combined with --include/--exclude (they already choose the GPUs)."
            )
        chosen = _select_devices(args.include, args.exclude, available)
        env_updates["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
        nproc = len(chosen)
    elif gpu_count > 0:
        nproc = gpu_count if args.num_gpus is None else args.num_gpus
        if not 1 <= nproc <= gpu_count:
            raise LaunchError(f"--num_gpus: got {nproc}, but this node has {gpu_count} visible GPU(s).")
    else:
        nproc = 1 if args.num_gpus is None else args.num_gpus
        if nproc < 1:
            raise LaunchError(f"--num_gpus: got {nproc}, expected an integer >= 1.")
        # torchrun sets OMP_NUM_THREADS=1 itself only when it starts more than one process;
        # CPU ranks always share the cores, so set it whenever the user has not.
        if "OMP_NUM_THREADS" not in environ:
            env_updates["OMP_NUM_THREADS"] = "1"
        # Without it, Accelerate (and so transformers' Trainer) makes each process a world of one
        # when no GPU is visible: every rank would train on all the data and act as the main process.
        if "ACCELERATE_USE_CPU" not in environ:
            env_updates["ACCELERATE_USE_CPU"] = "true"
        notice = f"no GPU is visible: starting {nproc} CPU process{'es' if nproc > 1 else ''} (communication over gloo)"
    if args.max_restarts < 0:
        raise LaunchError(f"--max_restarts: got {args.max_restarts}, expected an integer >= 0.")

    addr = args.master_addr or "127.0.0.1"
    port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={num_nodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        f"--master-addr={addr}",
        f"--master-port={port}",
        f"--max-restarts={args.max_restarts}",
    ]
    rdzv = getattr(args, "rdzv_backend", None)
    if rdzv not in (None, "static"):  # an Accelerate YAML's (c10d, etcd): its endpoint is the main process's address
        argv += [f"--rdzv-backend={rdzv}", f"--rdzv-endpoint={addr}:{port}"]
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no-python")
    argv += [args.script, *args.script_args]
    return LaunchPlan(argv=argv, env_updates=env_updates, notice=notice)


def run_plan(plan: LaunchPlan) -> int:
    """Run the plan; on POSIX this process becomes torchrun, so its exit code and signals are torchrun's."""
    if plan.notice:
        print(f"hf-zero launch: {plan.notice}", file=sys.stderr, flush=True)
    print(f"hf-zero launch: {plan.command_line()}", file=sys.stderr, flush=True)
    env = {**os.environ, **plan.env_updates}  # everything else (NCCL_*, HF_*, ...) passes through
    sys.stdout.flush()
    if os.name == "posix":
        os.execve(plan.argv[0], plan.argv, env)
    return subprocess.call(plan.argv, env=env)  # pragma: no cover - non-POSIX fallback
