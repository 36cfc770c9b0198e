"""``benchmarks/bench_host_overhead.py`` on 2 gloo ranks for a handful of steps, and the gradient packing it led to.

The benchmark must print one row per engine with finite, positive figures (DDP's ratio to itself
1.000), so that it keeps running as the engines change. ``pack_grads`` packs a bucket with one
``torch.cat`` when every parameter has its gradient; it must give the same buffer as its
per-parameter path does when one gradient is missing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_zero.zero.group import lay_out, pack_grads

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["ddp", "hf0", "hf1", "hf2", "hf3", "trainer2", "trainer3"]


def test_bench_host_overhead_prints_a_row_per_engine(tmp_path: Path) -> None:
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_host_overhead.py"), "--steps", "3", "--rounds", "2",
         "--warmup", "1", "--params", "3", "--engines", ",".join(ENGINES), "--json", str(out_json)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["engine", "steps/s"])
    rows = [line.split() for line in lines[head + 1 : head + 1 + len(ENGINES)]]
    assert [r[0] for r in rows] == ENGINES, proc.stdout
    for r in rows:
        figures = [float(x) for x in r[1:]]
        assert len(figures) == 5 and all(math.isfinite(x) and x > 0 for x in figures), r
    assert rows[0][2] == "1.000"
    saved = json.loads(out_json.read_text())
    assert [r["engine"] for r in saved] == ENGINES


def _grads(slots: list, missing: str | None) -> None:
    g = torch.Generator().manual_seed(3)
    for s in slots:
        s.param.grad = None if s.name == missing else torch.randn(s.shape, generator=g).to(s.param.dtype)
    # a gradient laid out transposed (as autograd may leave one): it must be read in the parameter's order
    w = slots[0]
    if w.param.grad is not None:
        w.param.grad = w.param.grad.t().contiguous().t()


def test_pack_grads_cat_matches_per_parameter_copies() -> None:
    params = [("w", torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16))),
              ("b", torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))),
              ("s", torch.nn.Parameter(torch.zeros((), dtype=torch.bfloat16)))]
    slots, numel = lay_out(params)
    padded = numel + 3
    _grads(slots, missing=None)
    assert not slots[0].param.grad.is_contiguous()
    fast, held = pack_grads(slots, padded, torch.float32, torch.device("cpu"))
    want = torch.cat([s.param.grad.float().reshape(-1) for s in slots] + [torch.zeros(3)])
    assert torch.equal(fast, want)
    assert [id(h) for h in held] == [id(s.param.grad) for s in slots]
    # one gradient missing: the per-parameter path, zeros in its place
    _grads(slots, missing="b")
    slow, held = pack_grads(slots, padded, torch.float32, torch.device("cpu"))
    want = torch.cat([slots[0].param.grad.float().reshape(-1), torch.zeros(3), slots[2].param.grad.float().reshape(-1),
                      torch.zeros(3)])
    assert torch.equal(slow, want)
    assert len(held) == 2
