"""Throughput of hf_zero's stages beside DDP and FSDP2 on a Llama shape built from a config.

Run on the GPU machine:

    python benchmarks/bench.py --gpus 4 --model 1.1b --engines hf1,hf2,hf3,ddp,fsdp2,ds2,ds3
    python benchmarks/bench.py --gpus 1 --model 2.8b --engines hf2o,hf3o,ds2o,ds3o,fsdp2o --steps 4   # optimizer offload
    python benchmarks/bench.py --gpus 1 --model 2.8b --engines hf3op,ds3op,fsdp2o --steps 4   # + parameter offload
    python benchmarks/bench.py --gpus 1 --model 2.8b --engines hf3op,hf2nvme,hf3nvme --steps 4 --nvme_path /local_nvme   # NVMe
    python benchmarks/bench.py --gpus 1 --model 2.8b --engines hf2,hf2o,hf3,hf3o --gas 8 --steps 3   # offload's cost at accumulation 8
    python benchmarks/bench.py --gpus 1 --model 2.8b --engines hf2o,hf2og,fsdp2o --bucket 1e8   # the CPU step beside the next forward
    python benchmarks/bench.py --gpus 2 --model 2.8b --engines hf2o,hf2os,hf3op,hf3ops,fsdp2o --bucket 1e8   # super_offload
    python benchmarks/bench.py --gpus 1 --model 1.1b --engines hf2,tr2,hf3,tr3   # the Trainer path against the raw engine
    python benchmarks/bench.py --gpus 2 --model 1.1b --engines hf2,hf2g,fsdp2 --bucket 1e8   # the step's all-gather in the next forward
    python benchmarks/bench.py --gpus 4 --model 8b --micro 1 --engines hf3,hf3h,hf3tp,fsdp2,fsdp2tp --bucket 1e8   # composed layouts
    python benchmarks/bench.py --gpus 2 --model 1.1b --compile --engines hf3,hf3f8,fsdp2,fsdp2f8   # float8 (torchao)

Composed layouts (each as a user configures it): ``hf3h`` ZeRO-3 with hybrid sharding (``mics_shard_size`` =
``--shard``, default half the GPUs; 1 x 2 on 2 GPUs), ``hf3tp`` AutoTP ``--tp`` (default 2) x ZeRO-3 over the
remaining ranks, ``fsdp2tp`` FSDP2 over a (dp, tp) DeviceMesh after torch's ``parallelize_module`` (torchtitan's
composition). Their rows are named with their layout; tokens/s stays per GPU (a tp group shares one micro-batch of
``--micro``); under the table, the planner's predicted communication and step time for hf3, hf3h and hf3tp stand
beside the measured step.

Each engine runs in its own torchrun (one process per GPU), so no engine's memory or caches
leak into the next one's peak. ``ds2``/``ds3`` need DeepSpeed importable.

Every engine trains the same randomly initialised Llama (bf16 compute, AdamW, no activation
checkpointing) on random tokens; tokens/s is per GPU, the median of the timed steps after the
warm-up; MFU counts 6·N + 12·layers·hidden·seq FLOPs per token against 989 TFLOP/s (as
BASELINES.md); peak memory is torch.cuda.max_memory_allocated on the largest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# the repository root first, so that hf_zero and tests import without an install (the device machine has none)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "7.2b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    # Llama-2-13B's shape: 13.0B parameters, 208 GB of fp32 weights + gradients + Adam state for DDP
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40),
    # BASELINES.md's offload shape (2.81B parameters)
    "2.8b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=26, num_attention_heads=24, num_key_value_heads=8),
    # larger offload shapes for "the largest model one GPU trains" (host memory is what limits them)
    "5b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=8),
    "6b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    # Llama-3-8B's shape (8.03B parameters with its 128,256-token vocabulary): issue 17's offload shape
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256),
}
PEAK_TFLOPS = 989.0


def build_model(shape: str, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # use_cache=False: training needs no KV cache, and with one transformers hands every block a
    # cache whose per-layer index makes torch.compile build a graph per block (eager past 8).
    cfg = LlamaConfig(max_position_embeddings=seq, use_cache=False, **{"vocab_size": 32000, **SHAPES[shape]})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):  # (inside zero.Init, modules are built on the GPU and sliced as they are made)
        model = LlamaForCausalLM(cfg)
    return model


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq


def hf_zero_section(stage: int, args: argparse.Namespace, name: str = "") -> dict:
    """The hf engines' ``zero_optimization`` (the raw engine's and the Trainer's alike): buckets and prefetch from the flags.

    A name ending in ``g`` (``hf1g``, ``hf2g``, ``tr2g``) turns on ``overlap_param_gather``: the step's parameter
    all-gather is waited for in the next forward (hf_zero/zero/overlap.py)."""
    return {"stage": stage, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
            **({"stage3_prefetch_bucket_size": int(args.prefetch)} if args.prefetch is not None else {}),
            **({"overlap_param_gather": True} if name.endswith("g") else {})}


# ------------------------------------------------------------------------------------------------ composed layouts
# hf3h: ZeRO-3 with hybrid sharding (zero_optimization.mics_shard_size = --shard: parameters, gradients and optimizer
#   state sharded inside groups of --shard ranks, gradients all-reduced across the world/--shard replicas);
# hf3tp: tensor parallelism (tensor_parallel.autotp_size = --tp, transformers' own base_model_tp_plan) x ZeRO-3 over
#   the world/--tp data-parallel ranks;
# fsdp2tp: torch's own composition as torchtitan builds it (fsdp2_step with tp > 1).
COMPOSED = ("hf3h", "hf3tp", "fsdp2tp")


def hybrid_shard(args: argparse.Namespace, world: int) -> int:
    """hf3h's ``mics_shard_size``: ``--shard``, else half the GPUs (2 replicas x world/2), else on 2 GPUs all of
    them (1 x 2: hybrid sharding's code path at flat ZeRO-3's layout, issue 31 item 5's first row)."""
    if args.shard:
        return args.shard
    return world // 2 if world >= 4 else world


def layout_of(name: str, args: argparse.Namespace, world: int) -> dict:
    """``tp`` (ranks that share one batch), ``label`` (the row's printed name, the layout spelled out) and the
    planner's ``GridShape`` degrees of an engine; every engine outside :data:`COMPOSED` is its name at tp 1."""
    if name == "hf3h":
        shard = hybrid_shard(args, world)
        return {"tp": 1, "label": f"hf3h (replicate {world // shard} x shard {shard})",
                "grid": {"dp_replicate": world // shard, "dp_shard": shard}}
    if name in ("hf3tp", "fsdp2tp"):
        return {"tp": args.tp, "label": f"{name} (tp {args.tp} x dp {world // args.tp})",
                "grid": {"tp": args.tp, "dp_shard": world // args.tp}}
    if name == "hf3":
        return {"tp": 1, "label": name, "grid": {"dp_shard": world}}
    return {"tp": 1, "label": name}


def check_layouts(args: argparse.Namespace, world: int) -> None:
    """One sentence, before any torchrun starts, for a --shard or --tp the world or the shape cannot take."""
    names = args.engines.split(",")
    if "hf3h" in names:
        shard = hybrid_shard(args, world)
        if shard < 1 or world % shard:
            raise SystemExit(f"--shard {shard} does not divide the {world} GPUs; pass a divisor of --gpus")
    if any(n in ("hf3tp", "fsdp2tp") for n in names):
        heads, kv = SHAPES[args.model]["num_attention_heads"], SHAPES[args.model]["num_key_value_heads"]
        if args.tp < 2 or world % args.tp or heads % args.tp or kv % args.tp:
            raise SystemExit(f"--tp {args.tp} must be at least 2 and divide the {world} GPUs and the {args.model} shape's "
                             f"{heads} heads and {kv} kv heads; pass such a --tp")


# hf2nvme, hf3nvme: offload to NVMe under --nvme_path (hf_zero/zero/nvme.py); the aio section from --hf_config
NVME_ENGINES = ("hf2nvme", "hf3nvme")
# hf1os, hf2os, hf3os, hf3ops: optimizer offload with offload_optimizer.super_offload (each group's CPU step taken
# during backward, hf_zero/zero/speculative_step.py SpeculativeHostStep); hf3ops with the parameter shards offloaded too;
# hf1osg, hf2osg: super_offload with overlap_param_gather (the groups backward did not reach stepped in the next forward);
# hf3osg, hf3opsg: the same at stage 3 (each unit's host step where its next gather is: hf_zero/zero/unit_steps.py)
SUPER_ENGINES = ("hf1os", "hf2os", "hf3os", "hf3ops", "hf1osg", "hf2osg", "hf3osg", "hf3opsg")


def hf_engine_config(name: str, args: argparse.Namespace, world: int, offload: bool = False,
                     param_section: dict | None = None) -> dict:
    """An hf row's DeepSpeed-style config, as a user writes it: stage N from the name, buckets from the flags, and
    for the composed rows the one key that makes the layout (``mics_shard_size`` / ``tensor_parallel``).

    ``args.dtype`` (no flag; ``"bf16"`` unless set) ``"fp32"`` drops the bf16 section, for the CPU check in
    tests/test_bench_layouts.py."""
    stage = int(name[2])
    zero = {**hf_zero_section(stage, args, name),
            **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else {}),
            **(param_section or {})}
    if name in SUPER_ENGINES:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "super_offload": True,
                                     **({"cpuadam_cores_perc": args.cores_perc} if args.cores_perc is not None else {})}
    if name in NVME_ENGINES:  # ZeRO-Infinity: the optimizer state (hf2nvme), and at stage 3 the parameters too, on NVMe
        nvme = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True}
        zero["offload_optimizer"] = {**nvme, "buffer_count": 4}
        if stage == 3:
            zero["offload_param"] = {**nvme, "buffer_count": 5, "max_in_cpu": int(args.max_in_cpu)}
    if name == "hf3h":
        zero["mics_shard_size"] = hybrid_shard(args, world)
    # hf3f8: float8 linears (torchao, tensorwise) with stage 3's float8 all-gather; hf3f8r: rowwise, gathers in bf16
    fp8 = {"enabled": True, "recipe": "rowwise" if name.endswith("f8r") else "tensorwise"} if "f8" in name else None
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 0.0,  # as the FSDP2 and DDP rows: no clipping (DeepSpeed's default would be 1.0)
        **({"bf16": {"enabled": True}} if getattr(args, "dtype", "bf16") == "bf16" else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": getattr(args, "lr", 1e-5), "weight_decay": 0.0}},
        "zero_optimization": zero,
        **({"tensor_parallel": {"autotp_size": args.tp}} if name == "hf3tp" else {}),
        **({"fp8": fp8} if fp8 else {}),
        "steps_per_print": 10**9,
        "activation_checkpointing": {"checkpoint_blocks": bool(args.checkpoint_blocks)},
        "wall_clock_breakdown": bool(args.breakdown),
        **json.loads(args.hf_config),
    }
    return cfg


#: torchtitan's plan for a Llama block (torchtitan/models/llama3/infra/parallelize.py, apply_tp), on the module
#: names of transformers' LlamaDecoderLayer: q/k/v and gate/up split by output features (each rank computes its own
#: heads / its slice of the MLP), o and down by input features (their outputs all-reduced over tp).
LLAMA_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}


def fsdp2_step(model: torch.nn.Module, args: argparse.Namespace, offload: bool = False,
               tp: int = 1, float8: bool = False) -> tuple[Callable, int]:
    """FSDP2 (``fully_shard`` per block, then at the root; bf16 parameters, fp32 reduction): ``(step, data_rank)``.

    With ``tp`` > 1, tensor parallelism first, as torchtitan composes them: a 2-D DeviceMesh ``(dp, tp)`` (tp the
    inner, contiguous ranks, as hf_zero's grid), ``parallelize_module`` with :data:`LLAMA_TP_PLAN` on every block
    over the ``tp`` sub-mesh, then ``fully_shard`` over the ``dp`` sub-mesh. Unlike torchtitan, the embedding, the
    norms and the head stay whole on each tp rank (no sequence parallelism, no loss parallelism): the same
    split as hf_zero's AutoTP, so the rows compare like with like. transformers' Llama attention views q/k/v as
    ``(..., -1, head_dim)`` and keeps ``num_key_value_groups`` (a ratio tp does not change), so the local shapes
    work as they are; older versions kept ``num_heads``, ``num_key_value_heads`` and ``hidden_size`` on the module
    for those reshapes, and those are divided by tp where present (as torchtitan divides its own ``n_heads``).

    ``float8`` (the fsdp2f8 row): torchtitan's float8 recipe before sharding: torchao's ``convert_to_float8_training``
    (tensorwise, ``enable_fsdp_float8_all_gather``) on the linears hf_zero's default filter keeps (not the head, both
    dims multiples of 16), and ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step (one all-reduce
    of the amaxes, as torchtitan's ``precompute_float8_dynamic_scale_for_fsdp`` option does).

    ``args.dtype`` ``"fp32"`` (no flag) keeps the parameters in fp32, for the CPU check; ``args.lr`` likewise."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    precompute = None
    if float8:
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )

        from hf_zero.precision.float8 import float8_filter

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=float8_filter(model))
        precompute = precompute_float8_dynamic_scale_for_fsdp

    bf16 = getattr(args, "dtype", "bf16") == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    device = next(model.parameters()).device
    mesh, data_rank = None, dist.get_rank()  # mesh None: fully_shard's default, every rank (the plain fsdp2 row)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        world = dist.get_world_size()
        mesh2d = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in model.model.layers:
            parallelize_module(layer, mesh2d["tp"], {k: styles[v]() for k, v in LLAMA_TP_PLAN.items()})
            for attr in ("num_heads", "num_key_value_heads", "hidden_size"):
                if isinstance(getattr(layer.self_attn, attr, None), int):
                    setattr(layer.self_attn, attr, getattr(layer.self_attn, attr) // tp)
        mesh, data_rank = mesh2d["dp"], mesh2d["dp"].get_local_rank()
    for layer in model.model.layers:
        if args.compile:  # as torchtitan does: compile each block, then shard it
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=getattr(args, "lr", 1e-5), weight_decay=0.0,
                            fused=device.type == "cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute is not None:
            precompute(model)
        return loss

    return step, data_rank


def planned_step(name: str, args: argparse.Namespace, world: int, device_name: str) -> dict:
    """The planner's figures for an hf ZeRO-3 row's layout on one node of ``world`` GPUs (hf_zero/planning/planner.py's
    ``plan``: the engine's own units and collectives, ring bytes over NVLink at the H100/H200 default bandwidth,
    nothing overlapped): communication seconds per step, the step if nothing overlapped (arithmetic at the
    planner's 400 TFLOP/s + communication) and memory per GPU, to print beside the measured step and peak."""
    from transformers import LlamaConfig

    from hf_zero.parallel import GridShape
    from hf_zero.planning import planner

    cfg = LlamaConfig(max_position_embeddings=args.seq, use_cache=False, **{"vocab_size": 32000, **SHAPES[args.model]})
    facts = planner.model_facts(cfg, args.model)
    gpu = planner.GPUS["h200" if "H200" in device_name.upper() else "h100"]
    machines = planner.Machines(nodes=1, gpus_per_node=world, memory_gib=gpu["memory_gib"], intra_gbs=gpu["intra_gbs"],
                                inter_gbs=gpu["inter_gbs"])
    training = planner.Training(micro_batch=args.micro, seq=args.seq, zero_stage=3, grad_accum=args.gas,
                                recompute="full" if args.checkpoint_blocks else "none", bucket_numel=args.bucket)
    p = planner.plan(facts, GridShape(**layout_of(name, args, world)["grid"]), machines, training)
    return {"comm_s": p.seconds, "compute_s": p.compute, "step_s": p.step, "tflops": machines.tflops,
            "intra_gbs": machines.intra_gbs, "layout": planner.describe(p.shape, 3), "memory_gib": p.memory.total / 2**30}


def run_trainer(name: str, args: argparse.Namespace, model: torch.nn.Module, fpt: float, nparams: int) -> dict:
    """``trN``: the hf engine ``hfN``'s config and data through ``hf_zero.Trainer`` (issue 20: the Trainer path
    against the raw engine). The same AdamW from the config's section, bf16, no clipping, no logging or saving;
    a callback times each optimizer step (device synchronised), the median after the warm-up as for the engines;
    the loss is logged every 10 steps, as a user logs it (each log is a host sync)."""
    from transformers import TrainerCallback

    import hf_zero

    rank = dist.get_rank()
    stage = int(name[2])
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": hf_zero_section(stage, args, name),
        "steps_per_print": 10**9,
        **json.loads(args.hf_config),
    }
    total = args.warmup + args.steps
    g = torch.Generator().manual_seed(1234 + rank)
    rows = [torch.randint(0, 32000, (args.seq,), generator=g) for _ in range(args.micro * args.gas * total)]

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": rows[i], "labels": rows[i]}

    times: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            torch.cuda.synchronize()
            if state.global_step > args.warmup:
                times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):  # noqa: ANN001, ANN003, ANN201
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        targs = hf_zero.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.gas, bf16=True,
            max_steps=total, max_grad_norm=0.0, learning_rate=1e-5, weight_decay=0.0, lr_scheduler_type="constant",
            logging_steps=10, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_drop_last=True,
            zero_config=cfg,
        )
        trainer = hf_zero.Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[Clock()])
        trainer.train()
    med = statistics.median(times)
    tok = args.micro * args.seq * args.gas / med
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"engine": name, "params": nparams, "tokens_per_s_per_gpu": tok, "mfu": tok * fpt / (PEAK_TFLOPS * 1e12),
            "peak_gib": float(peak), "first_loss": losses[0] if losses else float("nan"),
            "last_loss": losses[-1] if losses else float("nan"), "world": dist.get_world_size(),
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_engine(name: str, args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    build_peak = None
    offload_param = name in ("hf3op", "ds3op", "hf3ops", "hf3opg", "hf3opsg")
    if name == "hf3i" or (args.zero_init and name.startswith("hf3")):
        # stage 3 with the model built under zero.Init: no GPU ever holds all of it; with --zero_init and
        # parameter offload each slice is made in host memory (remote_device="cpu"), as DeepSpeed's docs build a
        # model larger than the GPUs
        import hf_zero

        torch.cuda.reset_peak_memory_stats()
        with hf_zero.zero.Init(remote_device="cpu" if offload_param else None):
            model = build_model(args.model, args.seq)
        build_peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        model = build_model(args.model, args.seq)
    fpt = flops_per_token(model, args.seq)
    nparams = sum(p.numel() for p in model.parameters())
    torch.cuda.reset_peak_memory_stats()
    # hf2o, hf3o, ds2o, ds3o, fsdp2o: optimizer state on the host; hf3op, ds3op: the parameter shards too
    # (stage 3's offload_param; FSDP2's CPUOffloadPolicy always offloads both)
    # hf1og, hf2og: optimizer offload with overlap_param_gather (each group's CPU step deferred to the next forward)
    offload = name.removesuffix("g") in ("hf1o", "hf2o", "hf3o", "ds2o", "ds3o", "fsdp2o", "hf3op", "ds3op") or name in SUPER_ENGINES
    param_section = {"offload_param": {"device": "cpu", "pin_memory": True}} if offload_param else {}
    data_rank = rank  # the batch stream this rank draws: the ranks of one tensor-parallel group draw the same
    if name.startswith("hf"):
        import hf_zero

        cfg = hf_engine_config(name, args, world, offload, param_section)
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        if name == "hf3tp":
            data_rank = engine.tensor_parallel_groups.dp_rank
        if args.compile:
            engine.compile()  # inductor, block by block; the warm-up steps absorb the compilation

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

    elif name.startswith("tr"):
        return run_trainer(name, args, model, fpt, nparams)
    elif name.startswith("pipe"):
        return run_pipeline(name, args)
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[torch.cuda.current_device()], bucket_cap_mb=100, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)

        def step(ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    elif name in ("ds2", "ds3", "ds2o", "ds3o", "ds3op", "ds3os"):
        import deepspeed

        ds_cfg = {
            "train_micro_batch_size_per_gpu": args.micro,
            "gradient_clipping": 0.0,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
            "zero_optimization": {
                "stage": int(name[2]),
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": 5e8,
                "allgather_bucket_size": 5e8,
                **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else {}),
                # ds3os: DeepSpeed 0.19.8's SuperOffload (stage 3: the CPU Adam of each sub-group during backward)
                **({"offload_optimizer": {"device": "cpu", "pin_memory": True, "super_offload": True,
                                          **({"cpuadam_cores_perc": args.cores_perc} if args.cores_perc is not None
                                             else {})}} if name == "ds3os" else {}),
                **param_section,
            },
            "steps_per_print": 10**9,
        }
        ds_engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = ds_engine(input_ids=ids, labels=ids).loss
            ds_engine.backward(loss)
            ds_engine.step()
            return loss

    elif name in ("fsdp2", "fsdp2o", "fsdp2tp", "fsdp2f8"):
        step, data_rank = fsdp2_step(model, args, offload=offload, tp=args.tp if name == "fsdp2tp" else 1,
                                     float8=name == "fsdp2f8")

    else:
        raise SystemExit(f"unknown engine {name!r}")

    g = torch.Generator(device="cuda").manual_seed(1234 + data_rank)
    times = []
    losses = []
    for i in range(args.warmup + args.steps):
        batches = [torch.randint(0, 32000, (args.micro, args.seq), device="cuda", generator=g) for _ in range(args.gas)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids in batches:  # --gas micro-batches per optimizer step (hf engines step on the last)
            loss = step(ids)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    if args.memory_peak:
        memory_peak(name, step, torch.randint(0, 32000, (args.micro, args.seq), device="cuda", generator=g))
    if args.profile:
        profile_steps(name, step, lambda: torch.randint(0, 32000, (args.micro, args.seq), device="cuda", generator=g),
                      args.profile)
    breakdown = None
    if name.startswith("hf") and args.breakdown:
        breakdown = engine.timers.means()  # noqa: F821 - the hf branch defines engine
    med = statistics.median(times)
    # per GPU: a tensor-parallel group of tp GPUs works on one micro-batch stream
    tok = args.micro * args.seq * args.gas / med / layout_of(name, args, world)["tp"]
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    rss = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, device="cuda", dtype=torch.float64)
    dist.all_reduce(rss)
    host_sum = float(rss)
    out = {
        "engine": layout_of(name, args, world)["label"],
        "step_s": med,
        "params": nparams,
        "tokens_per_s_per_gpu": tok,
        "mfu": tok * fpt / (PEAK_TFLOPS * 1e12),
        "peak_gib": float(peak),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "world": world,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # max RSS of rank 0 (KiB on Linux)
        "host_peak_sum_gib": host_sum,  # the ranks' max RSS added up: what the host as a whole had to hold, at most
    }
    if breakdown is not None:
        out["breakdown_ms"] = breakdown
    if build_peak is not None:
        out["build_peak_gib"] = build_peak
        out["full_model_gib"] = nparams * 4 / 2**30
    return out


def memory_peak(name: str, step: Callable, ids: torch.Tensor, top: int = 14) -> None:
    """One more step with the allocator's history on: rank 0 prints what was alive at that step's peak.

    The allocation and free events are replayed in order; at the highest point, the live blocks
    are summed by the innermost frame that belongs to hf_zero, transformers, torch.distributed
    or this script (else the innermost Python frame), so two engines' peaks can be compared
    line by line. Blocks allocated before the step (weights, optimizer state) are one line.
    """
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step(ids)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if dist.get_rank() != 0:
        return
    trace = snap["device_traces"][torch.cuda.current_device()]
    held, in_step = peak_breakdown(trace, before)
    print_peak(name, held, in_step, top)


def print_peak(name: str, held: int, in_step: dict[str, int], top: int = 14) -> None:
    """``[memory] NAME:`` lines: the step's peak as held-from-before + allocated-in-it, then the latter by site."""
    gib = 2**30
    print(f"[memory] {name}: step peak {(held + sum(in_step.values())) / gib:.2f} GiB = {held / gib:.2f} GiB held from "
          f"before the step + {sum(in_step.values()) / gib:.2f} GiB allocated in it, by where:", flush=True)
    for w, b in sorted(in_step.items(), key=lambda kv: -kv[1])[:top]:
        print(f"[memory] {name}:   {b / gib:7.3f} GiB  {w}", flush=True)


# where a block was allocated: the innermost frame in one of these (paths as Python reports them), else the innermost
SITES = ("hf_zero/", "transformers/", "torch/distributed/", "bench.py")


def alloc_site(frames: list[dict], sites: tuple[str, ...] = SITES) -> str:
    """``file:line function`` of the innermost frame whose path contains one of ``sites`` (the path from that
    marker on, so two installs print the same), else of the innermost frame; blocks allocated where no Python
    frame was on the stack (autograd's backward kernels run on its own thread) share one line."""
    for f in frames:
        for m in sites:
            at = f["filename"].find(m)
            if at >= 0:
                path = f["filename"][at:] if m.endswith("/") else f["filename"].rsplit("/", 1)[-1]
                return f"{path}:{f['line']} {f['name']}"
    if frames:
        return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']} {frames[0]['name']}"
    return "(no Python frame: e.g. autograd's backward kernels)"


def replay_peak(trace: list[dict], sites: tuple[str, ...] = SITES,
                held: dict[int, tuple[int, str]] | None = None) -> tuple[int, dict[str, int], dict[str, int]]:
    """Replay allocator events in order to the highest point of (bytes allocated in the trace - bytes from
    before it that it freed): (bytes from before freed by then, live bytes allocated in the trace by site,
    and, where ``held`` maps the address of each block live before the trace to (size, site), the bytes of
    those still live at that point by site)."""
    # first pass: where the peak is (sizes only); second: who is live there (sites, computed for those alone)
    sizes: dict[int, int] = {}
    old_freed = cur = peak = peak_at = peak_old_freed = 0  # old_freed: bytes from before the trace that it freed
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            cur += e["size"]
            if cur - old_freed > peak:
                peak, peak_at, peak_old_freed = cur - old_freed, i + 1, old_freed
        elif e["action"] == "free_completed":
            if e["addr"] in sizes:
                cur -= sizes.pop(e["addr"])
            else:
                old_freed += e["size"]
    live: dict[int, dict] = {}
    old = dict(held or {})
    for e in trace[:peak_at]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed" and live.pop(e["addr"], None) is None:
            old.pop(e["addr"], None)
    at_peak = {a: (e["size"], alloc_site(e.get("frames", []), sites)) for a, e in live.items()}

    def by_site(blocks: dict[int, tuple[int, str]]) -> dict[str, int]:
        sums: dict[str, int] = {}
        for size, w in blocks.values():
            sums[w] = sums.get(w, 0) + size
        return sums

    return peak_old_freed, by_site(at_peak), by_site(old) if held is not None else {}


def peak_breakdown(trace: list[dict], before: int, sites: tuple[str, ...] = SITES) -> tuple[int, dict[str, int]]:
    """Replay allocator events: (bytes from before the step still held at the peak, live bytes by where)."""
    old_freed, in_step, _ = replay_peak(trace, sites)
    return before - old_freed, in_step


def profile_steps(name: str, step: Callable, batch: Callable, trace_dir: str, n: int = 2) -> None:
    """Two more steps under the torch profiler: rank 0 prints where the time went and writes a Chrome trace.

    The summary splits a step's wall time into GPU kernel time by kind (matmuls and attention,
    NCCL, the optimizer, the rest) so exposed communication and host gaps show as numbers.
    """
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step(batch())
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e3
    if dist.get_rank() != 0:
        return
    print_profile(prof, name, wall, n)
    os.makedirs(trace_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(trace_dir, f"{name}.json"))


def print_profile(prof: torch.profiler.profile, name: str, wall_ms: float, steps: int) -> None:
    """A step's wall time beside its GPU kernel time by kind, then the operators that took the most GPU time."""
    kinds = {"nccl": 0.0, "gemm/attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for e in prof.key_averages():
        t = e.self_device_time_total / 1e3 / steps
        if t <= 0:
            continue
        k = e.key.lower()
        if "nccl" in k:
            kinds["nccl"] += t
        elif any(x in k for x in ("gemm", "nvjet", "cutlass", "flash", "attention", "sm90", "matmul")):
            kinds["gemm/attention"] += t
        elif "adam" in k:
            kinds["optimizer"] += t
        else:
            kinds["other"] += t
    parts = ", ".join(f"{k} {v:.1f} ms" for k, v in kinds.items())
    print(f"[profile] {name}: {wall_ms:.1f} ms/step wall; GPU kernel time per step: {parts} "
          "(NCCL runs on its own streams, so the sum can exceed the wall time)", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70), flush=True)


def run_pipeline(name: str, args: argparse.Namespace) -> dict:
    """``pipeN``: the shape split into N stages (x world/N data-parallel replicas), ``--pipe_micro`` micro-batches.

    Each stage is built from the config, so a rank only ever holds its own layers. Besides
    tokens/s, every rank times its forwards and backwards with CUDA events; the rest of the
    step is its bubble (waiting for a neighbour), reported per stage beside 1F1B's (p-1)/(m+p-1).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.pipe import split_causal_lm

    world = dist.get_world_size()
    stages, m = int(name[4:] or 4), args.pipe_micro
    cfg = LlamaConfig(max_position_embeddings=args.seq, **{"vocab_size": 32000, **SHAPES[args.model]})
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    fpt, nparams = flops_per_token(meta, args.seq), sum(p.numel() for p in meta.parameters())
    del meta
    torch.cuda.reset_peak_memory_stats()
    pipe = split_causal_lm(cfg, stages)
    engine, _, _, _ = hf_zero.initialize(model=pipe, config={
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": m,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": args.bucket},
        "pipeline": {"schedule": args.pipe_schedule},
        "steps_per_print": 10**9,
    })
    engine.measure_compute = True
    g = torch.Generator(device="cuda").manual_seed(1234 + pipe.dp_rank)
    times, bubbles, losses = [], [], []
    for i in range(args.warmup + args.steps):
        batch = [(ids, ids) for ids in (torch.randint(0, 32000, (args.micro, args.seq), device="cuda", generator=g)
                                        for _ in range(m))]
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine.train_batch(iter(batch))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        busy = engine.compute_seconds()
        if i >= args.warmup:
            times.append(dt)
            bubbles.append(1.0 - busy / dt)
        losses.append(float(loss))
    med = statistics.median(times)
    dp = world // stages
    tok = m * args.micro * args.seq * dp / med / world  # per GPU, comparable with the data-parallel rows
    mine = torch.tensor([statistics.median(bubbles)], device="cuda")
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    per_stage = [statistics.mean(float(every[pipe.grid.rank_at(pp=s, dp_shard=d)]) for d in range(dp)) for s in range(stages)]
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "engine": name, "params": nparams, "tokens_per_s_per_gpu": tok, "mfu": tok * fpt / (PEAK_TFLOPS * 1e12),
        "peak_gib": float(peak), "first_loss": losses[0], "last_loss": losses[-1], "world": world,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        "bubble_per_stage": per_stage, "bubble_formula": (stages - 1) / (m + stages - 1), "micro_batches": m,
    }


def child(args: argparse.Namespace) -> None:
    """Inside torchrun: run one engine and write rank 0's row as JSON."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    row = run_engine(args.engines, args)
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.1b", choices=sorted(SHAPES))
    ap.add_argument("--engines", default="hf1,hf2,hf3,ddp,fsdp2")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible)")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket", type=float, default=5e8)
    ap.add_argument("--memory_peak", action="store_true",
                    help="after timing, one more step per engine with the allocator's history: rank 0 prints what is alive at its peak")
    ap.add_argument("--profile", metavar="DIR", default="",
                    help="after timing, profile 2 more steps per engine: rank 0 prints a summary and writes DIR/<engine>.json")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block: hf_zero engines with engine.compile(), FSDP2 with module.compile()")
    ap.add_argument("--checkpoint_blocks", action="store_true",
                    help="hf_zero engines recompute each block in backward (activation_checkpointing.checkpoint_blocks)")
    ap.add_argument("--prefetch", type=float, default=None, metavar="ELEMENTS",
                    help="hf_zero stage 3: stage3_prefetch_bucket_size, the elements gathered ahead of use (default: the config's 5e7)")
    ap.add_argument("--hf_config", default="{}", metavar="JSON",
                    help='top-level keys added to the hf_zero engines\' config, e.g. \'{"nonfinite_loss": "off"}\'')
    ap.add_argument("--pipe_micro", type=int, default=8, help="pipeN engines: micro-batches per step (1F1B's m)")
    ap.add_argument("--pipe_schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeN engines: the schedule")
    ap.add_argument("--gas", type=int, default=1,
                    help="hf_zero engines: gradient_accumulation_steps; each timed step runs that many micro-batches")
    ap.add_argument("--breakdown", action="store_true",
                    help="hf_zero engines: wall_clock_breakdown on (forward, backward, step and the offloaded step's parts, "
                         "each span synchronised, so tokens/s drop a little); printed under the table")
    ap.add_argument("--shard", type=int, default=0,
                    help="hf3h: zero_optimization.mics_shard_size, the ranks one ZeRO-3 shard group spans "
                         "(default: half the GPUs, replicated twice; on 2 GPUs both, 1 x 2)")
    ap.add_argument("--tp", type=int, default=2, help="hf3tp and fsdp2tp: the tensor-parallel degree (dp = GPUs / tp)")
    ap.add_argument("--layers", type=int, default=0,
                    help="the --model shape with this many decoder layers (benchmarks/bench_largest.py searches over it)")
    ap.add_argument("--zero_init", action="store_true",
                    help="hf_zero stage-3 engines build the model under zero.Init (in host memory with parameter offload), "
                         "so no GPU or host ever holds the whole fp32 model")
    ap.add_argument("--rows_json", default="", metavar="PATH", help="also write the rows to PATH as JSON")
    ap.add_argument("--nvme_path", default="", help="hf2nvme, hf3nvme: the folder on a local NVMe disk to offload to")
    ap.add_argument("--cores_perc", type=float, default=None, help="hf*os*, ds3os: offload_optimizer.cpuadam_cores_perc "
                    "(default: DeepSpeed's, 0.8 of the rank's cores for the steps taken during backward)")
    ap.add_argument("--max_in_cpu", type=float, default=0, help="hf3nvme: offload_param.max_in_cpu (elements kept in memory)")
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.layers:
        SHAPES[args.model] = {**SHAPES[args.model], "num_hidden_layers": args.layers}
    args.bucket = int(args.bucket)
    if args.json:
        child(args)
        return
    if any(e in NVME_ENGINES for e in args.engines.split(",")) and not (args.nvme_path and os.path.isdir(args.nvme_path)):
        raise SystemExit(f"--nvme_path {args.nvme_path!r}: hf2nvme and hf3nvme need an existing folder on a local NVMe disk")
    if args.gas > 1 and any(not e.startswith(("hf", "tr")) for e in args.engines.split(",")):
        raise SystemExit("--gas is for the hf engines (their config's gradient_accumulation_steps); run the others without it")
    unused = [flag for flag, on in (("--profile", args.profile), ("--memory_peak", args.memory_peak), ("--compile", args.compile),
                                    ("--checkpoint_blocks", args.checkpoint_blocks)) if on]
    if unused and any(e.startswith("pipe") for e in args.engines.split(",")):
        raise SystemExit(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} for the hf/ddp/fsdp2/ds engines, not pipeN; "
                         "run the pipeline engines without them")
    nproc = args.gpus or torch.cuda.device_count()
    check_layouts(args, nproc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.engines.split(","):
            path = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", __file__,
                   *[a for a in sys.argv[1:]], "--engines", name, "--json", path]
            rc = subprocess.call(cmd)
            if rc != 0 or not os.path.exists(path):
                print(f"engine {name} failed (exit {rc})", flush=True)
                continue
            with open(path) as f:
                rows.append(json.load(f))
            # each row as soon as its engine is done, the JSON rewritten too: a call cut short by a timeout keeps the
            # rows it finished, host peak included
            print(f"row {name}: {rows[-1]['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, peak {rows[-1]['peak_gib']:.1f} GiB, "
                  f"host peak {rows[-1].get('host_peak_gib', 0.0):.1f} GiB", flush=True)
            if args.rows_json:
                with open(args.rows_json, "w") as f:
                    json.dump(rows, f)
    if args.rows_json and not rows:
        with open(args.rows_json, "w") as f:
            json.dump(rows, f)
    if not rows:
        raise SystemExit(1)
    print(f"\nmodel {args.model} ({rows[0]['params'] / 1e9:.2f}B params), {nproc} GPUs, micro-batch {args.micro}, seq {args.seq}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    peers = [r for r in rows if not r["engine"].startswith(("hf", "tr"))]
    best = max(peers, key=lambda r: r["tokens_per_s_per_gpu"]) if peers else None
    print("| engine | tokens/s/GPU | MFU | peak GiB | host peak GiB | vs best peer | loss first→last |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['tokens_per_s_per_gpu'] / best['tokens_per_s_per_gpu']:.3f}× {best['engine']}" if best and r["engine"].startswith("hf") else ""
        print(f"| {r['engine']} | {r['tokens_per_s_per_gpu']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
              f"{r.get('host_peak_gib', 0.0):.1f} | {ratio} | {r['first_loss']:.3f}→{r['last_loss']:.3f} |")
    by_name = {r["engine"]: r for r in rows}
    for r in rows:
        raw = by_name.get("hf" + r["engine"][2:]) if r["engine"].startswith("tr") else None
        if raw is not None:
            print(f"{r['engine']} / {raw['engine']} (the Trainer path against the raw engine): "
                  f"{r['tokens_per_s_per_gpu'] / raw['tokens_per_s_per_gpu']:.3f}")
    print("allocator retries (cudaFree + retry) on rank 0: " + ", ".join(f"{r['engine']} {r.get('alloc_retries', '?')}" for r in rows))
    for r in rows:
        if "bubble_per_stage" in r:
            stages = ", ".join(f"{100 * b:.1f}%" for b in r["bubble_per_stage"])
            print(f"{r['engine']}: {r['micro_batches']} micro-batches, measured bubble per stage {stages} "
                  f"(mean {100 * statistics.mean(r['bubble_per_stage']):.1f}%) vs (p-1)/(m+p-1) = {100 * r['bubble_formula']:.1f}%")
        if "breakdown_ms" in r:
            print(f"{r['engine']}: ms per call (mean over warm-up and timed steps): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown_ms"].items()))
        plain = r["engine"].split(" ")[0]
        if any(e in COMPOSED for e in args.engines.split(",")) and plain in ("hf3", "hf3h", "hf3tp") and "step_s" in r:
            pl = planned_step(plain, args, nproc, torch.cuda.get_device_name())
            print(f"{r['engine']}: measured step {r['step_s']:.3f} s; planner ({pl['layout']}): communication "
                  f"{pl['comm_s']:.3f} s, arithmetic at {pl['tflops']:.0f} TFLOP/s {pl['compute_s']:.3f} s, "
                  f"step with nothing overlapped {pl['step_s']:.3f} s (links at {pl['intra_gbs']:.0f} GB/s); "
                  f"memory {pl['memory_gib']:.1f} GiB per GPU against the measured peak {r['peak_gib']:.1f}")
        if "build_peak_gib" in r:
            print(f"{r['engine']}: built under zero.Init with a peak of {r['build_peak_gib']:.2f} GiB per GPU "
                  f"(the whole model in fp32 is {r['full_model_gib']:.2f} GiB)")


if __name__ == "__main__":
    main()
