"""Host overhead per training step: hf_zero's engines beside torch DDP on a model whose compute is negligible.

    PYTHONPATH=$PWD python benchmarks/bench_host_overhead.py --steps 200 --params 100
    PYTHONPATH=$PWD python benchmarks/bench_host_overhead.py --engines ddp,hf2 --profile hf2

Two CPU processes over gloo train ``--params`` tiny blocks (Linear(16, 16) + LayerNorm(16): four
parameters each, so 100 blocks are 400 parameters of 16 to 256 elements) in fp32 on a fixed
micro-batch. The arithmetic is a few microseconds, so what a step costs is what the engine does
around it in Python and in the collectives: per-parameter hooks, bucket bookkeeping, the norm, the
optimizer loop. Engines (``--engines``, comma-separated):

- ``ddp``: ``DistributedDataParallel`` in a plain loop (forward, backward, ``torch.optim.AdamW``
  step, ``zero_grad``): the reference every ratio is taken against;
- ``hf0`` .. ``hf3``: ``hf_zero.initialize`` at ZeRO stage 0-3 with the same AdamW, then
  ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``;
- ``trainer2``, ``trainer3``: ``hf_zero.Trainer`` with ``TrainingArguments(zero_config=...)`` at stage 2
  and 3 (its own AdamW, no clipping, logging, saving and reporting off), timed between two of its
  steps by a callback, so its data loading and callbacks count as they do in a real run.

Stage 3 shards every block by default (``--stage3-threshold 0``), as a large model's blocks are;
DeepSpeed's default threshold would keep these tiny parameters whole and make it stage 2 with hooks.
Each engine warms up (``--warmup`` steps), then runs ``--rounds`` rounds of ``--steps`` steps between
barriers, DDP's and the raw engines' rounds taken in turn (a load that comes and goes on a shared
machine then weighs on all of them alike; the Trainers run their rounds after, in their own loop).
The table gives the median round: steps/s, the ratio to DDP's steps/s, wall ms per step, "host ms"
(the CPU time of rank 0's main thread, which runs the Python, the hooks and, on CPU, the kernels and
autograd: the figure the noise of a shared machine disturbs least) and "cpu ms" (rank 0's whole
process, gloo's threads included). ``--profile ENGINE`` runs cProfile on rank 0 over one more round
of that engine and prints the functions that took the most time, by their own time and cumulatively.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# the repository root first, so that hf_zero and tests import without an install (the device machine has none)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTH = 16
ENGINES = ("ddp", "hf0", "hf1", "hf2", "hf3", "trainer2", "trainer3")
# not in the default list: hf1g / hf2g are hf1 / hf2 with zero_optimization.overlap_param_gather (the forward's wait hooks)
VARIANTS = ("hf1g", "hf2g")


class Block(torch.nn.Module):
    """Linear + LayerNorm + tanh: four small parameters and almost no arithmetic."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.linear(x)))


class Net(torch.nn.Module):
    """``blocks`` tiny blocks in a row; returns ``{"loss": mse}`` as a transformers model does, for the Trainer."""

    _no_split_modules = ["Block"]  # stage 3's units: one per block, as in a transformer

    def __init__(self, blocks: int, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(width) for _ in range(blocks)))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.blocks(x), labels)}


class Samples(torch.utils.data.Dataset):
    """``n`` fixed random samples ``{"x", "labels"}`` (for the Trainer; the other engines reuse one batch)."""

    def __init__(self, n: int, width: int = WIDTH) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, width, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _model(blocks: int) -> Net:
    torch.manual_seed(0)
    return Net(blocks)


def _batch(micro_batch: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"x": torch.randn(micro_batch, WIDTH, generator=g), "labels": torch.randn(micro_batch, WIDTH, generator=g)}


def _zero_config(stage: int, micro_batch: int, threshold: int, overlap: bool = False) -> dict:
    zero: dict = {"stage": stage, **({"overlap_param_gather": True} if overlap else {})}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = threshold
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": None, "zero_optimization": zero}


Clocks = tuple[float, float, float]  # wall, this thread's CPU, the process's CPU (seconds)


def _clocks() -> Clocks:
    return time.perf_counter(), time.thread_time(), time.process_time()


def _since(t0: Clocks) -> Clocks:
    t1 = _clocks()
    return t1[0] - t0[0], t1[1] - t0[1], t1[2] - t0[2]


def _time_interleaved(steps: dict[str, Callable[[], None]], opts: argparse.Namespace) -> tuple[dict[str, list[Clocks]], dict[str, str]]:
    """Warm every engine up, then time ``opts.rounds`` rounds of ``opts.steps`` steps, one round of each engine in turn.

    Taking the engines' rounds in turn, rather than all of one engine's first, spreads a load that
    comes and goes on a shared machine over all of them alike, so the ratios hold better than the
    absolute figures. Then one more round of each engine in ``opts.profile`` runs under cProfile on rank 0.
    """
    import torch.distributed as dist

    for step in steps.values():
        for _ in range(opts.warmup):
            step()
    rounds: dict[str, list[Clocks]] = {name: [] for name in steps}
    for _ in range(opts.rounds):
        for name, step in steps.items():
            dist.barrier()
            t0 = _clocks()
            for _ in range(opts.steps):
                step()
            dist.barrier()
            rounds[name].append(_since(t0))
    reports = {}
    for name, step in steps.items():
        if name not in opts.profile:
            continue
        prof = cProfile.Profile() if dist.get_rank() == 0 else None
        dist.barrier()
        if prof is not None:
            prof.enable()
        for _ in range(opts.steps):
            step()
        if prof is not None:
            prof.disable()
            reports[name] = _profile_report(prof, opts.profile_rows)
        dist.barrier()
    return rounds, reports


def _profile_report(prof: cProfile.Profile, rows: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def _ddp_step(opts: argparse.Namespace) -> Callable[[], None]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model(opts.params))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=opts.foreach or None)
    batch = _batch(opts.micro_batch, dist.get_rank())

    def step() -> None:
        model(**batch)["loss"].backward()
        opt.step()
        opt.zero_grad()

    return step


def _engine_step(stage: int, opts: argparse.Namespace, overlap: bool = False) -> Callable[[], None]:
    import torch.distributed as dist

    import hf_zero

    model = _model(opts.params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=opts.foreach or None)
    engine, *_ = hf_zero.initialize(model=model, optimizer=opt,
                                    config=_zero_config(stage, opts.micro_batch, opts.stage3_threshold, overlap))
    batch = _batch(opts.micro_batch, dist.get_rank())

    def step() -> None:
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()

    return step


def _run_trainer(stage: int, opts: argparse.Namespace, profile: bool) -> tuple[list[Clocks], str]:
    """The Trainer owns the loop: a callback marks each round's ends (after a barrier) and profiles the extra round."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import hf_zero

    AcceleratorState._reset_state(True)  # a Trainer built earlier in this process left its state behind
    GradientState._reset_state()
    marks = [opts.warmup + r * opts.steps for r in range(opts.rounds + 1)]
    last = marks[-1] + (opts.steps if profile else 0)
    rounds: list[Clocks] = []
    report: list[str] = []

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t = _clocks()
            self.prof: cProfile.Profile | None = None

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            step = state.global_step
            if step not in marks and step != last:
                return  # no barrier inside a round: the steps run as they would in a real run
            if self.prof is not None and step == last:
                self.prof.disable()
                report.append(_profile_report(self.prof, opts.profile_rows))
            dist.barrier()
            if step in marks[1:]:
                rounds.append(_since(self.t))
            self.t = _clocks()
            if profile and step == marks[-1] and dist.get_rank() == 0:
                self.prof = cProfile.Profile()
                self.prof.enable()

    world = dist.get_world_size()
    with tempfile.TemporaryDirectory() as out:
        args = hf_zero.TrainingArguments(
            output_dir=out, per_device_train_batch_size=opts.micro_batch, max_steps=last, learning_rate=1e-3,
            max_grad_norm=0.0, lr_scheduler_type="constant", logging_strategy="no", save_strategy="no",
            report_to="none", disable_tqdm=True, use_cpu=True, seed=0, dataloader_drop_last=True,
            zero_config=_zero_config(stage, opts.micro_batch, opts.stage3_threshold),
        )
        trainer = hf_zero.Trainer(model=_model(opts.params), args=args,
                                  train_dataset=Samples(world * opts.micro_batch * (last + 1)), callbacks=[Clock()])
        trainer.remove_callback(PrinterCallback)  # its end-of-training summary line is not this table's
        trainer.train()
    return rounds, "".join(report)


def _bench(rank: int, world: int, opts: argparse.Namespace) -> list[dict]:
    steps = {}
    for name in opts.engines:
        if name == "ddp":
            steps[name] = _ddp_step(opts)
        elif name.startswith("hf"):
            steps[name] = _engine_step(int(name[2]), opts, overlap=name.endswith("g"))
    rounds, reports = _time_interleaved(steps, opts)
    for name in opts.engines:
        if name.startswith("trainer"):
            rounds[name], reports[name] = _run_trainer(int(name[len("trainer"):]), opts, name in opts.profile)
    rows = []
    for name in opts.engines:
        wall, thread, proc = (statistics.median(r[i] for r in rounds[name]) for i in range(3))
        rows.append({"engine": name, "steps_per_s": opts.steps / wall, "ms_per_step": 1e3 * wall / opts.steps,
                     "host_ms_per_step": 1e3 * thread / opts.steps, "cpu_ms_per_step": 1e3 * proc / opts.steps,
                     "profile": reports.get(name, "")})
    return rows


def _entry(rank: int, world: int, store_path: str, out_dir: str, opts: argparse.Namespace) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        rows = _bench(rank, world, opts)
        if rank == 0:
            Path(out_dir, "rows.json").write_text(json.dumps(rows))
        # leave together: a gloo group torn down while a peer still uses it can abort that peer
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def format_table(rows: list[dict]) -> str:
    """The result table: one row per engine, steps/s and its ratio to DDP (``-`` when DDP did not run)."""
    ddp = next((r["steps_per_s"] for r in rows if r["engine"] == "ddp"), None)
    lines = [f"{'engine':<10} {'steps/s':>9} {'x DDP':>7} {'ms/step':>9} {'host ms/step':>13} {'cpu ms/step':>12}"]
    for r in rows:
        ratio = f"{r['steps_per_s'] / ddp:7.3f}" if ddp else f"{'-':>7}"
        lines.append(f"{r['engine']:<10} {r['steps_per_s']:9.1f} {ratio} {r['ms_per_step']:9.3f} {r['host_ms_per_step']:13.3f} {r['cpu_ms_per_step']:12.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine; the median is reported")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before the first round")
    p.add_argument("--params", type=int, default=100, help="number of blocks (4 parameters each)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    p.add_argument("--stage3-threshold", type=int, default=0,
                   help="stage3_param_persistence_threshold (0: every parameter sharded)")
    p.add_argument("--foreach", action="store_true",
                   help="AdamW(foreach=True) for ddp and hf*: on CPU torch's default steps each parameter in a Python loop")
    p.add_argument("--world", type=int, default=2, help="number of gloo processes")
    p.add_argument("--profile", default="", help="comma-separated engines to cProfile on rank 0 (one extra round)")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    opts = p.parse_args(argv)
    opts.engines = [e for e in opts.engines.split(",") if e]
    opts.profile = [e for e in opts.profile.split(",") if e]
    bad = [e for e in [*opts.engines, *opts.profile] if e not in ENGINES + VARIANTS]
    if bad:
        p.error(f"unknown engine {bad[0]!r}; pick from {', '.join(ENGINES + VARIANTS)}")
    if min(opts.steps, opts.rounds, opts.params, opts.micro_batch, opts.world) < 1 or opts.warmup < 0:
        p.error("--steps, --rounds, --params, --micro-batch and --world must be at least 1, --warmup at least 0")
    return opts


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks, run every engine in them, print the table (and any profiles)."""
    import torch.multiprocessing as mp

    opts = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(opts.world, os.path.join(tmp, "store"), tmp, opts), nprocs=opts.world,
                           start_method="spawn")
        rows = json.loads(Path(tmp, "rows.json").read_text())
    print(f"[host-overhead] {opts.world} gloo ranks, {opts.params} blocks ({4 * opts.params} parameters), "
          f"micro-batch {opts.micro_batch}, median of {opts.rounds} x {opts.steps} steps after {opts.warmup} warm-up")
    print(format_table(rows))
    for r in rows:
        if r["profile"]:
            print(f"\n[host-overhead] cProfile of {r['engine']} on rank 0, {opts.steps} steps")
            print(r["profile"])
    if opts.json:
        Path(opts.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "profile"} for r in rows], indent=1))
    if not all(math.isfinite(r["steps_per_s"]) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
