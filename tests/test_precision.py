"""Mixed precision: DeepSpeed's dynamic loss-scale rules, fp16 overflow skips, bf16 training.

Also checks that non-boundary accumulation micro-steps issue no collective at all.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from hf_zero.config import FP16Config
from hf_zero.precision.policies import LossScaleFloorError, LossScaler
from tests.distributed import spawn
from tests.models import make_data, make_model


def test_loss_scaler_follows_deepspeed_rules() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2))
    assert s.scale == 16
    s.update(True)  # first overflow absorbed by hysteresis
    assert s.scale == 16
    s.update(True)  # second halves
    assert s.scale == 8
    s.update(False)
    s.update(False)
    assert s.scale == 8
    s.update(False)  # 3 clean steps since the last overflow: doubles
    assert s.scale == 16
    for _ in range(3):
        s.update(True)
    assert s.scale == 4
    s.update(True)
    assert s.scale == 2
    with pytest.raises(LossScaleFloorError, match="min_loss_scale"):
        s.update(True)


def test_static_loss_scale_never_moves() -> None:
    s = LossScaler(FP16Config(enabled=True, loss_scale=128.0))
    for o in (True, False, True):
        s.update(o)
    assert s.scale == 128.0 and not s.dynamic


def _fp16_and_bf16(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.zero import collectives

    out: dict = {}
    # fp16 with an absurd initial scale: the first steps overflow and are skipped, weights untouched
    model = make_model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 1, "loss_scale_window": 100},
    }
    engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, labels = make_data(30, 2 * world)
    scales, applied = [], []
    for t in range(30):
        loss = engine(ids[t, rank * 2 : rank * 2 + 2], labels[t, rank * 2 : rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        scales.append(engine.cur_scale)
        applied.append(engine.was_step_applied())
        if t == 0:
            out["unchanged_after_skip"] = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    out.update(scales=scales, applied=applied, skipped=engine.skipped_steps, dtype=str(model.fc1.weight.dtype))

    # bf16 stage 1 follows fp32 stage 1 closely
    losses = {}
    for bf16 in (False, True):
        model = make_model()
        cfg = {
            "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 1},
            "bf16": {"enabled": bf16},
        }
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        ids, labels = make_data(10, 2 * world)
        seq = []
        for t in range(10):
            loss = engine(ids[t, rank * 2 : rank * 2 + 2], labels[t, rank * 2 : rank * 2 + 2])
            engine.backward(loss)
            engine.step()
            seq.append(loss.float().item())
        losses[str(bf16)] = seq
        if bf16:
            out["master_dtype"] = str(engine.zero_optimizer.flat_groups[0].master.dtype)
            out["param_dtype"] = str(model.fc1.weight.dtype)
    out["losses"] = losses

    # gradient_accumulation_steps=3: stage 1 communicates only at the boundary; stage 2
    # reduce-scatters every micro-step and all-gathers the new weights only at the boundary
    calls = []
    for name in ("all_reduce_", "reduce_scatter_", "all_gather_"):
        orig = getattr(collectives, name)

        def counting(*a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(*a, **k)

        setattr(collectives, name, counting)
    for stage in (1, 2):
        model = make_model()
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "gradient_accumulation_steps": 3,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}}
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        ids, labels = make_data(3, 2)
        per_micro = []
        for t in range(3):
            n0 = len(calls)
            loss = engine(ids[t], labels[t])
            engine.backward(loss)
            engine.step()
            per_micro.append(sorted(set(calls[n0:])))
        out[f"collectives_per_micro_stage{stage}"] = per_micro
    dist.barrier()
    return out


def test_fp16_overflow_skips_and_bf16_trains() -> None:
    for r in spawn(_fp16_and_bf16, 2):
        assert r["dtype"] == "torch.float16"
        assert r["unchanged_after_skip"]
        assert r["applied"][0] is False and r["skipped"] >= 10
        assert r["scales"][0] == 2.0**39  # hysteresis 1: halves on the first overflow
        assert r["applied"][-1] is True and r["scales"][-1] < 2.0**20
        assert r["master_dtype"] == "torch.float32" and r["param_dtype"] == "torch.bfloat16"
        fp32, bf16 = r["losses"]["False"], r["losses"]["True"]
        assert bf16[-1] < bf16[0]
        assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 3e-2
        # stage 1: two non-boundary micro-steps without communication; the boundary reduces and gathers
        s1 = r["collectives_per_micro_stage1"]
        assert s1[0] == s1[1] == [] and "reduce_scatter_" in s1[2] and "all_gather_" in s1[2], s1
        # stage 2: every micro-step reduce-scatters; only the boundary gathers the new weights
        s2 = r["collectives_per_micro_stage2"]
        assert s2[0] == s2[1] == ["reduce_scatter_"] and "all_gather_" in s2[2], s2


# ------------------------------------------------------------------ bf16 masters and torch_autocast
# (their losses against DeepSpeed's own: tests/test_deepspeed_parity.py)

BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


@pytest.mark.parametrize("bf16,stage,offload,match", [
    ({"enabled": True, "bf16_optimizer_states": True}, 2, False, "needs bf16.bf16_master_weights_and_grads"),
    ({"enabled": True, "bf16_master_weights_and_grads": True}, 2, False, "without bf16.bf16_optimizer_states"),
    (BF16_MASTERS, 0, False, "need ZeRO stage 1, 2 or 3"),
    (BF16_MASTERS, 2, True, "with offload_optimizer are not supported yet"),
    ({**BF16_MASTERS, "enabled": False}, 2, False, "bf16.enabled is false"),
])
def test_bf16_master_rules_are_deepspeeds(bf16: dict, stage: int, offload: bool, match: str) -> None:
    from hf_zero.config import ConfigError, ZeroConfig

    zo: dict = {"stage": stage}
    if offload:
        zo["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match=match):
        ZeroConfig.load({"train_batch_size": 2, "bf16": bf16, "zero_optimization": zo})


def test_bf16_masters_accept_auto_enabled_and_autocast_dtypes() -> None:
    from hf_zero.config import ConfigError, ZeroConfig

    cfg = ZeroConfig.load({"bf16": {**BF16_MASTERS, "enabled": "auto"}, "zero_optimization": {"stage": 3}})
    assert "bf16.enabled" in cfg.auto_keys and cfg.master_dtype == torch.float32  # until the Trainer fills it
    for spelt, dtype in (("torch.bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("half", torch.float16)):
        cfg = ZeroConfig.load({"torch_autocast": {"enabled": True, "dtype": spelt}})
        assert cfg.torch_autocast.enabled and cfg.autocast_dtype == dtype
    with pytest.raises(ConfigError, match="torch_autocast.dtype: got 'fp32', expected a 16-bit dtype"):
        ZeroConfig.load({"torch_autocast": {"enabled": True, "dtype": "fp32"}})


def _bf16_masters(rank: int, world: int, ckpt: str) -> dict:
    import hf_zero

    out: dict = {}
    ids, labels = make_data(3, 2 * world)
    for stage in (1, 2, 3):
        model = make_model()  # the awkward shapes: uneven shards, a frozen layer, a tied weight
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "bf16": BF16_MASTERS,
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = hf_zero.initialize(model=model, optimizer=torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-2), config=cfg)
        for t in range(3):
            loss = engine(ids[t, rank * 2 : rank * 2 + 2], labels[t, rank * 2 : rank * 2 + 2])
            engine.backward(loss)
            engine.step()
        groups = [g for g in engine.zero_optimizer.groups if g.master is not None]
        state = [t for st in engine.basic_optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
        shares = stage < 3 and all(
            g.master.untyped_storage().data_ptr() == g.param_flat.untyped_storage().data_ptr() for g in groups)
        out[stage] = {"masters": sorted({str(g.master.dtype) for g in groups}),
                      "state": sorted({str(t.dtype) for t in state}), "n_state": len(state),
                      "master_is_param_shard": shares, "loss": float(loss), "skipped": engine.skipped_steps}
        if stage == 2:
            engine.save_checkpoint(ckpt, tag="z2")
            saved = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    # a bf16-master checkpoint resumes at stage 3 with bf16 masters, and in a plain bf16 run (fp32 masters)
    for masters in (True, False):
        model = make_model(seed=5)
        bf16 = BF16_MASTERS if masters else {"enabled": True}
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "bf16": bf16, "zero_optimization": {"stage": 3 if masters else 1}}
        engine, *_ = hf_zero.initialize(model=model, optimizer=torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-2), config=cfg)
        engine.load_checkpoint(ckpt, tag="z2")
        with hf_zero.zero.GatheredParameters(list(model.parameters())):
            out[f"resumed_masters_{masters}"] = all(
                torch.equal(p.detach().float(), saved[n]) for n, p in model.named_parameters())
        out[f"steps_{masters}"] = engine.global_steps
    return out


def test_bf16_masters_keep_no_fp32_copy() -> None:
    """bf16 masters are the parameters' own bf16 shard (stages 1-2) or the bf16 shard itself (stage 3), and
    Adam's moments are bf16: nothing of the model is held in fp32. Their checkpoint resumes at another stage,
    with bf16 masters or with fp32 ones."""
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_bf16_masters, 2, tmp)
    for res in results:
        assert res["resumed_masters_True"] and res["resumed_masters_False"] and res["steps_True"] == 3, res
        for stage in ("1", "2", "3"):
            r = res[stage]
            assert r["masters"] == ["torch.bfloat16"] and r["state"] == ["torch.bfloat16"] and r["n_state"], (stage, r)
            assert r["master_is_param_shard"] == (stage != "3") and r["skipped"] == 0
            assert r["loss"] == r["loss"] and r["loss"] < 10  # finite


def test_fp16_autocast_scales_the_loss_only_at_stage_0() -> None:
    """DeepSpeed's rule: an fp16 torch_autocast run has torch's GradScaler without ZeRO, no scaling with it."""
    from hf_zero.config import ZeroConfig
    from hf_zero.precision.policies import loss_scaler_for

    for stage, scaled in ((0, True), (1, False), (3, False)):
        cfg = ZeroConfig.load({"torch_autocast": {"enabled": True, "dtype": "fp16"}, "zero_optimization": {"stage": stage}})
        scaler = loss_scaler_for(cfg)
        assert (scaler is not None) == scaled
        if scaler is not None:
            assert scaler.scale == 2.0**16 and scaler.window == 2000 and scaler.hysteresis == 1
    bf = ZeroConfig.load({"torch_autocast": {"enabled": True, "dtype": "bf16"}, "zero_optimization": {"stage": 0}})
    assert loss_scaler_for(bf) is None


def _norm_only(rank: int, world: int) -> dict:
    import hf_zero

    out: dict = {}
    for case in ("plain", "inf"):
        model = make_model()
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 2}}
        engine, *_ = hf_zero.initialize(model=model, config=cfg)
        coefs: list = []
        real = engine.zero_optimizer.scale_grads
        engine.zero_optimizer.scale_grads = lambda c, coefs=coefs, real=real: (coefs.append(type(c).__name__), real(c))  # type: ignore[method-assign]
        ids, labels = make_data(3, 2 * world)
        norms = []
        for t in range(3):
            engine.backward(engine(ids[t, rank * 2 : rank * 2 + 2], labels[t, rank * 2 : rank * 2 + 2]))
            if case == "inf":  # what transformers' Trainer does when max_grad_norm is 0: ask for the norm alone
                engine.set_clip_for_next_step(float("inf"))
                norms.append(float(engine.current_grad_norm()))
            engine.step()
        out[case] = {"coefs": coefs, "norms": norms,
                     "weights": [p.detach().reshape(-1).tolist() for p in model.parameters()]}
    return out


def test_clip_at_infinity_touches_no_gradient() -> None:
    """``clip_grad_norm_(params, inf)`` (the Trainer's norm for logging) gives the norm and scales nothing:
    no multiply over the gradient shards, the same weights as a step never asked for its norm."""
    for r in spawn(_norm_only, 2):
        assert r["inf"]["coefs"] == ["float"] * 3 and all(n > 0 for n in r["inf"]["norms"]), r["inf"]
        assert r["inf"]["weights"] == r["plain"]["weights"]
