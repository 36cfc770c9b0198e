"""``hf_zero.Accelerator``: a plain Accelerate loop gains ZeRO by changing the import, and gives the
same weights as plain Accelerate (DDP over gloo) on the same data: gradient accumulation through
``accumulate()``, clipping through ``clip_grad_norm_``, a prepared scheduler, fp32, 2 processes."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import spawn
from tests.models import VOCAB, make_model

STEPS, MICRO, GAS = 3, 2, 2


def _loop(rank: int, world: int, cases: list) -> list:
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    out = []
    for stage in cases:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        if isinstance(stage, dict):
            out.append(_sections_case(rank, world, stage))
            continue
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        g = torch.Generator().manual_seed(3)
        n = STEPS * GAS * MICRO * world
        data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, 5), generator=g), torch.randint(0, VOCAB, (n, 5), generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
        if stage is None:
            acc = accelerate.Accelerator(gradient_accumulation_steps=GAS, cpu=True)
        else:
            cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 20}}
            acc = hf_zero.Accelerator(gradient_accumulation_steps=GAS, cpu=True, zero_config=cfg)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        norms = []
        for ids, labels in loader:
            with acc.accumulate(model):
                loss = model(ids, labels)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.05)))
                opt.step()
                sched.step()
                opt.zero_grad()
        state = acc.get_state_dict(model)
        out.append({"stage": stage, "norms": norms, "weights": {k: v.float().reshape(-1).tolist() for k, v in state.items()},
                    "lr": sched.get_last_lr(), "unwrapped": type(acc.unwrap_model(model)).__name__})
    return out


SECTION_STEPS, WARMUP = 4, 2
SECTIONS = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.99]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                                      "total_num_steps": "auto", "warmup_type": "linear"}},
}


def ds_warmup_decay(step: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear, from 0) as a LambdaLR factor: optimizer step k runs at iteration k - 2."""
    it = step - 1
    if it < 0:
        return 0.0
    return it / WARMUP if it < WARMUP else max(0.0, (SECTION_STEPS - it) / max(1, SECTION_STEPS - WARMUP))


def _sections_case(rank: int, world: int, case: dict) -> dict:
    """A GPT-2 whose optimizer and schedule come from the config's sections through DummyOptim / DummyScheduler
    (hf_zero), or their torch equivalents with the schedule stepped by hand once per optimizer step (plain)."""
    import accelerate
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zero

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (SECTION_STEPS * GAS * MICRO * world, 8), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=MICRO, shuffle=False)
    if case["zero"]:
        acc = hf_zero.Accelerator(gradient_accumulation_steps=GAS, cpu=True, zero_config=SECTIONS)
        opt = hf_zero.DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.1)
        # as a loop counts it, from the unsharded loader: Accelerate divides it by the processes
        sched = hf_zero.DummyScheduler(opt, total_num_steps=SECTION_STEPS * world, warmup_num_steps=WARMUP)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    else:
        acc = accelerate.Accelerator(gradient_accumulation_steps=GAS, cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, ds_warmup_decay)
        model, opt, loader = acc.prepare(model, opt, loader)
    lrs = []
    for (batch,) in loader:
        with acc.accumulate(model):
            acc.backward(model(input_ids=batch, labels=batch).loss)
            opt.step()
            if case["zero"] or acc.sync_gradients:  # hf_zero's step() is a no-op: the engine advances it
                sched.step()
            if acc.sync_gradients:
                lrs.append(sched.get_last_lr()[0])
            opt.zero_grad()
    state = acc.get_state_dict(model)
    return {"lrs": lrs, "weights": {k: v.float().reshape(-1).tolist() for k, v in state.items()}}


def test_accelerate_loop_matches_plain_accelerate() -> None:
    results = spawn(_loop, 2, [None, 0, 2, 3, {"zero": False}, {"zero": True}])
    for per_rank in results:
        plain, sections = per_rank.pop(-2), per_rank.pop(-1)
        assert sections["lrs"] == pytest.approx(plain["lrs"], rel=1e-12) and len(plain["lrs"]) == SECTION_STEPS
        assert plain["lrs"][:2] == [0.0, 5e-3], plain["lrs"]
        for name, w in plain["weights"].items():
            x, y = torch.tensor(sections["weights"][name]), torch.tensor(w)
            assert float((x - y).abs().max()) < 1e-5, name
        ref = per_rank[0]
        assert len(ref["norms"]) == STEPS
        for got in per_rank[1:]:
            assert got["unwrapped"] == "Awkward"
            assert got["lr"] == ref["lr"]
            for a, b in zip(got["norms"], ref["norms"]):
                assert abs(a - b) / b < 1e-5, (got["stage"], got["norms"], ref["norms"])
            for name, w in ref["weights"].items():
                x, y = torch.tensor(got["weights"][name]), torch.tensor(w)
                assert float((x - y).norm() / y.norm()) < 1e-5, (got["stage"], name)


def _save_load(rank: int, world: int, directory: str) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    def build():  # noqa: ANN202
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        acc = hf_zero.Accelerator(cpu=True, zero_config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20}})
        model, opt, sched = acc.prepare(model, opt, sched)
        return acc, model, opt, sched

    def train(acc, model, opt, sched, seed: int) -> None:  # noqa: ANN001
        g = torch.Generator().manual_seed(seed + rank)
        for _ in range(2):
            ids, labels = torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)
            acc.backward(model(ids, labels))
            opt.step()
            sched.step()
            opt.zero_grad()

    acc, model, opt, sched = build()
    train(acc, model, opt, sched, seed=1)
    acc.save_state(directory)
    train(acc, model, opt, sched, seed=2)
    want = {k: v.reshape(-1).tolist() for k, v in acc.get_state_dict(model).items()}
    want_lr = sched.get_last_lr()
    # save_model(safe_serialization=False): Accelerate's pickle, whole and in shards, the same values
    pickled = {}
    for name, size in (("bin", "10GB"), ("bin_shards", 200)):
        acc.save_model(model, os.path.join(directory, name), max_shard_size=size, safe_serialization=False)
        folder = os.path.join(directory, name)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".bin"))
        state = {}
        for f in files:
            state.update(torch.load(os.path.join(folder, f), weights_only=True))
        pickled[name] = {"files": len(files), "index": os.path.isfile(os.path.join(folder, "pytorch_model.bin.index.json")),
                         "same": {k: v.reshape(-1).tolist() for k, v in state.items()} == want}
    acc, model, opt, sched = build()
    acc.load_state(directory)
    train(acc, model, opt, sched, seed=2)
    got = {k: v.reshape(-1).tolist() for k, v in acc.get_state_dict(model).items()}
    return {"same": got == want, "lr": [sched.get_last_lr(), want_lr], "pickled": pickled}


def test_save_state_load_state_round_trip(tmp_path) -> None:  # noqa: ANN001
    for r in spawn(_save_load, 2, str(tmp_path)):
        assert r["same"] and r["lr"][0] == r["lr"][1], r
        assert r["pickled"]["bin"] == {"files": 1, "index": False, "same": True}, r
        assert r["pickled"]["bin_shards"]["files"] > 1 and r["pickled"]["bin_shards"]["index"], r
        assert r["pickled"]["bin_shards"]["same"], r
