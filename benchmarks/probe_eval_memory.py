"""Memory of evaluation and generation at ZeRO-3, and generate's tokens/s (issue 41, item 1).

    torchrun --nproc_per_node 2 benchmarks/probe_eval_memory.py --model 7b                      # 2 GPUs, bf16
    torchrun --nproc_per_node 2 benchmarks/probe_eval_memory.py --model 7b --max_live 1e9 --reuse 1e10
    torchrun --nproc_per_node 2 benchmarks/probe_eval_memory.py --hidden 4096 --intermediate 11008 --layers 32 \\
        --heads 32 --kv_heads 32 --vocab 32000                                                    # any Llama shape
    torchrun --nproc_per_node 2 benchmarks/probe_eval_memory.py --device cpu --model small --dtype fp32 --new_tokens 16
    DS_ACCELERATOR=cpu .venv-deepspeed/bin/python -m torch.distributed.run --nproc_per_node 2 \\
        benchmarks/probe_eval_memory.py --device cpu --model small --dtype fp32 --engine ds   # DeepSpeed 0.19.8

A Llama of the given shape is built from a config (random weights; on GPUs under ``zero.Init``, so no rank ever
holds it whole), wrapped in a ZeRO-3 engine (``--engine hf``: ``hf_zero.initialize``; ``ds``: DeepSpeed's, in its
own environment), trained two steps, then put through three no-grad forwards (what ``Trainer.evaluate`` runs) and
one greedy ``generate`` of ``--new_tokens`` tokens per rank (rank r decodes ``new_tokens + r``: ranks of
different lengths). Rank 0 prints what this rank holds after each phase (``torch.cuda.memory_allocated`` on a
GPU, RSS on the CPU), the peak, and generate's tokens/s. ``--max_live`` and ``--reuse`` are
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` (DeepSpeed's defaults: 1e9 each).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

# the repository root first, so that hf_zero imports without an install (the device machine has none)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=16000),
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default=None, help="a named Llama shape (else the flags below)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=None, help="default: --heads")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--engine", choices=("hf", "ds"), default="hf", help="hf_zero, or DeepSpeed (its own environment)")
    p.add_argument("--seq", type=int, default=512, help="tokens per training / evaluation sequence")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of generate")
    p.add_argument("--new_tokens", type=int, default=32, help="tokens rank 0 generates (rank r: this + r)")
    p.add_argument("--max_live", type=float, default=1e9, help="stage3_max_live_parameters")
    p.add_argument("--reuse", type=float, default=1e9, help="stage3_max_reuse_distance")
    p.add_argument("--prefetch", type=float, default=5e7, help="stage3_prefetch_bucket_size")
    p.add_argument("--zero_init", action="store_true", help="build under zero.Init on the CPU too (always on GPUs)")
    a = p.parse_args()
    shape = SHAPES[a.model] if a.model else dict(
        hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads or a.heads, vocab_size=a.vocab)
    a.shape = dict(shape, max_position_embeddings=max(a.seq, a.prompt + a.new_tokens + 8))
    return a


def _held(device: torch.device) -> int:
    """What this rank holds now: allocated GPU memory, or RSS with glibc's free memory handed back first."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gathered(model: torch.nn.Module) -> int:
    """Elements of sharded parameters gathered now, by DeepSpeed's ``ds_status`` (hf_zero sets it too): what the
    engine holds whole beyond the parameters it keeps whole for good (``ds_persist``)."""
    n = 0
    for p in model.parameters():
        status = getattr(p, "ds_status", None)
        if status is not None and status.name == "AVAILABLE" and not getattr(p, "ds_persist", False):
            n += p.ds_numel
    return n


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    a = _args()
    from transformers import LlamaConfig, LlamaForCausalLM

    if a.engine == "ds":
        import deepspeed as zero_lib

        zero_lib.init_distributed(dist_backend="gloo" if a.device == "cpu" else "nccl")
    else:
        import hf_zero as zero_lib

        zero_lib.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    config = {
        "train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": int(a.max_live),
                              "stage3_max_reuse_distance": int(a.reuse), "stage3_prefetch_bucket_size": int(a.prefetch)},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if a.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if a.engine == "ds" and device.type == "cpu":  # torch's AdamW: DeepSpeed's CPU accelerator has no fused one
        config["optimizer"]["params"]["torch_adam"] = True
        config["zero_allow_untested_optimizer"] = True
    torch.manual_seed(0)
    lcfg = LlamaConfig(**a.shape)
    lcfg._attn_implementation = "sdpa"
    if device.type == "cuda" or a.zero_init:
        with zero_lib.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(lcfg).to(dtype)
    else:
        model = LlamaForCausalLM(lcfg).to(dtype)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = zero_lib.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, lcfg.vocab_size, (2 + 3, world * a.micro, a.seq), generator=g)[
        :, rank * a.micro : (rank + 1) * a.micro].to(device)
    rows = {"model": {k: v for k, v in a.shape.items()}, "params": n_params, "world": world, "engine": a.engine,
            "dtype": a.dtype, "device": str(device), "max_live": a.max_live, "reuse": a.reuse}
    engine.train()
    for t in range(2):
        loss = engine(input_ids=ids[t], labels=ids[t]).loss
        engine.backward(loss)
        engine.step()
    rows["after 2 training steps"] = _held(device)
    rows["gathered elements after 2 training steps"] = _gathered(model)
    engine.eval()
    with torch.no_grad():
        for k in range(3):
            engine(input_ids=ids[2 + k])
    rows["after 3 no-grad forwards"] = _held(device)
    rows["gathered elements after 3 no-grad forwards"] = _gathered(model)
    prompt = torch.randint(0, lcfg.vocab_size, (1, a.prompt), generator=g).to(device)
    new = a.new_tokens + rank  # ranks of different lengths
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        out = engine.module.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                     synced_gpus=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    rows["after generate"] = _held(device)
    rows["gathered elements after generate"] = _gathered(model)
    rows["generate tokens/s (rank 0)"] = round((out.shape[1] - prompt.shape[1]) / seconds, 2)
    rows["generate seconds"] = round(seconds, 2)
    rows["peak"] = _peak(device)
    if rank == 0:
        gib = 2**30
        print(json.dumps(rows))
        print(f"{a.engine} ZeRO-3 {a.dtype}, {n_params / 1e9:.2f}B params, {world} ranks on {device.type}, "
              f"max_live {a.max_live:g}, reuse {a.reuse:g}")
        for key in ("after 2 training steps", "after 3 no-grad forwards", "after generate", "peak"):
            gathered = rows.get(f"gathered elements {key}")
            print(f"  {key}: {rows[key] / gib:.2f} GiB" + ("" if gathered is None else
                                                          f", {gathered / 1e6:.1f}M elements gathered"))
        print(f"  generate: {rows['generate tokens/s (rank 0)']} tokens/s ({out.shape[1] - prompt.shape[1]} tokens "
              f"in {rows['generate seconds']} s)")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
