"""``scripts/bench_finetune.py`` end to end on CPU: the same Trainer script under hf_zero stage 2 and plain DDP,
each in its own torchrun of 2 gloo processes, on a tiny Llama; its table parses, both rows trained, and they
started from the same loss (same weights, same data, fp32: one script, two engines)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bench():  # noqa: ANN202 - the script as a module, for its row pattern and table
    spec = importlib.util.spec_from_file_location("bench_finetune", REPO / "scripts" / "bench_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_llama_two_engines_on_cpu(tmp_path: Path) -> None:
    bench = _bench()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "scripts/bench_finetune.py", "--cpu", "--gpus", "2", "--model", "tiny", "--engines", "hf2,ddp",
         "--steps", "3", "--warmup", "1", "--timeout", "80", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m["engine"]: m for m in bench.ROW.finditer(proc.stdout)}
    assert sorted(rows) == ["ddp", "hf2"], proc.stdout[-3000:]
    for engine, row in rows.items():
        assert row["status"] == "0", (engine, row.group(0))
        assert float(row["steady"].replace(",", "")) > 0 and float(row["whole"].replace(",", "")) > 0, row.group(0)
        first, last = float(row["first"]), float(row["last"])
        assert math.isfinite(first) and math.isfinite(last), row.group(0)
        assert abs(first - math.log(bench.LLAMA_SHAPES["tiny"]["vocab_size"])) < 0.5, row.group(0)  # random init
    assert rows["hf2"]["first"] == rows["ddp"]["first"], proc.stdout[-2000:]
    assert rows["hf2"]["ddp"] and rows["ddp"]["ddp"] == "1.000×" and rows["hf2"]["what"] == "hf_zero ZeRO-2"


def test_failed_engine_row_parses_and_says_why() -> None:
    """A failed launch is a row with its exit status and error, not a missing row or a row of zeros."""
    import argparse

    bench = _bench()
    args = argparse.Namespace(lora=False, cpu=True, gpus=2, batch=2, accum=1, seq=128, grad_ckpt=False, steps=3, warmup=1)
    ok = {"engine": "ddp", "rc": 0, "steady_per_s": 100.0, "whole_per_s": 50.0, "step_s": 2.56, "peak_gib": float("nan"),
          "loss_first": 6.2, "loss_last": 6.1}
    lines = bench.table(args, "tiny", [{"engine": "hf3", "rc": 1, "error": "RuntimeError: boom | x"}, ok])
    rows = {m["engine"]: m for m in bench.ROW.finditer("\n".join(lines))}
    assert rows["hf3"]["status"] == "1" and rows["hf3"]["what"].endswith("failed: RuntimeError: boom / x")
    assert rows["ddp"]["status"] == "0" and rows["ddp"]["steady"] == "100"
