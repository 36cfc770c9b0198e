"""hf_zero's ZenFlow against DeepSpeed 0.19.8's own, run on the CPU (its ``cpu_adam`` op JIT-built, gloo, one rank).

The same model, batches and config (``tests/ds_oracle_zenflow.py``: ZeRO 2, ``offload_optimizer`` on the cpu, AdamW,
no clipping) for 10 steps, with warm-up rounds, reselection and the host update every 2 or 3 steps: the losses and the
final weights must agree within float32 rounding (measured: 1.2e-7). What DeepSpeed runs is its ZenFlow with one
line corrected in the oracle (``patch_deepspeed_views``: its parameters view its column-major buffers row-major, so
unpatched it trains a permutation of the weights), on a model without 1-D parameters (its column scores of a weight
after a bias read the wrong part of the gradient bucket); those two bugs are measured in the oracle's docstrings. Its
``overlap_step`` is not compared: DeepSpeed's overlapped worker keeps two sets of Adam moments, used in alternate
intervals from zero (``csrc/adam/cpu_adam_impl.cpp``'s ``exp_avg[now_state]``), where hf_zero's steps the one host
state (hf_zero/zero/zenflow.py); ``tests/test_zenflow.py`` checks the overlapped mode against its definition.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests import ds_oracle_zenflow as oracle
from tests.distributed import spawn

CASES = [
    {"name": "warm_reselect", "steps": 10, "zenflow": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 4,
                                                        "update_interval": 2, "full_warm_up_rounds": 1}},
    {"name": "every_3", "steps": 10, "zenflow": {"topk_ratio": 0.2, "select_strategy": "step", "select_interval": 6,
                                                  "update_interval": 3}},
]


def _hf_zero(rank: int, world: int, cases: list) -> dict:
    import hf_zero

    out = {}
    for case in cases:
        engine, *_ = hf_zero.initialize(model=oracle.make_model(), config=oracle.config(case["zenflow"]))
        losses = []
        for t in range(case["steps"]):
            loss = oracle.loss_of(engine, *oracle.batch(t, world, rank))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[case["name"]] = {"losses": losses,
                             "weights": {n: p.detach().tolist() for n, p in engine.module.named_parameters()}}
        engine.destroy()
    return out


def test_sequential_zenflow_equals_deepspeeds(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests import dsenv

    dsenv.deepspeed_python()  # skips where the environment cannot be built
    if not (dsenv.op_built("cpu_adam") or os.environ.get("HF_ZERO_DS_OPS") == "1"):
        pytest.skip("DeepSpeed's cpu_adam op is not built: run `python -m tests.dsenv --ops` (minutes) or set HF_ZERO_DS_OPS=1")
    dsenv.clear_stale_lock("cpu_adam")
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    dsenv.run_torchrun(Path(oracle.__file__), 1, str(tmp_path), str(tmp_path / "cases.json"), timeout=900)
    mine = spawn(_hf_zero, 1, CASES)[0]
    for case in CASES:
        name = case["name"]
        theirs = json.loads((tmp_path / f"{name}.json").read_text())["losses"]
        weights = load_file(str(tmp_path / f"{name}.safetensors"))
        loss_gap = max(abs(a - b) for a, b in zip(mine[name]["losses"], theirs))
        gap = max(float((torch.tensor(mine[name]["weights"][n]) - w).abs().max()) for n, w in weights.items())
        print(f"{name}: hf_zero vs DeepSpeed 0.19.8 ZenFlow after {case['steps']} steps: weights within {gap:.2e}, "
              f"losses within {loss_gap:.2e}")
        assert len(theirs) == case["steps"] and set(weights) == set(mine[name]["weights"])
        assert gap <= 1e-6 and loss_gap <= 1e-6, (name, gap, loss_gap)
