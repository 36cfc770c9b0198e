"""Resume checkpoints: exact resume in fresh processes, resharding across world sizes and stages,
atomic writes that survive a writer killed halfway.

The model has dropout (so RNG state matters), a frozen layer and a tied weight; training uses
the engine's own data loader (so its position matters), gradient accumulation, clipping, AdamW
and a warm-up schedule (so optimizer and scheduler state matter).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn
from tests.models import VOCAB, Awkward, param_groups

N_SAMPLES = 120


class Dropped(Awkward):
    p = 0.2

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = torch.nn.functional.dropout(h, self.p, self.training)
        h = h + self.fc2(torch.tanh(self.fc1(h))) + self.frozen(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (N_SAMPLES, 5), generator=g)
    return torch.utils.data.TensorDataset(ids, torch.randint(0, VOCAB, (N_SAMPLES, 5), generator=g))


def _train(rank: int, world: int, case: dict) -> dict:
    """Train until ``case['until']`` optimizer steps; optionally load first and/or save at ``save_at``."""
    import torch.distributed as dist

    import hf_zero
    from hf_zero.zero.init import GatheredParameters

    torch.manual_seed(0)
    model = Dropped()
    model.p = case.get("dropout", 0.2)
    cfg = {
        "train_micro_batch_size_per_gpu": case["micro"],
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-2, "eps": 1e-6}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 5e-2}},
        "zero_optimization": {"stage": case["stage"], "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 20},
        "bf16": {"enabled": case.get("bf16", False)},
        "steps_per_print": 10**6,
        "checkpoint": {"async_save": case.get("async_save", False)},
    }
    torch.manual_seed(1000 + rank)  # each rank's own RNG stream (dropout)
    engine, _, loader, _ = hf_zero.initialize(model=model, model_parameters=param_groups(model), config=cfg, training_data=_dataset())
    out: dict = {"losses": {}}
    if case.get("load"):
        path, client = engine.load_checkpoint(case["dir"])
        out["client"] = client
        out["loaded_path"] = os.path.basename(path)
    it = iter(loader)
    while engine.global_steps < case["until"]:
        total = torch.zeros((), device=engine.device)
        for _ in range(case["gas"]):
            ids, labels = next(it)
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / case["gas"]
        dist.all_reduce(total)
        out["losses"][engine.global_steps] = total.item() / world
        if engine.global_steps == case.get("save_at"):
            engine.save_checkpoint(case["dir"], client_state={"epoch": 0, "note": "k"})
    engine.wait_for_checkpoint()  # (async_save) the write is part of the run
    with GatheredParameters(list(engine.module.parameters())):
        out["weights"] = {n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
    out["lr"] = engine.get_lr()
    return out


CASES = [
    {"stage": 0, "micro": 3, "gas": 2},
    {"stage": 1, "micro": 3, "gas": 2},
    {"stage": 2, "micro": 3, "gas": 2},
    {"stage": 3, "micro": 3, "gas": 2},
    {"stage": 2, "micro": 3, "gas": 2, "bf16": True},
]
K = 3


def _grid(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_train(rank, world, c) for c in cases]


def test_resume_in_fresh_processes_is_bit_exact(tmp_path: Path) -> None:
    full, first = [], []
    for i, c in enumerate(CASES):
        full.append(dict(c, until=2 * K))
        first.append(dict(c, until=K, save_at=K, dir=str(tmp_path / f"c{i}")))
    ref = spawn(_grid, 2, full + first)[0]
    resumed = spawn(_grid, 2, [dict(c, until=2 * K, load=True, dir=str(tmp_path / f"c{i}")) for i, c in enumerate(CASES)])[0]
    for i, c in enumerate(CASES):
        want, got = ref[i], resumed[i]
        assert got["client"] == {"epoch": 0, "note": "k"} and got["loaded_path"] == f"global_step{K}", c
        later = {s: v for s, v in want["losses"].items() if int(s) > K}
        assert got["losses"] == later, (c, got["losses"], later)  # bit for bit
        assert got["weights"] == want["weights"], c
        assert got["lr"] == want["lr"], c
        assert (tmp_path / f"c{i}" / "latest").read_text() == f"global_step{K}"


def test_reshard_world4_stage2_to_world2_stage1_and_world3_stage3(tmp_path: Path) -> None:
    # the same global batch of 12 at every world size: 4 x 3, 2 x 3 x 2 accumulation, 3 x 4; no
    # dropout, since per-rank random streams cannot map onto a different number of ranks
    base = {"stage": 2, "micro": 3, "gas": 1, "dropout": 0.0}
    ref = spawn(_grid, 4, [dict(base, until=2 * K), dict(base, until=K, save_at=K, dir=str(tmp_path))])[0][0]
    to2 = spawn(_grid, 2, [{"stage": 1, "micro": 3, "gas": 2, "until": 2 * K, "load": True, "dir": str(tmp_path), "dropout": 0.0}])[0][0]
    to3 = spawn(_grid, 3, [{"stage": 3, "micro": 4, "gas": 1, "until": 2 * K, "load": True, "dir": str(tmp_path), "dropout": 0.0}])[0][0]
    for got in (to2, to3):
        for s, v in got["losses"].items():
            assert abs(v - ref["losses"][s]) / abs(ref["losses"][s]) < 1e-5, (s, v, ref["losses"][s])
        for n, w in got["weights"].items():
            a, b = torch.tensor(w), torch.tensor(ref["weights"][n])
            assert float((a - b).norm() / b.norm()) < 1e-5, n


def _killed_mid_save(rank: int, world: int, directory: str, async_save: bool) -> None:
    import safetensors.torch

    case = {"stage": 2, "micro": 3, "gas": 1, "until": 2, "save_at": 1, "dir": directory, "async_save": async_save}
    _train(rank, world, case)  # checkpoint global_step1 is complete, latest -> global_step1
    real = safetensors.torch.save_file
    calls = []

    def dying(tensors, path, metadata=None):  # noqa: ANN001, ANN202
        calls.append(path)
        if len(calls) == 1:
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:  # and die halfway through the bytes of the next write
                f.truncate(os.path.getsize(path) // 2)
            os._exit(17)
        return real(tensors, path, metadata=metadata)

    safetensors.torch.save_file = dying
    _train(rank, world, dict(case, until=2, save_at=2))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async_save"])
def test_writer_killed_halfway_leaves_previous_checkpoint(tmp_path: Path, async_save: bool) -> None:
    """With ``async_save`` the writer that dies is the background thread, after training went on."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessExitedException):
        spawn(_killed_mid_save, 1, str(tmp_path), async_save)
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not (tmp_path / "global_step2").exists() and (tmp_path / ".global_step2.partial").exists()
    meta = json.loads((tmp_path / "global_step1" / "checkpoint.json").read_text())
    assert meta["global_steps"] == 1
    got = spawn(_grid, 1, [{"stage": 2, "micro": 3, "gas": 1, "until": 2, "load": True, "dir": str(tmp_path)}])[0][0]
    assert got["loaded_path"] == "global_step1" and list(got["losses"]) == ["2"]
