"""benchmarks/fp8_loss_curve.py's CPU smoke test: 2 gloo ranks, the tiny Llama, a few steps in each precision.

What the GPU run relies on and a CPU run can show: the three runs start from the same weights and see the same
batches (their first losses agree to float8's rounding, within 1%, while the data windows are deterministic), the
float8 runs convert the 14 projections and bf16 none, the CSV has one row a step with one column a run, and the
summary prints each final-window mean with float8's relative difference from bf16 computed from the JSON's losses.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.float8")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fp8_loss_curve  # noqa: E402


def test_batches_are_the_same_for_every_run_and_come_from_the_corpus() -> None:
    data = torch.arange(1000) % 251
    a, b = fp8_loss_curve.batches(data, 3, 4, 16, 7), fp8_loss_curve.batches(data, 3, 4, 16, 7)
    assert torch.equal(a, b) and a.shape == (3, 4, 16)
    assert not torch.equal(a, fp8_loss_curve.batches(data, 3, 4, 16, 8))  # the seed picks the windows
    assert all(torch.equal(row, (row[0] + torch.arange(16)) % 251) for row in a.reshape(-1, 16))  # contiguous windows


def test_runs_differ_only_in_the_fp8_section() -> None:
    args = argparse.Namespace(micro=2, stage=3, lr=1e-3, steps=20, tiny=True)
    base, tw = fp8_loss_curve.engine_config("bf16", args), fp8_loss_curve.engine_config("tensorwise", args)
    assert "fp8" not in base and tw.pop("fp8") == {"enabled": True, "recipe": "tensorwise"} and tw == base


def test_smoke_run_writes_the_curves_and_the_summary(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_loss_curve.py"), "--device", "cpu", "--tiny",
                           "--steps", "6", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "losses.json").read_text())
    runs = result["runs"]
    assert list(runs) == ["bf16", "tensorwise", "rowwise"] and result["world"] == 2 and result["device"] == "cpu"
    assert [r["float8_layers"] for r in runs.values()] == [0, 14, 14]
    first = [r["losses"][0] for r in runs.values()]
    assert max(first) - min(first) < 0.01 * first[0], first  # same weights, same first batch
    assert all(r["losses"][-1] < r["losses"][0] for r in runs.values()), runs
    rows = list(csv.reader(open(tmp_path / "losses.csv")))
    assert rows[0] == ["step", "bf16", "tensorwise", "rowwise"] and len(rows) == 7
    assert [float(x) for x in rows[1][1:]] == pytest.approx(first, abs=1e-6)
    mean = {n: sum(r["losses"]) / 6 for n, r in runs.items()}
    for name in ("tensorwise", "rowwise"):
        line = re.search(rf"^  {name} +([\d.]+) \(eval [\d.]+, .*\), ([+-][\d.]+)% vs bf16$", proc.stdout, re.M)
        assert line, proc.stdout
        assert float(line.group(1)) == pytest.approx(mean[name], abs=1e-4)
        assert float(line.group(2)) == pytest.approx(100 * (mean[name] - mean["bf16"]) / mean["bf16"], abs=0.01)
    assert "mean loss over the final 6 steps" in proc.stdout


def test_zenflow_curve_trains_its_runs_through_the_same_loop(tmp_path: Path) -> None:
    """benchmarks/zenflow_loss_curve.py reuses this script's data, model and training loop: the same first loss in
    every run (same weights, same batch; ZenFlow only changes what the steps after it apply), ZenFlow's host updates
    every update_interval steps, the exact run's every step."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "zenflow_loss_curve.py"), "--model", "tiny",
                           "--steps", "8", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "losses.json").read_text())["runs"]
    assert list(runs) == ["exact", "zenflow", "zenflow_overlap"]
    assert len({r["losses"][0] for r in runs.values()}) == 1, runs
    assert runs["exact"]["host_updates"] == 8 and 0 < runs["zenflow"]["host_updates"] < 8, runs
    assert runs["exact"]["losses"] != runs["zenflow"]["losses"]
