"""TRL's SFTTrainer on hf_zero beside TRL with DeepSpeed ZeRO-3 and TRL with FSDP2 (issue 19's measurement).

    python benchmarks/bench_trl.py --gpus 2 --engines hf3,ds3,fsdp2            # Llama 1.1B shape, seq 2048, bf16
    python benchmarks/bench_trl.py --gpus 1 --engines hf3,ds3,fsdp2
    python benchmarks/bench_trl.py --device cpu --model tiny --gpus 2 --engines hf3,ds3,fsdp2 --steps 3   # smoke test

Each engine runs the same SFT script in its own torchrun (one process per GPU): a Llama model built from a
config (random weights, the same seed), pre-tokenized random sequences of ``--seq`` tokens (no network, no
tokenizer download: a word-level tokenizer made here supplies the pad and EOS tokens TRL asks for), AdamW,
bf16 on GPUs. ``hf3``/``hf2`` is ``hf_zero.integrations.trl.SFTTrainer`` with ``zero_config``; ``ds3``/``ds2`` is
``trl.SFTTrainer`` with ``deepspeed=`` (DeepSpeed 0.19.8; on the GPU machine carried as a wheel with
``TORCH_CUDA_ARCH_LIST=9.0``); ``fsdp2`` is ``trl.SFTTrainer`` with ``fsdp_config={"fsdp_version": 2}``.
Reported: steady tokens/s per GPU (median step after the first ``--warmup`` steps), the whole ``train()`` time,
peak GPU memory of rank 0, first and last logged loss. A failing engine prints its error in its row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

# the repository root first, so that hf_zero and tests import without an install (the device machine has none)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "</s>": vocab - 1}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="</s>")


def _zero_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"},
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto"}


class _Clock:
    """A TrainerCallback-like object (duck-typed in ``worker``) that times each optimizer step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times, self.t0 = cuda, [], 0.0

    def on_step_begin(self, *a: Any, **k: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_step_end(self, *a: Any, **k: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    cuda = args.device == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = args.engine
    if engine.startswith("hf"):
        from hf_zero.integrations.trl import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer
    shape = SHAPES[args.model]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=args.seq, use_cache=False, **shape))
    g = torch.Generator().manual_seed(1)
    n = args.micro * world * (args.steps + args.warmup) * args.accum
    data = Dataset.from_dict({"input_ids": torch.randint(0, shape["vocab_size"] - 2, (n, args.seq), generator=g).tolist()})
    kw: dict[str, Any] = dict(
        output_dir=args.out, per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.accum,
        max_steps=args.steps + args.warmup, learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no",
        bf16=cuda, use_cpu=not cuda, seed=0, disable_tqdm=True, max_length=args.seq, packing=False,
        gradient_checkpointing=args.gc, dataloader_drop_last=True,
    )
    if engine in ("hf2", "hf3"):
        kw["zero_config"] = _zero_config(int(engine[2]))
    elif engine in ("ds2", "ds3"):
        kw["deepspeed"] = _zero_config(int(engine[2]))
    elif engine == "fsdp2":
        kw["fsdp"] = "full_shard auto_wrap"
        kw["fsdp_config"] = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                             "reshard_after_forward": True}
    elif engine != "ddp":
        raise SystemExit(f"unknown engine {engine}")
    clock = _Clock(cuda)
    callback = type("Clock", (TrainerCallback,), {"on_step_begin": clock.on_step_begin, "on_step_end": clock.on_step_end})
    trainer = SFTTrainer(model=model, args=SFTConfig(**kw), train_dataset=data, processing_class=_tokenizer(shape["vocab_size"]),
                         callbacks=[callback()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    whole = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    step = statistics.median(clock.times[args.warmup:]) if len(clock.times) > args.warmup else float("nan")
    tokens = args.micro * args.accum * args.seq / step
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print("RESULT " + json.dumps({
            "engine": engine, "gpus": world, "tokens_per_s_per_gpu": tokens, "step_s": step, "train_s": whole,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        }), flush=True)


def run(args: argparse.Namespace, engine: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}", "--master_port",
           str(29400 + hash(engine) % 500), __file__, "--worker", "--engine", engine, "--model", args.model,
           "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro", str(args.micro),
           "--accum", str(args.accum), "--seq", str(args.seq), "--out", os.path.join(args.out, engine)]
    cmd += ["--gc"] if args.gc else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    if args.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {args.timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    errors = [ln.strip() for ln in lines if "Error" in ln and "ChildFailedError" not in ln and "error_file" not in ln]
    return {"engine": engine, "error": " | ".join(errors[-2:] or lines[-2:])[:300]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--engines", default="hf3,ds3,fsdp2")
    p.add_argument("--model", default="1.1b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gc", action="store_true", help="gradient_checkpointing=True")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default="/tmp/bench_trl")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--engine", default="hf3")
    args = p.parse_args()
    if args.device == "cpu" and args.model == "1.1b":
        args.model = "tiny"
    if args.worker:
        return worker(args)
    rows = [run(args, e) for e in args.engines.split(",")]
    ok = [r for r in rows if "error" not in r]
    best_peer = max((r["tokens_per_s_per_gpu"] for r in ok if not r["engine"].startswith("hf")), default=None)
    print(f"\nTRL SFTTrainer, model {args.model}, {args.gpus} GPU(s), micro-batch {args.micro}, accumulation {args.accum}, "
          f"seq {args.seq}, gradient checkpointing {'on' if args.gc else 'off'}, torch {torch.__version__}")
    print("| engine | tokens/s/GPU | step s | train() s | peak GiB | vs best peer | loss first→last |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['tokens_per_s_per_gpu'] / best_peer:.3f}×" if best_peer and r["engine"].startswith("hf") else ""
        print(f"| {r['engine']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.3f} | {r['train_s']:.1f} | "
              f"{r['peak_gib']:.1f} | {ratio} | {r['loss_first']:.3f}→{r['loss_last']:.3f} |")


if __name__ == "__main__":
    main()
