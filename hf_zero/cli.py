"""The ``hf-zero`` command: ``launch`` (DeepSpeed's launcher flags, run by torchrun), ``estimate``,
``consolidate``, and ``push`` / ``pull`` (the Hugging Face Hub, through :mod:`hf_zero.hub`).

``hf-zero launch`` is a translation, not a launcher of its own: it maps DeepSpeed's
flags one to one onto ``torch.distributed.run`` and then *becomes* that process (``exec``), so
torchrun's exit code, signal handling and restarts are exactly torchrun's. The command it runs
is printed on one line to stderr, so the mapping is never hidden.

A multi-node run is ``hf-zero launch --num_nodes M --node_rank R --master_addr A`` on every node, or,
as DeepSpeed does it, one ``hf-zero launch --hostfile H`` that starts that command on every host of the
hostfile over pdsh, ssh or srun (:mod:`hf_zero.launch`, which this module asks first).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hf_zero.errors import LaunchError
from hf_zero.integrations import accelerate_launch

DEFAULT_MASTER_PORT = 29500  # DeepSpeed's (and torch's) default rendezvous port

# DeepSpeed flags with no torchrun counterpart.
_UNSUPPORTED_FLAGS = (
    "elastic_training",
    "min_elastic_nodes",
    "max_elastic_nodes",
    "autotuning",
    "bind_cores_to_rank",
    "bind_core_list",
    "enable_each_rank_log",
    "save_pid",
    "comment",
    "account",
)


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


# ----------------------------------------------------------------------------- launch


def _add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch",
        help="start a training script on every GPU of this node through torchrun (DeepSpeed's flags)",
        description="Start SCRIPT with torchrun, taking DeepSpeed launcher flags. Everything after "
        "SCRIPT is passed to it untouched. Multi-node: --hostfile H starts every host of H from here (over pdsh, "
        "ssh or srun), or run this on each node with --num_nodes, --node_rank and --master_addr.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=None,
        help="processes on this node (default: the visible GPUs; on a machine without GPUs, 1 CPU process)",
    )
    p.add_argument("--num_nodes", type=int, default=None, help="number of nodes (default 1, or every host of --hostfile)")
    p.add_argument("--node_rank", type=int, default=None, help="this node's index in [0, num_nodes)")
    p.add_argument("--master_addr", default=None, help="address of node 0 (default 127.0.0.1 on one node)")
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port (default 29500)")
    p.add_argument(
        "--max_restarts", type=int, default=0, help="torchrun restarts of the whole group on failure"
    )
    p.add_argument("-i", "--include", default="", help='hosts/GPUs to use, e.g. "localhost:0,1" or "worker-0@worker-1:0,2"')
    p.add_argument("-e", "--exclude", default="", help='hosts/GPUs to leave out, e.g. "localhost:3" or "worker-1:0"')
    p.add_argument("-H", "--hostfile", default=None, help="DeepSpeed's hostfile ('HOST slots=N' lines): start every "
                   "host from here (default /job/hostfile when it exists)")
    p.add_argument("--launcher", default=None, help="how a hostfile's hosts are started: pdsh (default when installed), "
                   "ssh, or slurm (srun)")
    p.add_argument("--launcher_args", default=None, help="extra arguments for pdsh, ssh or srun, as one quoted string")
    p.add_argument("--ssh_port", default=None, help="ssh port of the hosts")
    p.add_argument("--force_multi", action="store_true", default=None, help="start a one-host hostfile over ssh too")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the check that every host answers over ssh")
    p.add_argument("--venv_script", default=None, help="a script every node sources first (a virtualenv's activate)")
    p.add_argument("--module", action="store_true", help="run SCRIPT as a module, like python -m")
    p.add_argument("--no_python", action="store_true", help="run SCRIPT directly, not through python")
    p.add_argument(
        "--no_local_rank",
        action="store_true",
        help="accepted for DeepSpeed compatibility: --local_rank is never appended, LOCAL_RANK is exported",
    )
    p.add_argument("--no_ssh", action="store_true", help="start this node only (--node_rank R), even with a hostfile")
    for name in _UNSUPPORTED_FLAGS:
        if name not in ("elastic_training", "bind_cores_to_rank", "save_pid"):
            p.add_argument(f"--{name}", dest=name, default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(f"--{name}", dest=name, action="store_true", default=None, help=argparse.SUPPRESS)
    accelerate_launch.add_arguments(p)
    p.add_argument("script", help="the training script (or module with --module, program with --no_python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script, passed untouched")
    p.set_defaults(handler=_cmd_launch)


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
    for name in _UNSUPPORTED_FLAGS:
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


def _cmd_launch(args: argparse.Namespace) -> int:
    import torch

    from hf_zero.launch import job, supervise

    target = job.plan(args, os.environ)  # a hostfile's hosts, or this node's flags
    if isinstance(target, job.MultiNodeJob):
        return supervise.run(target)
    plan = plan_launch(target, os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return run_plan(plan)


# ---------------------------------------------------------------------------- estimate


def _add_estimate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="per-GPU memory for parameters, gradients and optimizer state at ZeRO stages 0-3",
        description="Print the bytes one rank of this engine holds at the optimizer step, for each ZeRO stage.",
        allow_abbrev=False,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a model directory, a config.json, or a Hub model id")
    source.add_argument("--params", help="number of trainable parameters, e.g. 1.1e9, 7B, 350M")
    p.add_argument("--num_gpus", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--num_nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="training precision")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd", "sgd_momentum"])
    p.add_argument("--ref-model", "--ref_model", dest="ref_model", nargs="?", const="same", default=None, metavar="MODEL_OR_PARAMS",
                   help="also count a frozen reference model (TRL's DPO ref_model): alone, the same model again; or a "
                   "model directory / config.json / Hub id, or a parameter count such as 7B")
    p.set_defaults(handler=_cmd_estimate)


def _printable(text: str) -> str:
    """Ψ where the terminal can show it, "Psi" where it cannot (e.g. an ASCII-only locale)."""
    try:
        text.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return text.replace("Ψ", "Psi")
    return text


def _cmd_estimate(args: argparse.Namespace) -> int:
    from hf_zero import estimate

    if args.num_gpus < 1 or args.num_nodes < 1:
        raise ValueError(
            f"--num_gpus and --num_nodes must be >= 1, got {args.num_gpus} and {args.num_nodes}."
        )
    if args.params is not None:
        num_params = estimate.parse_param_count(args.params)
    else:
        model = estimate.build_model_on_meta(args.model)
        num_params = estimate.count_model_parameters(model)
        print(f"{args.model}: {num_params:,} trainable parameters ({type(model).__name__}, built on the meta device)")
    ref_params = None
    if args.ref_model == "same":
        ref_params = num_params
    elif args.ref_model is not None:
        try:
            ref_params = estimate.parse_param_count(args.ref_model)
        except ValueError:
            ref_params = estimate.count_model_parameters(estimate.build_model_on_meta(args.ref_model))
    print(
        _printable(
            estimate.format_table(num_params, args.num_gpus, args.num_nodes, args.dtype, args.optimizer, ref_params=ref_params)
        )
    )
    return 0


# -------------------------------------------------------------------------------- plan


def _add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_zero.planner import GPUS, PRESETS

    p = subparsers.add_parser(
        "plan",
        help="per-GPU memory and communication of a layout on many machines; with no layout, rank the layouts that fit",
        description="Print one layout's memory per GPU (weights, gradients, optimizer state, activations) and the bytes "
        "each collective moves per step inside and across nodes, with the time they imply; with no --tp/--pp/--sp/"
        "--dp-replicate/--dp-shard, rank every layout that fits in memory by that time.",
        allow_abbrev=False,
    )
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(PRESETS)}), a model directory or a config.json")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", "--gpus_per_node", dest="gpus_per_node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="defaults for memory and bandwidths (default h100)")
    p.add_argument("--gpu-memory", "--gpu_memory", dest="gpu_memory", type=float, default=None,
                   help="GiB per GPU (h100: 79.6, h200: 140.4, what the driver reports)")
    p.add_argument("--reserve", type=float, default=4.0, help="GiB per GPU kept out of the plan (CUDA context, NCCL, "
                   "fragmentation; default 4)")
    p.add_argument("--intra-bw", "--intra_bw", dest="intra_bw", type=float, default=None,
                   help="GB/s per GPU each way inside a node (default 450: NVLink 4, 900 GB/s both ways)")
    p.add_argument("--inter-bw", "--inter_bw", dest="inter_bw", type=float, default=None,
                   help="GB/s per GPU each way across nodes (default 50: one 400 Gb/s InfiniBand adapter per GPU)")
    p.add_argument("--micro-batch", "--micro_batch", dest="micro_batch", type=int, default=1, help="sequences per micro-step per data-parallel rank")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--grad-accum", "--grad_accum", dest="grad_accum", type=int, default=1,
                   help="micro-steps per optimizer step (default 1)")
    p.add_argument("--global-batch", "--global_batch", dest="global_batch", type=int, default=None,
                   help="sequences per optimizer step that every ranked layout trains (default: GPUs x micro-batch x "
                   "grad-accum, flat data parallelism's); each layout runs the micro-steps that takes")
    p.add_argument("--zero-stage", "--zero_stage", dest="zero_stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO stage (with a layout: default 3; without one: rank every stage unless given)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype (16-bit: fp32 masters)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd", "sgd_momentum"])
    p.add_argument("--recompute", default="full", choices=["full", "none"],
                   help="activation checkpointing of every block (default full)")
    p.add_argument("--attention", default="flash", choices=["flash", "eager"],
                   help="flash/SDPA keeps no seq x seq scores; eager does (default flash)")
    p.add_argument("--persistence-threshold", "--persistence_threshold", dest="persistence_threshold", type=int, default=100_000,
                   help="stage3_param_persistence_threshold (default 100000, hf_zero's)")
    for axis, what in (("tp", "tensor-parallel degree"), ("pp", "pipeline stages"), ("sp", "Ulysses sequence-parallel degree"),
                       ("dp-replicate", "replicas of hybrid sharding (shard inside groups, replicate across)"),
                       ("dp-shard", "ranks ZeRO shards over (default: the GPUs the other degrees leave)")):
        p.add_argument(f"--{axis}", f"--{axis.replace('-', '_')}", dest=axis.replace("-", "_"), type=int, default=None, help=what)
    p.add_argument("--top", type=int, default=15, help="rows of the ranking (default 15)")
    p.add_argument("--rank-by", "--rank_by", dest="rank_by", default="comm", choices=["comm", "step"],
                   help="order of the ranking: implied communication time (default), or step time (arithmetic at --tflops "
                   "stretched by the pipeline bubble, plus communication)")
    p.add_argument("--tflops", type=float, default=400.0,
                   help="dense 16-bit TFLOP/s a GPU achieves in training, for the step column (default 400)")
    p.set_defaults(handler=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from hf_zero import planner, planner_report
    from hf_zero.parallel import GridShape

    for name in ("nodes", "gpus_per_node", "micro_batch", "seq", "grad_accum", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected an integer >= 1")
    gpu = planner.GPUS[args.gpu]
    machines = planner.Machines(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        memory_gib=args.gpu_memory if args.gpu_memory is not None else gpu["memory_gib"],
        intra_gbs=args.intra_bw if args.intra_bw is not None else gpu["intra_gbs"],
        inter_gbs=args.inter_bw if args.inter_bw is not None else gpu["inter_gbs"], reserve_gib=args.reserve,
        tflops=args.tflops,
    )
    if machines.memory_gib <= 0 or machines.intra_gbs <= 0 or machines.inter_gbs <= 0 or machines.tflops <= 0:
        raise ValueError("--gpu-memory, --intra-bw, --inter-bw and --tflops must be positive")
    training = planner.Training(
        micro_batch=args.micro_batch, seq=args.seq, zero_stage=3 if args.zero_stage is None else args.zero_stage,
        grad_accum=args.grad_accum, dtype=args.dtype, optimizer=args.optimizer, recompute=args.recompute,
        attention=args.attention, persistence_threshold=args.persistence_threshold,
    )
    config, source = planner.load_config(args.model)
    facts = planner.model_facts(config, source)
    degrees = {a: getattr(args, a) for a in ("tp", "pp", "sp", "dp_replicate", "dp_shard")}
    if any(v is not None for v in degrees.values()):
        for a, v in degrees.items():
            if v is not None and v < 1:
                raise ValueError(f"--{a.replace('_', '-')}: got {v}, expected an integer >= 1")
        shape = GridShape.fill(machines.world, pp=degrees["pp"] or 1, sp=degrees["sp"] or 1, tp=degrees["tp"] or 1,
                               dp_replicate=degrees["dp_replicate"] or 1)
        if degrees["dp_shard"] is not None and degrees["dp_shard"] != shape.dp_shard:
            raise ValueError(f"--dp-shard: got {degrees['dp_shard']}, but the {machines.world} GPUs leave {shape.dp_shard} "
                             "for it after the other degrees; drop --dp-shard or make the product the number of GPUs")
        why = planner.unfit(facts, shape)
        if why:
            raise ValueError(f"the layout {shape.describe()} cannot cut this model: {why}")
        print(_printable(planner_report.format_plan(planner.plan(facts, shape, machines, training), facts, machines, source)))
        return 0
    stages = (0, 1, 2, 3) if args.zero_stage is None else (args.zero_stage,)
    global_batch = args.global_batch or machines.world * args.micro_batch * args.grad_accum
    if global_batch < 1:
        raise ValueError(f"--global-batch: got {global_batch}, expected an integer >= 1")
    considered = planner.layouts(facts, machines, stages)
    ranked = planner.rank_layouts(facts, machines, training, global_batch, stages, by=args.rank_by)
    print(_printable(planner_report.format_ranking(ranked, facts, machines, training, source, args.top,
                                                   len(considered), global_batch, by=args.rank_by)))
    return 0


# ------------------------------------------------------------------------- consolidate


def _add_consolidate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="turn a resume checkpoint into a from_pretrained folder (offline, on a CPU)",
        description="Write a resume checkpoint's full weights in Hugging Face's safetensors layout, one tensor at "
        "a time (memory bounded by the largest tensor). Trainable weights come from the fp32 masters.",
        allow_abbrev=False,
    )
    p.add_argument("checkpoint_dir", help="the save_checkpoint directory (its 'latest' is used), a tag inside it, or a "
                   "Trainer output dir (its newest checkpoint-N is used)")
    p.add_argument("out_dir", help="where to write model.safetensors / shards, config.json, generation_config.json")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--max_shard_size", default="5GB", help="split into shards above this size (default 5GB)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "auto"],
                   help="dtype of the floating weights; auto keeps the dtype the model trained in (default fp32)")
    p.add_argument("--merge-adapters", "--merge_adapters", dest="merge_adapters", action="store_true",
                   help="a PEFT model: write full weights with the adapters merged in (peft's merge_and_unload) instead "
                   "of the adapter folder (adapter_model.safetensors + adapter_config.json) written by default")
    p.set_defaults(handler=_cmd_consolidate)


def _trainer_checkpoints(path: str) -> list[tuple[int, str]]:
    """``(N, folder)`` of a Trainer output dir's ``checkpoint-N`` folders that hold hf_zero resume state, oldest first."""
    found = []
    for name in os.listdir(path):
        number = name[len("checkpoint-"):]
        if name.startswith("checkpoint-") and number.isdigit() and os.path.isfile(os.path.join(path, name, "latest")):
            found.append((int(number), os.path.join(path, name)))
    return sorted(found)


def find_checkpoint(path: str, tag: str | None) -> tuple[str, str | None]:
    """The (folder, tag) that ``hf-zero consolidate PATH [--tag T]`` reads; errors name the command's own arguments.

    PATH may be a folder ``save_checkpoint`` wrote (its ``latest`` names the tag), one tag inside
    it, or a Trainer's output dir, whose newest ``checkpoint-N`` is taken.
    """
    if not os.path.isdir(path):
        raise ValueError(f"CHECKPOINT_DIR {path} does not exist; pass the folder save_checkpoint (or the Trainer) wrote")
    if tag is not None:
        if not os.path.isfile(os.path.join(path, tag, "checkpoint.json")):
            tags = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "checkpoint.json")))
            have = f"its checkpoints are {', '.join(tags)}" if tags else "it holds no complete checkpoint"
            raise ValueError(f"--tag {tag}: {path} has no complete checkpoint of that name; {have}")
        return path, tag
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    if os.path.isfile(os.path.join(path, "checkpoint.json")):  # a tag folder itself
        parent, name = os.path.split(os.path.normpath(path))
        return parent, name
    runs = _trainer_checkpoints(path)
    if runs:
        return runs[-1][1], None
    if any(name.startswith("checkpoint-") for name in os.listdir(path)):
        raise ValueError(f"{path}: its checkpoint-N folders hold no hf_zero resume state (saved without zero_config, "
                         "or with save_only_model); nothing to consolidate")
    raise ValueError(f"{path} holds no resume checkpoint (no 'latest' file, no Trainer checkpoint-N folder); pass the "
                     "folder save_checkpoint wrote, or name a checkpoint inside it with --tag")


def _cmd_consolidate(args: argparse.Namespace) -> int:
    import torch

    from hf_zero.checkpoint.consolidated import consolidate

    ckpt, tag = find_checkpoint(args.checkpoint_dir, args.tag)
    if os.path.normpath(ckpt) != os.path.normpath(args.checkpoint_dir) and tag is None:
        print(f"hf-zero consolidate: reading {ckpt} (the newest checkpoint-N)", file=sys.stderr)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}[args.dtype]
    from hf_zero.checkpoint import adapters as hz_peft

    if args.merge_adapters or hz_peft.is_peft_checkpoint(ckpt, tag):
        files = hz_peft.consolidate(ckpt, args.out_dir, tag=tag, merge=args.merge_adapters,
                                    max_shard_size=args.max_shard_size, dtype=dtype)
    else:
        files = consolidate(ckpt, args.out_dir, tag=tag, max_shard_size=args.max_shard_size, dtype=dtype)
    print(f"wrote {len(files)} weight file(s) to {args.out_dir}")
    return 0


# ------------------------------------------------------------------------- convert-deepspeed


def _add_convert_deepspeed_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert-deepspeed",
        help="turn a DeepSpeed ZeRO checkpoint into an hf_zero one (and, with --consolidated, Hugging Face weights)",
        description="Rewrite a DeepSpeed checkpoint (ZeRO 0-3, fp32/bf16/fp16) as an hf_zero resume checkpoint in "
        "DST/<tag> (and DST/latest): fp32 masters, optimizer moments and step counts, scheduler, loss scaler, "
        "counters and client state, by parameter name, loadable at any world size and stage. Needs no DeepSpeed and "
        "runs no code from the pickles (torch's weights-only loader). engine.load_checkpoint reads DeepSpeed folders "
        "directly too; this makes a lasting copy. --consolidated also writes the fp32 weights as a from_pretrained "
        "folder (DeepSpeed's zero_to_fp32.py, as safetensors).",
        allow_abbrev=False,
    )
    p.add_argument("src", help="DeepSpeed's save_dir (its 'latest' is used), or a tag folder inside it")
    p.add_argument("dst", help="where to write the hf_zero checkpoint (DST/<tag>, DST/latest)")
    p.add_argument("--tag", default=None, help="checkpoint tag inside SRC (default: the one 'latest' names)")
    p.add_argument("--consolidated", nargs="?", const="", default=None, metavar="DIR",
                   help="also write the fp32 weights as model.safetensors (shards above --max_shard_size) into DIR "
                   "(default DST/consolidated)")
    p.add_argument("--max_shard_size", default="5GB", help="with --consolidated: split into shards above this size")
    p.set_defaults(handler=_cmd_convert_deepspeed)


def _cmd_convert_deepspeed(args: argparse.Namespace) -> int:
    from hf_zero.checkpoint import deepspeed as ds_checkpoint

    if not os.path.isdir(args.src):
        raise ValueError(f"{args.src} does not exist; pass the folder DeepSpeed's save_checkpoint wrote")
    path = ds_checkpoint.convert(args.src, args.dst, tag=args.tag)
    print(f"wrote the hf_zero checkpoint {path}")
    if args.consolidated is not None:
        out = args.consolidated or os.path.join(args.dst, "consolidated")
        files = ds_checkpoint.consolidate(args.src, out, tag=args.tag, max_shard_size=args.max_shard_size)
        print(f"wrote {len(files)} weight file(s) to {out}")
    return 0


# ---------------------------------------------------------------------------- push / pull


def _add_push_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "push",
        help="upload a saved model folder to the Hugging Face Hub (with a model card if it has none)",
        description="Upload DIR to the Hub repo REPO_ID in one commit, creating the repo (and the branch "
        "named by --revision) if needed, and a model card if DIR has no README.md. Resume checkpoints "
        "(global_step*/, latest, checkpoint-*/) stay local unless --include-resume-state. The token comes from "
        "HF_TOKEN or `hf auth login`, never from the command line (where other users could read it).",
        allow_abbrev=False,
    )
    p.add_argument(
        "dir", help="a folder written by save_pretrained, engine.save_pretrained or hf-zero consolidate"
    )
    p.add_argument("repo_id", help="the Hub repo, e.g. my-user/my-model")
    p.add_argument("--revision", default=None, help="branch to commit to (created from main if missing)")
    p.add_argument(
        "--private", action="store_true", default=None, help="create the repo private (new repos only)"
    )
    p.add_argument("--commit-message", "--commit_message", dest="commit_message", default=None,
                   help="commit summary (default: a fixed hf_zero message)")
    p.add_argument("--create-pr", "--create_pr", dest="create_pr", action="store_true",
                   help="open a pull request against main instead of committing to it")
    p.add_argument(
        "--include-resume-state",
        "--include_resume_state",
        dest="include_resume_state",
        action="store_true",
        help="also upload resume checkpoints (optimizer state, RNG, 'latest')",
    )
    p.set_defaults(handler=_cmd_push)


def _cmd_push(args: argparse.Namespace) -> int:
    from hf_zero.hub import push_to_hub

    url = push_to_hub(args.dir, args.repo_id, revision=args.revision, private=args.private,
                      commit_message=args.commit_message, create_pr=args.create_pr,
                      include_resume_state=args.include_resume_state)
    print(f"pushed {args.dir} to {args.repo_id}: {url}")
    return 0


def _add_pull_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull",
        help="download a Hub model repo into a folder",
        description="Download every file of the Hub repo REPO_ID (at --revision) into DIR as plain files, "
        "ready for from_pretrained (or load_checkpoint, when resume state was pushed).",
        allow_abbrev=False,
    )
    p.add_argument("repo_id", help="the Hub repo, e.g. my-user/my-model")
    p.add_argument("dir", help="where to put the files (created if missing)")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.set_defaults(handler=_cmd_pull)


def _cmd_pull(args: argparse.Namespace) -> int:
    from hf_zero.hub import pull_from_hub

    path = pull_from_hub(args.repo_id, args.dir, revision=args.revision)
    print(f"pulled {args.repo_id}{'@' + args.revision if args.revision else ''} into {path}")
    return 0


# -------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-zero`` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="hf-zero",
        description="ZeRO training for the Hugging Face stack: launch jobs, size them, and move their "
        "weights to and from the Hub.",
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="{launch,estimate,plan,consolidate,convert-deepspeed,push,pull}", required=True
    )
    _add_launch_parser(subparsers)
    _add_estimate_parser(subparsers)
    _add_plan_parser(subparsers)
    _add_consolidate_parser(subparsers)
    _add_convert_deepspeed_parser(subparsers)
    _add_push_parser(subparsers)
    _add_pull_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-zero`` console script; returns the exit status."""
    from hf_zero.hub import HubError  # light: huggingface_hub is imported only when a push/pull runs

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (LaunchError, HubError, ValueError, OSError) as e:
        print(f"hf-zero {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
