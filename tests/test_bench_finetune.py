"""``benchmarks/bench_finetune.py`` end to end on CPU: the same Trainer script under hf_zero stage 2 and plain DDP,
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
    spec = importlib.util.spec_from_file_location("bench_finetune", REPO / "benchmarks" / "bench_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_llama_two_engines_on_cpu(tmp_path: Path) -> None:
    bench = _bench()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_finetune.py", "--cpu", "--gpus", "2", "--model", "tiny", "--engines", "hf2,ddp",
         "--steps", "3", "--warmup", "1", "--timeout", "80", "--out", str(tmp_path), "--memory-peak"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # --memory-peak needs the CUDA allocator: on CPU one line says so and the run is the same as without it
    assert proc.stdout.count("--memory-peak needs CUDA") == 1 and "[memory]" not in proc.stdout, proc.stdout[-3000:]
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


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_memory_peak_splits_held_and_step_blocks_by_site() -> None:
    """--memory-peak's replay on a synthetic snapshot: the blocks live at the step's start are grouped by their
    innermost engine/library frame; of those, the one the step freed before its peak is not counted there, the
    one it freed after is; the step's own blocks are split by site at the peak, not at the end."""
    bench = _bench()
    gather = [_frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py", 9, "_call_impl"),
              _frame("/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", 40, "alloc_all_gather"),
              _frame("/work/wt/a/hf_zero/zero/stage3.py", 7, "gather")]
    snapshot = {"segments": [
        {"device": 0, "address": 0, "blocks": [
            {"address": 0, "size": 100, "state": "active_allocated", "frames": gather[1:]},
            {"address": 100, "size": 50, "state": "inactive", "frames": []},
            {"address": 150, "size": 30, "state": "active_pending_free", "frames": gather[2:]},
            {"address": 180, "size": 20, "state": "active_allocated", "frames": []}]},
        {"device": 0, "address": 1000, "blocks": [
            {"address": 1000, "size": 40, "state": "active_allocated",
             "frames": [_frame("/tmp/site/peft/tuners/lora/layer.py", 3, "update_layer"), gather[2]]}]},
        {"device": 1, "address": 5000, "blocks": [{"address": 5000, "size": 999, "state": "active_allocated",
                                                   "frames": gather}]}]}
    held = bench.held_by_address(snapshot, 0)
    fsdp = "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:40 alloc_all_gather"
    stage3, lora = "hf_zero/zero/stage3.py:7 gather", "peft/tuners/lora/layer.py:3 update_layer"
    nothing = "(no Python frame: e.g. autograd's backward kernels)"
    assert held == {0: (100, fsdp), 150: (30, stage3), 180: (20, nothing), 1000: (40, lora)}

    step_frames = [_frame("/site-packages/transformers/models/llama/modeling_llama.py", 5, "forward")]
    trace = [
        {"action": "free_completed", "addr": 150, "size": 30},   # inherited, freed before the peak
        {"action": "alloc", "addr": 2000, "size": 70, "frames": step_frames},
        {"action": "alloc", "addr": 3000, "size": 25, "frames": gather},
        {"action": "free_completed", "addr": 3000, "size": 25},  # the step's own, freed before the peak
        {"action": "alloc", "addr": 4000, "size": 60, "frames": gather[2:]},  # peak: 190 - 30 + 70 + 60 = 290
        {"action": "free_completed", "addr": 0, "size": 100},    # inherited, freed after the peak
        {"action": "alloc", "addr": 6000, "size": 80, "frames": step_frames},
    ]
    old_freed, in_step, held_at_peak = bench.replay_peak(trace, bench.MEMORY_SITES, held)
    assert old_freed == 30
    assert in_step == {"transformers/models/llama/modeling_llama.py:5 forward": 70, stage3: 60}
    assert held_at_peak == {fsdp: 100, nothing: 20, lora: 40}
    from bench import peak_breakdown  # benchmarks/bench.py, on the path bench_finetune.py put it on

    before = sum(size for size, _ in held.values())
    assert peak_breakdown(trace, before, bench.MEMORY_SITES) == (before - old_freed, in_step)
    assert before - old_freed == sum(held_at_peak.values())
