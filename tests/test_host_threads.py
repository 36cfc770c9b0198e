"""The offloaded CPU step sizes its own thread pool (hf_zero/zero/host_step.py ``host_step_threads``).

Launchers export ``OMP_NUM_THREADS=1`` when they start several processes; the host optimizer must not inherit that.
Each rank's count is its share of the CPUs its affinity allows, a CPU counting for every local rank that may use it.
The workers here run as the launcher leaves them (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``, see
tests/distributed.py) and see a patched affinity: the 2-core CI machine cannot show a 32-core one otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import spawn

CASES = {
    # name: (affinity of rank 0, affinity of rank 1, expected threads of rank 0, of rank 1)
    "unpinned": (range(32), range(32), 16, 16),  # torchrun's default: both ranks may run anywhere
    "pinned": (range(0, 16), range(16, 32), 16, 16),  # a launcher that binds each rank to its own cores
    "overlapping": (range(0, 8), range(0, 24), 4, 20),  # 8 shared (4 each) + 16 of rank 1's own
}


def _worker(rank: int, world: int, case: str, perc: float | None) -> dict:
    from unittest import mock

    import hf_zero
    from hf_zero.zero import host_step

    affinity = set(CASES[case][rank])
    with mock.patch.object(os, "sched_getaffinity", lambda pid: affinity), \
            mock.patch.object(os, "cpu_count", lambda: 32), mock.patch.object(host_step, "_cgroup_cpus", lambda: None):
        threads, why = host_step.host_step_threads(None, perc)
        # the whole engine: the optimizer step runs on that many threads, the rest of the process keeps the launcher's
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Linear(15, 3))
        offload_cfg = {"device": "cpu"}
        if perc is not None:
            offload_cfg["cpuadam_cores_perc"] = perc
        cfg = {"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True, "steps_per_print": 1000,
               "zero_optimization": {"stage": 2, "offload_optimizer": offload_cfg},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        engine, *_ = hf_zero.initialize(model=model, config=cfg)
        seen: list[int] = []
        opt = engine.basic_optimizer
        real_step = opt.step

        def step(*a, **k):  # noqa: ANN002, ANN003, ANN202
            seen.append(torch.get_num_threads())
            return real_step(*a, **k)

        opt.step = step
        x = torch.randn(2, 7)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        line = engine.timers.line(reset=False)
    return {"threads": threads, "why": why, "in_step": seen, "after": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "line": line}


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_step_threads_are_the_ranks_share_of_its_cores(case: str) -> None:
    out = spawn(_worker, 2, case, None)
    for rank, r in enumerate(out):
        expected = CASES[case][2 + rank]
        assert r["omp"] == "1"
        assert r["threads"] == expected, r
        assert r["in_step"] and set(r["in_step"]) == {expected}, r  # every group's step on the rank's share
        assert r["after"] == 1  # the launcher's count is back for the model's own ops
        assert f"on {expected} threads" in r["line"], r["line"]  # wall_clock_breakdown says it


def test_cores_perc_and_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    out = spawn(_worker, 2, "unpinned", 0.5)
    assert [r["threads"] for r in out] == [8, 8]
    assert "cpuadam_cores_perc 0.5" in out[0]["why"]
    from hf_zero.zero import host_step

    monkeypatch.setenv(host_step.HOST_THREADS_ENV, "3")
    assert host_step.host_step_threads() == (3, "HF_ZERO_HOST_THREADS=3")
    monkeypatch.setenv(host_step.HOST_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="HF_ZERO_HOST_THREADS='many' is not a thread count"):
        host_step.host_step_threads()
