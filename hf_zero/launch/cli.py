"""The ``hf-zero`` command: ``launch`` (DeepSpeed's launcher flags, run by torchrun), ``estimate``, ``plan``,
``consolidate``, ``convert-deepspeed``, and ``push`` / ``pull`` (the Hugging Face Hub, through :mod:`hf_zero.hub.transfer`).

This module is the subcommands' parsers and handlers; what a subcommand does lives in the module it names.
``hf-zero launch``'s flags are :mod:`hf_zero.launch.flags`' table and its one-node translation to torchrun is
:mod:`hf_zero.launch.local` (``LaunchPlan``, ``plan_launch``, ``run_plan`` and ``DEFAULT_MASTER_PORT`` are
importable from here as well, where scripts and tests found them first).

A multi-node run is ``hf-zero launch --num_nodes M --node_rank R --master_addr A`` on every node, or,
as DeepSpeed does it, one ``hf-zero launch --hostfile H`` that starts that command on every host of the
hostfile over pdsh, ssh or srun (:mod:`hf_zero.launch`, which this module asks first).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hf_zero.errors import LaunchError
from hf_zero.launch import flags
from hf_zero.launch.local import DEFAULT_MASTER_PORT, LaunchPlan, plan_launch, run_plan

__all__ = ["DEFAULT_MASTER_PORT", "LaunchError", "LaunchPlan", "build_parser", "find_checkpoint", "main",
           "plan_launch", "run_plan"]


# ----------------------------------------------------------------------------- launch


def _add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    flags.add_launch_parser(subparsers).set_defaults(handler=_cmd_launch)


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
    from hf_zero.planning import estimate

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
    from hf_zero.planning.planner import GPUS, PRESETS

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
    from hf_zero.parallel import GridShape
    from hf_zero.planning import planner
    from hf_zero.planning import report as planner_report

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
        "a time (memory bounded by the largest tensor). Trainable weights come from the fp32 masters. A folder "
        "DeepSpeed's save_checkpoint wrote is read too (its zero_to_fp32, AutoEP's expert blocks made whole).",
        allow_abbrev=False,
    )
    p.add_argument("checkpoint_dir", help="the save_checkpoint directory (its 'latest' is used; hf_zero's or "
                   "DeepSpeed's), a tag inside it, or a Trainer output dir (its newest checkpoint-N is used)")
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

    from hf_zero.checkpoint import deepspeed as ds_checkpoint
    from hf_zero.checkpoint.consolidated import consolidate

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}[args.dtype]
    if os.path.isdir(args.checkpoint_dir) and ds_checkpoint.is_deepspeed_checkpoint(args.checkpoint_dir, args.tag):
        # a folder DeepSpeed wrote (AutoEP's included): its zero_to_fp32, as convert-deepspeed --consolidated
        if args.merge_adapters:
            raise ValueError(f"--merge-adapters: {args.checkpoint_dir} is a DeepSpeed checkpoint, which holds no peft "
                             "adapters of hf_zero's; consolidate it without the flag")
        files = ds_checkpoint.consolidate(args.checkpoint_dir, args.out_dir, tag=args.tag,
                                          max_shard_size=args.max_shard_size, dtype=dtype)
        print(f"wrote {len(files)} weight file(s) to {args.out_dir}")
        return 0
    ckpt, tag = find_checkpoint(args.checkpoint_dir, args.tag)
    if os.path.normpath(ckpt) != os.path.normpath(args.checkpoint_dir) and tag is None:
        print(f"hf-zero consolidate: reading {ckpt} (the newest checkpoint-N)", file=sys.stderr)
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
    from hf_zero.hub.transfer import push_to_hub

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
    from hf_zero.hub.transfer import pull_from_hub

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
    from hf_zero.hub.transfer import HubError  # light: huggingface_hub is imported only when a push/pull runs

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (LaunchError, HubError, ValueError, OSError) as e:
        print(f"hf-zero {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
