"""``benchmarks/bench_checkpoint.py`` on CPU: one process saves, saves in the background and loads a tiny Llama with
hf_zero and with torch DCP (FSDP2); every row has its figures and the table prints. The GPU figures come from the
same script under torchrun (BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_tiny_llama_on_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_checkpoint.py", "--device", "cpu", "--model", "tiny", "--gpus", "1",
         "--engines", "hf,dcp", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["engine"]: r for r in (json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
                                     if line.startswith("RESULT "))}
    assert sorted(rows) == ["dcp", "hf"], proc.stdout[-3000:]
    for row in rows.values():
        for key in ("step_s", "save_s", "blocked_s", "call_async_s", "blocked_async_s", "load_s", "bytes"):
            assert row[key] > 0, (key, row)
    # the same model and Adam state in two formats: within 25% of each other's size
    assert 0.75 < rows["hf"]["bytes"] / rows["dcp"]["bytes"] < 1.25, rows
    assert rows["hf"]["dd_s"] > 0
    assert proc.stdout.splitlines()[-3].startswith("engine "), proc.stdout[-1000:]
