"""ZenFlow beside the exact offloaded step on one fine-tune: the per-step loss of the same run in both modes.

    python benchmarks/zenflow_loss_curve.py                         # CPU, one process, 300 steps (a few minutes)
    torchrun --nproc-per-node 2 benchmarks/zenflow_loss_curve.py    # the same on 2 ranks (gloo on CPU, NCCL on GPUs)
    python benchmarks/zenflow_loss_curve.py --steps 20 --model tiny # a smoke run

Issue 44 asks that ``zero_optimization.zenflow``, stale by design, come with a convergence check beside the exact
mode's. Every run is the same job but for its config's ``zenflow`` section (``docs/offload.md``, ZenFlow):

- the model: a transformers ``LlamaForCausalLM`` built from a config (seed ``--seed``, the same weights in every
  run) over a byte vocabulary; the data: this repository's docs and package source as bytes, the last 5% held out,
  the same windows in the same order for every run (``benchmarks/fp8_loss_curve.py``'s corpus and batches);
- the engine: ZeRO-2 with ``offload_optimizer`` on the cpu, AdamW (0.9, 0.95, weight decay 0.1), ``WarmupCosineLR``
  (10% warm-up), clipping at 1.0, fp32 (``--bf16`` for bf16);
- the runs (``--runs``): ``exact`` (no zenflow), ``zenflow`` (DeepSpeed's example values: ``topk_ratio`` 0.1,
  ``update_interval`` 4, here with ``select_strategy`` "step" every ``--select`` steps, since a loop without a
  training loader has no epoch) and ``zenflow_overlap`` (the same with ``overlap_step``).

Written under ``--out``: ``losses.csv`` (step, one column per run), ``losses.json`` (settings, corpus, each run's
losses, evaluation loss, seconds and host updates) and, where matplotlib is importable, ``zenflow_loss_curve.png``.
Printed: each run's mean loss over the final ``--final`` steps, its evaluation loss and its difference from ``exact``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_loss_curve as fp8_curve  # noqa: E402 - the same data, model and loop as the float8 curve

#: Llama shapes (hidden, intermediate, layers, heads, kv heads)
SHAPES = {"tiny": (32, 64, 2, 4, 2), "small": (128, 384, 4, 4, 2), "30m": (512, 1408, 8, 8, 4)}
RUNS = ("exact", "zenflow", "zenflow_overlap")


def engine_config(run: str, args: argparse.Namespace) -> dict:
    """The hf_zero config of one run: identical but for ``zero_optimization.zenflow``."""
    zero: dict = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if run != "exact":
        zero["zenflow"] = {"topk_ratio": args.topk, "update_interval": args.update, "select_strategy": "step",
                           "select_interval": args.select, "full_warm_up_rounds": 0,
                           "overlap_step": run == "zenflow_overlap"}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**9, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps,
                                                            "warmup_num_steps": max(2, args.steps // 10),
                                                            "warmup_type": "linear", "cos_min_ratio": 0.1}},
    }
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _zenflow_figures(engine: object) -> dict:
    runner = engine.zero_optimizer.runner  # type: ignore[attr-defined]
    if getattr(runner, "zenflow", None) is not None:
        return dict(runner.zenflow.counts)
    return {"host_updates": engine.global_steps, "selections": 0}  # type: ignore[attr-defined]


def train_one(run: str, args: argparse.Namespace, train: torch.Tensor, held: torch.Tensor) -> dict:
    """One run on this rank, through the float8 curve's loop with this script's config, model and figures."""
    return fp8_curve.train_one(run, args, train, held, config=engine_config,
                               model=lambda a: fp8_curve.build_model(a, SHAPES), figures=_zenflow_figures,
                               tag="zenflow_loss_curve")


def summary(result: dict, final: int) -> list[str]:
    """Each run's mean loss over the final steps, its evaluation loss and its difference from ``exact``, a line each."""
    runs, steps = result["runs"], result["steps"]
    window = min(final, steps)
    means = {name: sum(r["losses"][-window:]) / window for name, r in runs.items()}
    lines = [f"{result['model']} ({result['params'] / 1e6:.2f}M parameters), {steps} steps, ZeRO-2 with offload_optimizer "
             f"on {result['world']} {result['device']} rank(s), micro-batch {result['micro']} x {result['seq']} bytes; mean "
             f"loss over the final {window} steps:"]
    for name, mean in means.items():
        r = runs[name]
        diff = (f", {100 * (mean - means['exact']) / means['exact']:+.2f}% vs exact (eval "
                f"{100 * (r['eval_loss'] - runs['exact']['eval_loss']) / runs['exact']['eval_loss']:+.2f}%)"
                if "exact" in means and name != "exact" else "")
        lines.append(f"  {name:<16} {mean:.4f} (eval {r['eval_loss']:.4f}, {r['seconds']:.0f} s, {r['host_updates']} host "
                     f"updates){diff}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topk", type=float, default=0.1)
    p.add_argument("--update", type=int, default=4)
    p.add_argument("--select", type=int, default=50)
    p.add_argument("--final", type=int, default=50, help="the steps the summary averages")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--out", default="zenflow_loss_curve")
    args = p.parse_args(argv)

    import torch.distributed as dist

    import hf_zero
    from hf_zero.distributed.dist import get_device

    hf_zero.init_distributed()
    world = dist.get_world_size()
    text, train, held = fp8_curve.load_data(args, world, held_rows=32)
    result = {"model": args.model, "steps": args.steps, "world": world, "micro": args.micro, "seq": args.seq,
              "lr": args.lr, "seed": args.seed, "device": get_device().type, "bf16": args.bf16,
              "zenflow": {"topk_ratio": args.topk, "update_interval": args.update, "select_interval": args.select},
              "corpus": {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}, "runs": {}}
    for run in args.runs.split(","):
        result["runs"][run] = train_one(run, args, train, held)
    result["params"] = next(iter(result["runs"].values()))["params"]
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(result, indent=1))
        written = fp8_curve.write_outputs(
            result, out, png="zenflow_loss_curve.png", tag="zenflow_loss_curve",
            title=f"ZenFlow beside the exact offloaded step: {result['model']}, {result['steps']} steps")
        print("\n".join(summary(result, args.final)))
        print("wrote " + ", ".join(written))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
