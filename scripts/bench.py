"""Throughput of hf_zero's stages beside DDP and FSDP2 on a Llama shape built from a config.

Run on the GPU machine, one process per GPU:

    torchrun --nproc_per_node 4 scripts/bench.py --model 1.1b --engines hf0,hf1,hf2,ddp,fsdp2

Every engine trains the same randomly initialised Llama (bf16 compute, AdamW, no activation
checkpointing) on random tokens; tokens/s is per GPU, the median of the timed steps after the
warm-up; MFU counts 6·N + 12·layers·hidden·seq FLOPs per token against 989 TFLOP/s (as
BASELINES.md); peak memory is torch.cuda.max_memory_allocated on the largest rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "7.2b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
}
PEAK_TFLOPS = 989.0


def build_model(shape: str, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=seq, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    return model


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq


def run_engine(name: str, args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.model, args.seq)
    fpt = flops_per_token(model, args.seq)
    nparams = sum(p.numel() for p in model.parameters())
    torch.cuda.reset_peak_memory_stats()
    if name.startswith("hf"):
        import hf_zero

        stage = int(name[2:])
        cfg = {
            "train_micro_batch_size_per_gpu": args.micro,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

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

    elif name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    else:
        raise SystemExit(f"unknown engine {name!r}")

    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    times = []
    losses = []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, 32000, (args.micro, args.seq), device="cuda", generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(ids)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    med = statistics.median(times)
    tok = args.micro * args.seq / med
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = {
        "engine": name,
        "params": nparams,
        "tokens_per_s_per_gpu": tok,
        "mfu": tok * fpt / (PEAK_TFLOPS * 1e12),
        "peak_gib": float(peak),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "world": world,
    }
    return out


def run_isolated(name: str, args: argparse.Namespace) -> dict:
    """One engine's run; everything it allocated is released before the next one starts."""
    out = run_engine(name, args)
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.1b", choices=sorted(SHAPES))
    ap.add_argument("--engines", default="hf0,hf1,hf2,ddp,fsdp2")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket", type=float, default=5e8)
    args = ap.parse_args()
    args.bucket = int(args.bucket)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rows = [run_isolated(e, args) for e in args.engines.split(",")]
    if dist.get_rank() == 0:
        print(f"\nmodel {args.model} ({rows[0]['params'] / 1e9:.2f}B params), {rows[0]['world']} GPUs, micro-batch {args.micro}, seq {args.seq}, "
              f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
        print("| engine | tokens/s/GPU | MFU | peak GiB | loss first→last |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['engine']} | {r['tokens_per_s_per_gpu']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
                  f"{r['first_loss']:.3f}→{r['last_loss']:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
