"""Long-sequence training: hf_zero's Ulysses SP beside DeepSpeed's ALST (and FSDP2 context parallelism).

Run on the GPU machine (issue 18's measurement; numbers go to BENCHMARKS.md):

    python benchmarks/bench_sequence_parallel.py --gpus 2 --engines hf,ds,fsdp_cp --seqs 4096,32768,131072
    python benchmarks/bench_sequence_parallel.py --gpus 2 --engines hf,ds --max_seq 65536
    python benchmarks/bench_sequence_parallel.py --gpus 2 --engines hf --sp 1,2 --seqs 4096   # SP's cost at 4k
    python benchmarks/bench_sequence_parallel.py --gpus 2 --engines hf --sp 2 --batch 2 --seqs 4096   # sp 2 at sp 1's tokens per GPU

Every engine trains Llama-3-8B's shape (random weights, bf16, AdamW, ZeRO-3 or FSDP2) on ``--batch`` random
sequences (default one) per sequence-parallel group, each run in its own torchrun (one process per GPU) so no
run's memory leaks into the next. Each keeps its best long-sequence settings: checkpointed blocks
with their inputs in host memory, the MLP and the LM-head loss in tiles (hf_zero's
``sequence_parallel`` section; ALST's TiledMLP and TiledFusedLogitsLoss), flash attention when
``flash_attn`` imports, else SDPA. ``fsdp_cp`` is Accelerate's context parallelism on FSDP2 (SDPA
only); it was written from Accelerate's documentation and has not run on a GPU yet.

Reported per run: tokens/s (the whole sequence over the step time, per GPU), the peak memory of the
largest rank, the losses. ``--max_seq N`` doubles the sequence from N until a run fails (out of
memory) and reports the last that trained. ``--device cpu`` runs a tiny shape over gloo (smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

# the repository root first, so that hf_zero and tests import without an install (the device machine has none)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512),
}


def _attn() -> str:
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=args.seq, use_cache=False, **SHAPES[args.model])
    cfg._attn_implementation = "sdpa" if args.engine == "fsdp_cp" or args.device == "cpu" else _attn()
    return cfg


def _batch(args: argparse.Namespace, step: int, device: torch.device) -> dict:
    """``--batch`` sequences per sp group (the same on its ranks), their labels the tokens themselves.

    SP's cost is read at equal work: sp N with N sequences per group gives each GPU as many tokens per step as sp 1
    with one, so the step times differ only by what sequence parallelism adds (its all-to-alls, attention over the
    whole sequence), not by ZeRO-3's per-step traffic spread over fewer tokens."""
    g = torch.Generator().manual_seed(1000 * step + args.dp_rank)
    ids = torch.randint(0, SHAPES[args.model]["vocab_size"], (args.batch, args.seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


# ------------------------------------------------------------------ engines


def hf_engine(args: argparse.Namespace, device: torch.device) -> Any:
    from transformers import LlamaForCausalLM

    import hf_zero
    from hf_zero.sequence import shard_batch

    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 0.0, "bf16": {"enabled": args.device != "cpu"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, **({"stage3_prefetch_bucket_size": int(args.prefetch)} if args.prefetch else {})},
           "sequence_parallel_size": args.sp, "steps_per_print": 10**9,
           "activation_checkpointing": {"checkpoint_blocks": True, "cpu_checkpointing": args.offload,
                                        "keep_attention": {"on": True, "off": False}.get(args.keep_attention, "auto")},
           "sequence_parallel": {"tiled_loss": True, "tiled_mlp": True}}
    with hf_zero.zero.Init(), device:
        model = LlamaForCausalLM(_config(args))
    engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
    g = engine.sequence_parallel_groups
    args.dp_rank = g.dp_rank if g else dist.get_rank()

    def step(i: int) -> float:
        batch = _batch(args, i, device)
        if g is not None:
            batch = shard_batch(batch, g.sp_rank, g.sp_size)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step


def ds_engine(args: argparse.Namespace, device: torch.device) -> Any:
    """DeepSpeed's ALST as its tutorial wires it: UlyssesSPAttentionHF, TiledMLP, TiledFusedLogitsLoss."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        TiledMLP,
        UlyssesSPAttentionHF,
    )
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from hf_zero.sequence import shard_batch  # the same shards (shifted labels, global positions) for both

    def tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]), device=x.device)
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)  # ALST: every rank must gather the same number of times

        def mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return TiledMLP.apply(mlp, self, x, int(shards), [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 0.0, "bf16": {"enabled": args.device != "cpu"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}, "sequence_parallel_size": args.sp,
           "steps_per_print": 10**9, "activation_checkpointing": {"cpu_checkpointing": args.offload}}
    with deepspeed.zero.Init(config_dict_or_path=cfg), device:
        model = LlamaForCausalLM(_config(args))
    mpu = None
    if args.sp > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=model.config._attn_implementation, sequence_parallel_size=args.sp,
            micro_batch_size=args.batch, seq_length=args.seq, seq_length_is_variable=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
    sp_rank = mpu.get_sequence_parallel_rank() if mpu else 0
    sp_group = mpu.get_sequence_parallel_group() if mpu else None
    args.dp_rank = dist.get_rank() // args.sp

    def loss_fn(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum")

    def step(i: int) -> float:
        batch = shard_batch(_batch(args, i, device), sp_rank, args.sp)
        y = batch.pop("shift_labels")
        hidden = engine.module.model(**batch).last_hidden_state
        shards = max(1, math.ceil(hidden.shape[1] * SHAPES[args.model]["vocab_size"] * 4 / 2**30))
        total = TiledFusedLogitsLoss.apply(loss_fn, engine.module, hidden, y, None, shards, [engine.module.lm_head.weight], "sum")
        count = (y != -100).sum().float()
        if sp_group is not None:  # transformers' ALST loss: the shards' sums over the shards' counts
            total = torch.stack(torch.distributed.nn.functional.all_gather(total, group=sp_group)).sum()
            count = count.clone()
            dist.all_reduce(count, group=sp_group)
        loss = total / count
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step


def fsdp_cp_engine(args: argparse.Namespace, device: torch.device) -> Any:
    """Accelerate's context parallelism (ring attention, SDPA) on FSDP2. Unverified: written from Accelerate's docs."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaForCausalLM

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=True,
                                            mixed_precision_policy="bf16", state_dict_type="SHARDED_STATE_DICT")
    pc = ParallelismConfig(dp_shard_size=dist.get_world_size() // args.sp, cp_size=args.sp)
    acc = Accelerator(parallelism_config=pc, fsdp_plugin=plugin)
    with device:
        model = LlamaForCausalLM(_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    model, opt = acc.prepare(model, opt)
    args.dp_rank = dist.get_rank() // args.sp

    def step(i: int) -> float:
        batch = _batch(args, i, device)
        labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1), value=-100)
        pos = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
        with acc.maybe_context_parallel(buffers=[batch["input_ids"], labels, pos], buffer_seq_dims=[1, 1, 1],
                                        no_restore_buffers={batch["input_ids"], labels, pos}):
            loss = model(input_ids=batch["input_ids"], position_ids=pos, shift_labels=labels, labels=labels).loss
            acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


# ------------------------------------------------------------------ one run (inside torchrun)


def worker(args: argparse.Namespace) -> None:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)  # the same weights in every engine (first losses comparable)
    step = {"hf": hf_engine, "ds": ds_engine, "fsdp_cp": fsdp_cp_engine}[args.engine](args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(i))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    world = dist.get_world_size()
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    med = statistics.median(times)
    if dist.get_rank() == 0:
        dp = world // args.sp
        print("RESULT " + json.dumps({
            "engine": args.engine, "seq": args.seq, "batch": args.batch, "sp": args.sp, "gpus": world, "attn": _config(args)._attn_implementation, "keep_attention": args.keep_attention,
            "step_s": med, "tokens_per_s_per_gpu": args.seq * args.batch * dp / med / world, "peak_gib": float(peak), "losses": losses,
        }), flush=True)
    dist.destroy_process_group()


# ------------------------------------------------------------------ the driver


def run(args: argparse.Namespace, engine: str, seq: int, sp: int) -> dict | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}", "--master_port", str(29500 + seq % 997),
           __file__, "--worker", "--engine", engine, "--seq", str(seq), "--sp", str(sp), "--model", args.model,
           "--device", args.device, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup), "--keep_attention", args.keep_attention, "--prefetch", str(args.prefetch)] + (["--no_offload"] if not args.offload else [])
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # too slow to finish its steps here: not counted as a length that trains
        print(f"[bench_sp] {engine} seq {seq} sp {sp}: no result (ran past --timeout {args.timeout} s; "
              "whether it fits is not known)", flush=True)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    errors = [ln.strip() for ln in lines if "Error" in ln and "ChildFailedError" not in ln and "error_file" not in ln]
    tail = errors[-2:] or lines[-3:]  # the worker's own exception, not torchrun's summary
    print(f"[bench_sp] {engine} seq {seq} sp {sp}: no result ({' | '.join(tail)})", flush=True)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--engines", default="hf,ds")
    p.add_argument("--seqs", default="32768")
    p.add_argument("--sp", default=None, help="comma-separated sp degrees (default: all GPUs)")
    p.add_argument("--max_seq", type=int, default=0, help="double the sequence from this length until a run fails")
    p.add_argument("--model", default="8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=1, help="sequences per sp group and micro-batch (sp N with N: sp 1's tokens per GPU)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--no_offload", dest="offload", action="store_false", help="keep checkpointed block inputs on the GPU")
    p.add_argument("--keep_attention", default="auto", choices=["auto", "on", "off"],
                   help="hf_zero: keep attention outputs through the block recomputation (activation_checkpointing.keep_attention)")
    p.add_argument("--prefetch", type=float, default=0, help="hf_zero: stage3_prefetch_bucket_size (elements; default the config's)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--engine", default="hf")
    p.add_argument("--seq", type=int, default=0)
    args = p.parse_args()
    if args.worker:
        args.sp = int(args.sp or 1)
        return worker(args)
    for engine in args.engines.split(","):
        for sp in [int(s) for s in (args.sp or str(args.gpus)).split(",")]:
            if args.max_seq:
                seq, best = args.max_seq, None
                while (r := run(args, engine, seq, sp)) is not None:
                    print(json.dumps(r), flush=True)  # each length that trained, with its speed and memory
                    best, seq = r, seq * 2
                print(json.dumps({"engine": engine, "sp": sp, "max_seq_trained": best and best["seq"], "failed_at": seq}), flush=True)
                continue
            for seq in [int(s) for s in args.seqs.split(",")]:
                r = run(args, engine, seq, sp)
                if r is not None:
                    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
