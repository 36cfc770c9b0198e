"""Float8 beside bf16 on one fine-tune: the per-step loss of the same run in bf16 and in float8 (tensorwise, rowwise).

    python benchmarks/fp8_loss_curve.py --gpus 4                           # 1.1B (TinyLlama's shape), 300 steps
    python benchmarks/fp8_loss_curve.py --gpus 1 --model 150m --steps 300
    python benchmarks/fp8_loss_curve.py --device cpu --steps 20 --tiny     # the smoke test, 2 CPU processes

Issue 45 asks for numbers users trust: float8's loss curve within the spread the recipe's authors report of bf16's
on the same data. Every run here is the same job with one difference, the config's ``fp8`` section:

- the model: a transformers ``LlamaForCausalLM`` built from a config (seed ``--seed``, so every run starts from the
  same weights), with a byte vocabulary (256 tokens), so no tokenizer or download is needed;
- the data: this repository's own English and Python (``docs/``, the top-level ``*.md``, ``hf_zero/``), read in
  sorted path order, as bytes; its last 5% are held out for an evaluation at the end. Windows of ``--seq`` bytes
  are drawn from a generator seeded with ``--seed``, so each run sees the same batches in the same order; the
  corpus's size and sha256 go into the JSON, since the text changes with the repository;
- the engine: ``hf_zero.initialize`` at ZeRO-3 over all ranks (``--stage``), bf16, AdamW (0.9, 0.95, weight decay
  0.1) with ``WarmupCosineLR`` (10% warm-up), clipping at 1.0. The float8 runs add ``fp8: {enabled, recipe}``:
  tensorwise (its weights all-gathered as float8) and rowwise (gathered in bf16).

All runs go in one ``torchrun`` (one process per GPU, or ``--gpus`` CPU processes over gloo with ``--device cpu``),
one after the other. Written under ``--out``: ``losses.csv`` (step, then one loss column per run), ``losses.json``
(the settings, the corpus, each run's losses, evaluation loss and seconds) and, when matplotlib is importable
(``pip install 'hf_zero[bench]'``), ``fp8_loss_curve.png``. Printed: each run's mean loss over the final 100 steps
(all steps when there are fewer), its evaluation loss, and each float8 run's relative difference from bf16.
``--replot --out DIR`` does the printing and writing again from ``DIR/losses.json`` alone (a GPU machine without
matplotlib writes the JSON; the plot is drawn wherever matplotlib is).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
#: Llama shapes (hidden, intermediate, layers, heads, kv heads); every projection a multiple of 16, so all convert
SHAPES = {
    "tiny": (64, 128, 2, 4, 2),
    "150m": (1024, 2816, 12, 16, 4),
    "1.1b": (2048, 5632, 22, 32, 4),  # TinyLlama's
}
RUNS = ("bf16", "tensorwise", "rowwise")
VOCAB = 256  # bytes
FINAL = 100  # the steps the summary averages


def corpus(repo: Path = REPO) -> bytes:
    """This repository's docs and package source as one byte string, in sorted path order (no network, no tokenizer)."""
    files = sorted([*repo.glob("*.md"), *repo.glob("docs/**/*.md"), *repo.glob("hf_zero/**/*.py")])
    if not files:
        raise SystemExit(f"fp8_loss_curve: no *.md or hf_zero/*.py under {repo}; run it from a checkout of hf_zero")
    return b"\n\n".join(f.read_bytes() for f in files)


def batches(data: torch.Tensor, steps: int, rows: int, seq: int, seed: int) -> torch.Tensor:
    """``steps`` x ``rows`` windows of ``seq`` tokens at offsets drawn from ``seed``: the same for every run."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (steps, rows), generator=g)
    return data[starts[..., None] + torch.arange(seq)]


def engine_config(run: str, args: argparse.Namespace) -> dict:
    """The hf_zero config of one run: identical but for the ``fp8`` section."""
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage, **({"stage3_param_persistence_threshold": 0} if args.tiny else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps,
                                                            "warmup_num_steps": max(2, args.steps // 10),
                                                            "warmup_type": "linear", "cos_min_ratio": 0.1}},
    }
    if run != "bf16":
        cfg["fp8"] = {"enabled": True, "recipe": run}
    return cfg


def build_model(args: argparse.Namespace, shapes: dict | None = None) -> torch.nn.Module:
    """``args.model``'s Llama (from ``shapes``, default this script's), seeded: every run starts from the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = (shapes or SHAPES)[args.model]
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                        max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False))


def _float8_figures(engine: object) -> dict:
    return {"float8_layers": len(engine.float8_layers),  # type: ignore[attr-defined]
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if engine.device.type == "cuda" else None}  # type: ignore[attr-defined]


def train_one(run: str, args: argparse.Namespace, train: torch.Tensor, held: torch.Tensor, *,
              config: Callable[[str, argparse.Namespace], dict] = engine_config,
              model: Callable[[argparse.Namespace], torch.nn.Module] = build_model,
              figures: Callable[[object], dict] = _float8_figures, tag: str = "fp8_loss_curve") -> dict:
    """One run on this rank: its micro-batch of each step's windows; the losses averaged over the ranks.

    ``config``, ``model`` and ``figures`` (what else the run reports, read off the engine after training) are this
    script's; ``benchmarks/zenflow_loss_curve.py`` trains its runs through the same loop with its own."""
    import torch.distributed as dist

    import hf_zero

    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(args)
    params = sum(p.numel() for p in net.parameters())
    engine = hf_zero.initialize(model=net, config=config(run, args))[0]
    lo, hi = rank * args.micro, (rank + 1) * args.micro
    losses = []
    start = time.perf_counter()
    for t in range(args.steps):
        ids = train[t, lo:hi].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0 and (t % max(1, args.steps // 10) == 0 or t == args.steps - 1):
            print(f"[{tag}] {run} step {t + 1}/{args.steps} loss {losses[-1]:.4f}", flush=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    extra = figures(engine)
    engine.eval()
    with torch.no_grad():  # the held-out windows, split over the ranks
        mine = held[rank::world].to(engine.device)
        evals = torch.stack([engine(input_ids=r[None], labels=r[None]).loss.float() for r in mine]).sum()
        dist.all_reduce(evals)
    out = {"params": params, "losses": losses, "eval_loss": evals.item() / held.shape[0], "seconds": seconds, **extra}
    engine.destroy()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def load_data(args: argparse.Namespace, world: int, held_rows: int = 16) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """The corpus, each step's training windows for all ``world`` ranks, and about ``held_rows`` held-out windows (a
    multiple of the world size) from its last 5%."""
    text = corpus()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(data.numel() * 0.95)
    train = batches(data[:cut], args.steps, args.micro * world, args.seq, args.seed)
    held = batches(data[cut:], 1, max(world, held_rows // world * world), args.seq, args.seed + 1)[0]
    return text, train, held


def worker(args: argparse.Namespace) -> None:
    """Inside torchrun: every run in turn; rank 0 writes the JSON."""
    import torch.distributed as dist

    import hf_zero
    from hf_zero.distributed.dist import get_device

    hf_zero.init_distributed()
    world = dist.get_world_size()
    text, train, held = load_data(args, world)
    result = {"model": args.model, "steps": args.steps, "world": world, "micro": args.micro, "seq": args.seq,
              "stage": args.stage, "lr": args.lr, "seed": args.seed, "device": get_device().type,
              "corpus": {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()},
              "runs": {}}
    for run in args.runs.split(","):
        result["runs"][run] = train_one(run, args, train, held)
        result["params"] = result["runs"][run]["params"]
        if dist.get_rank() == 0:  # after every run: a call cut short by its time limit keeps the runs that finished
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "losses.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def summary(result: dict) -> list[str]:
    """The final-window means, evaluation losses and float8's relative differences from bf16, one line each."""
    runs, steps = result["runs"], result["steps"]
    window = min(FINAL, steps)
    means = {name: sum(r["losses"][-window:]) / window for name, r in runs.items()}
    lines = [f"{result['model']} ({result['params'] / 1e6:.1f}M parameters), {steps} steps, ZeRO-{result['stage']} on "
             f"{result['world']} {result['device']} rank(s), micro-batch {result['micro']} x {result['seq']} tokens; "
             f"mean loss over the final {window} steps:"]
    for name, mean in means.items():
        r = runs[name]
        diff = f", {100 * (mean - means['bf16']) / means['bf16']:+.2f}% vs bf16" if "bf16" in means and name != "bf16" else ""
        lines.append(f"  {name:<10} {mean:.4f} (eval {r['eval_loss']:.4f}, {r['seconds']:.0f} s, "
                     f"{r['float8_layers']} float8 linears){diff}")
    return lines


def write_outputs(result: dict, out: Path, png: str = "fp8_loss_curve.png", title: str = "",
                  tag: str = "fp8_loss_curve") -> list[str]:
    """losses.csv, and the plot ``png`` titled ``title`` when matplotlib is there; the files written."""
    names = list(result["runs"])
    with open(out / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *names])
        for t in range(result["steps"]):
            w.writerow([t + 1, *(f"{result['runs'][n]['losses'][t]:.6f}" for n in names)])
    written = [str(out / "losses.csv"), str(out / "losses.json")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[{tag}] matplotlib is not importable: no plot (pip install 'hf_zero[bench]')")
        return written
    fig, ax = plt.subplots(figsize=(8, 4.5))
    smooth = max(1, result["steps"] // 50)
    for n in names:
        ys = result["runs"][n]["losses"]
        avg = [sum(ys[max(0, i - smooth + 1): i + 1]) / len(ys[max(0, i - smooth + 1): i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), avg, label=n, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({smooth}-step moving mean)" if smooth > 1 else "training loss")
    ax.set_title(title or f"hf_zero ZeRO-{result['stage']}, {result['model']}: bf16 vs float8")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / png, dpi=120)
    written.append(str(out / png))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=0, help="processes: GPUs (default all visible), or CPU ranks with --device cpu (default 2)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(SHAPES), default="1.1b")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test's sizes: --model tiny, --seq 64, --micro 2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    ap.add_argument("--lr", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--out", default="fp8_loss_curve", help="folder for losses.csv, losses.json and the plot")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: print the summary and write the CSV and plot from --out's losses.json (e.g. "
                         "fetched from a GPU machine without matplotlib)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replot:
        return report(Path(args.out))
    if args.tiny:
        args.model, args.seq, args.micro = "tiny", 64, 2
    if not args.lr:
        args.lr = {"tiny": 3e-3, "150m": 6e-4, "1.1b": 3e-4}[args.model]
    bad = [r for r in args.runs.split(",") if r not in RUNS]
    if bad:
        ap.error(f"--runs: {bad[0]!r} is not one of {', '.join(RUNS)}")
    if args.steps < 1 or args.micro < 1 or args.seq < 2:
        ap.error("--steps, --micro must be at least 1 and --seq at least 2")
    if args.worker:
        worker(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible here; pass --device cpu for the smoke test")
    procs = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
           str(Path(__file__).resolve()), *forwarded, "--worker", "--out", args.out]
    done = subprocess.run(cmd, env=env)
    if done.returncode:
        print(f"[fp8_loss_curve] the torchrun of the runs exited with status {done.returncode}", file=sys.stderr)
        return done.returncode
    return report(Path(args.out))


def report(out: Path) -> int:
    """Print the summary of ``out/losses.json`` and write its CSV and plot; 1 when a loss is not finite."""
    if not (out / "losses.json").is_file():
        print(f"[fp8_loss_curve] {out / 'losses.json'} does not exist; run the script (without --replot) first",
              file=sys.stderr)
        return 2
    result = json.loads((out / "losses.json").read_text())
    for line in summary(result):
        print(line)
    for path in write_outputs(result, out):
        print(f"[fp8_loss_curve] wrote {path}")
    return 0 if all(math.isfinite(x) for r in result["runs"].values() for x in r["losses"]) else 1


if __name__ == "__main__":
    sys.exit(main())
