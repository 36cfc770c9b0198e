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
from typing import Any

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


def _dataset(n: int = N_SAMPLES) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (n, 5), generator=g)
    return torch.utils.data.TensorDataset(ids, torch.randint(0, VOCAB, (n, 5), generator=g))


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
    engine, _, loader, _ = hf_zero.initialize(model=model, model_parameters=param_groups(model), config=cfg,
                                              training_data=_dataset(case.get("samples", N_SAMPLES)))
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
    from hf_zero.checkpoint import save

    case = {"stage": 2, "micro": 3, "gas": 1, "until": 2, "save_at": 1, "dir": directory, "async_save": async_save}
    _train(rank, world, case)  # checkpoint global_step1 is complete, latest -> global_step1
    real = save.write_file  # what writes each safetensors file of a rank's share
    calls = []

    def dying(path, items, metadata=None, sync=True):  # noqa: ANN001, ANN202
        calls.append(path)
        if len(calls) == 1:
            real(path, items, metadata, sync)
            with open(path, "r+b") as f:  # and die halfway through the bytes of the next write
                f.truncate(os.path.getsize(path) // 2)
            os._exit(17)
        return real(path, items, metadata, sync)

    save.write_file = dying
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


class _StepCounts(torch.optim.SGD):
    """SGD keeping a step counter of shape [1] per parameter (as DeepSpeed's HybridStateOptimizer test does)."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st["tensor_step"] = st.get("tensor_step", torch.zeros(1)) + 1


def _frozen_and_views(rank: int, world: int, root: str) -> list[dict]:
    """Per stage: train, save whole and without frozen values, load each into a model with other values;
    DeepSpeed's names for the fp32 partitions; which loads ask for the optimizer-state file."""
    from unittest import mock

    import hf_zero
    from hf_zero.errors import CheckpointError
    from hf_zero.runtime.fp16.fused_optimizer import FP16_Optimizer
    from hf_zero.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from hf_zero.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from hf_zero.utils import safe_get_full_fp32_param
    from hf_zero.zero.init import GatheredParameters

    def engine_for(stage: int, seed: int, bf16: bool = True, opt: type | None = None) -> Any:
        torch.manual_seed(seed)
        model = Dropped()
        model.p = 0.0
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10**6,
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 20},
               "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True}
        if opt is None:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 5e-2}}
            return hf_zero.initialize(model=model, model_parameters=param_groups(model), config=cfg)[0]
        return hf_zero.initialize(model=model, optimizer=opt(param_groups(model), lr=5e-2), config=cfg)[0]

    def weights(engine: Any) -> dict[str, list[float]]:
        with GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()}

    def views(engine: Any) -> list[torch.Tensor]:
        zo = engine.optimizer
        return zo.fp32_partitioned_groups_flat if zo.stage == 3 else zo.single_partition_of_fp32_groups

    def by_position(zo: Any) -> list[dict]:  # torch's state per master, in param-group order
        return [zo.state.get(m, {}) for pg in zo.param_groups for m in pg["params"]]

    out = []
    data = torch.randint(0, VOCAB, (3, world * 2, 5), generator=torch.Generator().manual_seed(5))
    for stage, opt in ((1, None), (2, None), (3, None), (2, _StepCounts)):
        d = Path(root, f"s{stage}{'' if opt is None else 'h'}")
        eng = engine_for(stage, 0, opt=opt)
        for t in range(3):
            ids = data[t, rank * 2 : rank * 2 + 2]
            eng.backward(eng(ids, ids))
            eng.step()
        eng.save_checkpoint(str(d / "all"))
        eng.save_checkpoint(str(d / "trainable"), exclude_frozen_parameters=True)
        zo = eng.optimizer
        r: dict[str, Any] = {"stage": stage, "hybrid": opt is not None, "trained": weights(eng), "isinstance": [
            isinstance(zo, c) for c in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, FP16_Optimizer)],
            "has": [hasattr(zo, a) for a in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                                              "fp32_groups_flat")]}
        # the views against safe_get_full_fp32_param's slices of the ranges this rank owns
        full = {id(p): safe_get_full_fp32_param(p) for p in eng.module.parameters()}
        masters = [g for g in zo.groups if g.master is not None]
        if stage == 3:
            per_view = [[g] for g in masters]
        else:
            per_view = [[next(g for g in masters if g.master is m) for m in pg["params"]] for pg in zo.param_groups]
        got, mism = views(eng), 0
        for v, groups in zip(got, per_view, strict=True):
            at = 0
            for g in groups:
                for o in g.owned():
                    mism += not torch.equal(v[at + o.at : at + o.at + o.hi - o.lo],
                                            full[id(o.slot.param)].reshape(-1)[o.lo : o.hi])
                at += g.master.numel()
            mism += at != v.numel()
        r["view_mismatches"], r["views"] = mism, len(got)
        # the optimizer-state file: named only by a load of optimizer states, and it holds this rank's
        f = eng._get_optimizer_ckpt_name(str(d / "all"), "global_step3")
        from safetensors import safe_open

        with safe_open(f, framework="pt") as h:
            r["optim_keys_in_file"] = sum(k.startswith("optim.") for k in h.keys())  # noqa: SIM118
        sizes = {k: sum(p.stat().st_size for p in (d / k / "global_step3").glob("*.safetensors")) for k in ("all", "trainable")}
        r["smaller"] = sizes["trainable"] < sizes["all"]
        for kind, with_optim in (("all", True), ("trainable", False), ("trainable", True)):
            new = engine_for(stage, 1, opt=opt)  # other values everywhere, frozen layer included
            own = weights(new)
            with mock.patch.object(new, "_get_optimizer_ckpt_name", wraps=new._get_optimizer_ckpt_name) as named:
                new.load_checkpoint(str(d / kind), load_optimizer_states=with_optim)
            w = weights(new)
            r[f"{kind}-{with_optim}"] = {
                "named": named.call_count,
                "frozen_is": sorted({"saved" if w[n] == r["trained"][n] else "own" if w[n] == own[n] else "other"
                                     for n in w if n.startswith("frozen.")}),
                "trained_equal": all(w[n] == r["trained"][n] for n in w if not n.startswith("frozen.")),
                "views_equal": all(torch.equal(a, b) for a, b in zip(views(new), got, strict=True)),
                "state_equal": all(
                    s0.keys() == s1.keys() and all(torch.equal(torch.as_tensor(s0[k]), torch.as_tensor(s1[k])) for k in s0)
                    for s0, s1 in zip(by_position(zo), by_position(new.optimizer), strict=True)
                ) if with_optim else None,
            }
        if stage == 2 and opt is None:  # a parameter frozen at the save and trained here is refused, on every rank
            torch.manual_seed(1)
            model = Dropped()
            model.frozen.requires_grad_(True)
            thawed = hf_zero.initialize(model=model, model_parameters=param_groups(model), config={
                "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 5e-2}}})[0]
            try:
                thawed.load_checkpoint(str(d / "trainable"))
            except CheckpointError as e:
                r["thawed"] = str(e)
        out.append(r)
    # stage 0: the first rank stores the optimizer state every rank reads
    eng = engine_for(0, 0)
    ids = data[0, rank * 2 : rank * 2 + 2]
    eng.backward(eng(ids, ids))
    eng.step()
    eng.save_checkpoint(str(Path(root, "s0")))
    out.append({"stage": 0, "has": [hasattr(eng.optimizer, a) for a in ("single_partition_of_fp32_groups",
                                                                        "fp32_partitioned_groups_flat", "fp32_groups_flat")],
                "isinstance": isinstance(eng.optimizer, FP16_Optimizer), "whole": [
                    torch.equal(v, torch.cat([m.detach().reshape(-1) for m in pg["params"]]))
                    for v, pg in zip(eng.optimizer.fp32_groups_flat, eng.optimizer.param_groups, strict=True)],
                "file": os.path.basename(eng._get_optimizer_ckpt_name(str(Path(root, "s0")), "global_step1"))})
    return out


def test_exclude_frozen_parameters_round_trip_and_the_fp32_partition_views(tmp_path: Path) -> None:
    from hf_zero.checkpoint.consolidated import consolidate
    from hf_zero.errors import CheckpointError
    from hf_zero.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    results = spawn(_frozen_and_views, 2, str(tmp_path))
    for per_rank in results:
        s0 = per_rank.pop()
        assert s0 == {"stage": 0, "has": [False, False, True], "isinstance": True, "whole": [True, True],
                      "file": "rank00000-000.safetensors"}, s0
        for r in per_rank:
            stage = r["stage"]
            assert r["isinstance"] == [stage < 3, stage == 3, False], r["isinstance"]
            assert r["has"] == [stage < 3, stage == 3, False], r["has"]
            assert r["view_mismatches"] == 0 and r["views"] == (2 if stage < 3 else r["views"]) and r["views"] > 0, r
            assert (r["optim_keys_in_file"] > 0) != r["hybrid"] and r["smaller"], r  # SGD's counters: in the JSON
            a, t, to = r["all-True"], r["trainable-False"], r["trainable-True"]
            assert a == {"named": 1, "frozen_is": ["saved"], "trained_equal": True, "views_equal": True,
                         "state_equal": True}, a
            assert t["named"] == 0 and t["frozen_is"] == ["own"] and t["trained_equal"] and t["views_equal"], t
            assert to == dict(t, named=1, state_equal=True), to
            if "thawed" in r:
                assert "exclude_frozen_parameters=True" in r["thawed"] and "'frozen.weight' is trainable here" in r["thawed"]
        assert sum("thawed" in r for r in per_rank) == 1
    ckpt = tmp_path / "s2" / "trainable"
    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    assert not any(n.startswith("frozen.") for n in sd) and "fc1.weight" in sd
    model = Dropped()
    before = model.frozen.weight.detach().clone()
    load_state_dict_from_zero_checkpoint(model, str(ckpt))  # the frozen layer keeps the model's values
    assert torch.equal(model.frozen.weight, before) and torch.equal(model.fc1.weight.detach(), sd["fc1.weight"])
    meta = json.loads((ckpt / "global_step3" / "checkpoint.json").read_text())
    assert meta["frozen_excluded"] is True and meta["params"]["frozen.weight"]["trainable"] is False
    ranks = [json.loads(p.read_text()) for p in (ckpt / "global_step3").glob("rank*.json")]
    assert ranks and not any(k.startswith("frozen|") for rm in ranks for k in rm["ranges"])
    with pytest.raises(CheckpointError, match="exclude_frozen_parameters=True"):
        consolidate(str(ckpt), str(tmp_path / "out"))
