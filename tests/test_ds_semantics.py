"""DeepSpeed's semantics where a script depends on them, checked against DeepSpeed 0.19.8 itself.

One script written against DeepSpeed's API (``tests/ds_oracle_semantics.py``) runs twice on two ranks:
under DeepSpeed on the CPU (its own interpreter, ``tests/dsenv.py``) and here, on gloo, with ``hf_zero``
passed as ``deepspeed``. What it observes must be the same: ``load_checkpoint`` where nothing was saved,
the optimizer ``initialize`` returns and ``isinstance`` on it and on the engine, ``zero.Init`` parameters
around ``GatheredParameters`` and in a stage-3 engine, ``checkpoint.tag_validation``,
``get_accelerator().device_count()``, ``RepeatingLoader``, ``utils.groups``, ``destroy()``; and the values
of ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` and of the
setters at ZeRO stages 0-3 (fp32 to 1e-6, bf16 to the rounding of its reductions).

The same spawn checks what only hf_zero has to show (:func:`_hf_only`): ``destroy()`` takes the hooks off
and frees the masters and optimizer state while the caller still holds the engine and the optimizer, and
the module trains again in a new engine; ranks with different tags save one checkpoint under rank 0's
tag (``Warn``) or stop with one sentence (``Fail``) before anything is written; a ``latest`` file one rank
sees and another does not is refused on both; the local accessors and the gradient setter at every stage.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import ds_oracle_semantics as sem
from tests.distributed import spawn

_RUN: dict[str, Any] = {}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _hf_only(rank: int, world: int, root: str) -> dict:
    import gc
    import weakref

    import torch.distributed as dist

    import hf_zero
    from hf_zero.errors import CheckpointError, CheckpointTagError, UsageError
    from hf_zero.utils import groups
    from hf_zero.zero import accessors as tf

    out: dict[str, Any] = {}
    log = _Records()
    logging.getLogger("hf_zero").addHandler(log)
    base = Path(root, "hf_only")

    # destroy: hooks off, memory released although the caller holds the engine and the optimizer
    for stage in (0, 2, 3):
        model = sem._net()
        engine, opt, _, _ = hf_zero.initialize(model=model, optimizer=sem._adamw(model), config=sem._config(stage))
        sem._step(engine, 0, rank, world)
        sem._step(engine, 1, rank, world)
        zo = engine.zero_optimizer
        masters = [weakref.ref(g.master) for g in zo.groups if g.master is not None]
        states = [weakref.ref(v) for st in zo.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        had = _hooks(model)
        with hf_zero.zero.GatheredParameters(list(model.parameters())):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.destroy()
        engine.destroy()  # harmless
        gc.collect()
        r = {"hooks_before": had, "hooks_after": _hooks(model), "masters_freed": all(m() is None for m in masters),
             "states_freed": all(s() is None for s in states), "opt_emptied": all(not pg["params"] for pg in opt.param_groups),
             "no_engine_attrs": not any(k.startswith("hf_zero_group") or k == "hf_zero_flat" or k == "hf_zero_owner"
                                        for p in model.parameters() for k in p.__dict__)}
        try:
            engine(*sem._batch(0, rank, world))
            r["forward_after"] = "ran"
        except UsageError as e:
            r["forward_after"] = str(e)
        # the module keeps its weights (stage 3: as zero.Init's slices, 0 elements outside a gather)
        r["numel_outside"] = model.fc1.weight.numel()
        with hf_zero.zero.GatheredParameters(list(model.parameters())):
            r["weights_kept"] = all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
        again, *_ = hf_zero.initialize(model=model, optimizer=sem._adamw(model), config=sem._config(stage))
        r["trains_again"] = sem._step(again, 2, rank, world) > 0
        again.destroy()
        out[f"destroy_z{stage}"] = r

    # tag_validation: Warn saves one checkpoint under rank 0's tag (and says so on rank 0), Fail writes nothing
    for mode in ("Warn", "Ignore", "Fail"):
        model = sem._net()
        engine, *_ = hf_zero.initialize(model=model, optimizer=sem._adamw(model),
                                        config=sem._config(2, checkpoint={"tag_validation": mode}))
        sem._step(engine, 0, rank, world)
        sem._step(engine, 1, rank, world)
        where = base / f"tags_{mode}"
        log.lines.clear()
        try:
            path = engine.save_checkpoint(str(where), tag=f"tag-{rank}")
            out[f"tags_{mode}"] = [os.path.basename(path), sorted(os.listdir(where)), sum("not the same" in m for m in log.lines)]
            other = sem._net()
            fresh, *_ = hf_zero.initialize(model=other, optimizer=sem._adamw(other), config=sem._config(2))
            out[f"tags_{mode}_loads"] = os.path.basename(fresh.load_checkpoint(str(where))[0])
            fresh.destroy()
        except CheckpointTagError as e:
            out[f"tags_{mode}"] = [type(e).__name__, isinstance(e, AssertionError), str(e), os.path.exists(where)]
        engine.destroy()

    # load_checkpoint without a tag: DeepSpeed's warning; a latest only some ranks see is refused on all
    model = sem._net()
    engine, *_ = hf_zero.initialize(model=model, optimizer=sem._adamw(model), config=sem._config(1))
    log.lines.clear()
    out["load_nothing"] = [list(engine.load_checkpoint(str(base / "nothing"))), [m for m in log.lines if "latest" in m]]
    mine = base / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (mine / "latest").write_text("global_step1")
    dist.barrier()
    try:
        engine.load_checkpoint(str(base / f"rank{rank}"))
        out["latest_on_one_rank"] = "loaded"
    except CheckpointError as e:
        out["latest_on_one_rank"] = str(e).replace(f"rank{rank}", "rankN")
    engine.destroy()

    # a write to ds_tensor is the parameter's value from then on (hf_zero's partition is the fp32 master; DeepSpeed's
    # master keeps its old values); optimizer.step() moves no counter; inputs as given, cast only by fp16.auto_cast
    chain = sem.Chain()
    cfg = sem._config(3, "bf16", optimizer={"type": "Adam", "params": {"lr": 1.0}}, gradient_accumulation_steps=1)
    engine, *_ = hf_zero.initialize(model=chain, model_parameters=chain.parameters(), config=cfg)
    chain.a.weight.ds_tensor.data = torch.full_like(chain.a.weight.ds_tensor.data, 1 + rank)
    chain.b.weight.ds_tensor.fill_(2 * (1 + rank))  # in place, outside no_grad: a view outside autograd
    try:
        chain.a.weight.ds_tensor.data = torch.zeros(3)
        out["ds_tensor_wrong_size"] = "accepted"
    except ValueError as e:
        out["ds_tensor_wrong_size"] = str(e)
    engine.backward(engine(torch.ones(3, 5)).sum())
    engine.optimizer.step()
    with hf_zero.zero.GatheredParameters(list(chain.parameters())):
        out["after_optimizer_step"] = [chain.a.weight.float().flatten().tolist(), chain.b.weight.float().flatten().tolist(),
                                       engine.global_steps]
    zo = engine.optimizer
    engine.destroy()
    out["optimizer_step_after_destroy"] = _raises(zo.step)
    linear = torch.nn.Linear(4, 2)
    engine, *_ = hf_zero.initialize(model=linear, optimizer=torch.optim.SGD(linear.parameters(), lr=0.1),
                                    config=sem._config(0, "bf16"))
    out["fp32_into_bf16_linear"] = _raises(lambda: engine(torch.ones(2, 4)))
    out["bf16_into_bf16_linear"] = str(engine(torch.ones(2, 4, dtype=torch.bfloat16)).dtype)
    engine.destroy()
    for auto_cast in (True, False):
        scale = sem.Scale()
        engine, *_ = hf_zero.initialize(model=scale, optimizer=torch.optim.SGD(scale.parameters(), lr=0.1),
                                        config=sem._config(2, fp16={"enabled": True, "auto_cast": auto_cast}))
        out[f"fp16_auto_cast_{auto_cast}"] = str(engine(torch.ones(3, 5)).dtype)
        engine.destroy()
    out["apply_restored"] = torch.nn.Module.apply is torch.nn.Module.__dict__["apply"] and getattr(
        torch.nn.Module.apply, "__wrapped__", None) is None

    # local accessors and the gradient setter, at every stage: a set gradient is the one the step uses
    for stage in (0, 1, 2, 3):
        model = sem._net()
        engine, *_ = hf_zero.initialize(model=model, optimizer=sem._adamw(model), config=sem._config(stage))
        params = dict(engine.module.named_parameters())
        w = params["fc1.weight"]
        for t in range(sem.GAS):
            x, y = sem._batch(t, rank, world)
            engine.backward(engine(x, y))
            if t < sem.GAS - 1:
                engine.step()
        local = tf.safe_get_local_fp32_param(w)
        sizes = _gather_ints(local.numel())
        new = torch.full((8, 5), 0.25)
        tf.safe_set_full_grad(w, new)
        got_grad = tf.safe_get_full_grad(w)
        m_before = tf.safe_get_full_optimizer_state(w, "exp_avg")
        engine.step()
        m_after = tf.safe_get_full_optimizer_state(w, "exp_avg")
        tf.safe_set_local_fp32_param(w, torch.full_like(tf.safe_get_local_fp32_param(w), float(rank + 1)))
        full = tf.safe_get_full_fp32_param(w).reshape(-1)
        expect = torch.cat([torch.full((n,), float(r + 1)) for r, n in enumerate(sizes)])
        out[f"local_z{stage}"] = {
            "sizes_cover": sum(sizes) == 40 if stage > 0 else all(n == 40 for n in sizes),
            "grad_set": torch.equal(got_grad, new),
            "step_used_it": m_before is None and torch.allclose(m_after, 0.1 * new),
            "local_set": torch.equal(full, expect) if stage > 0 else torch.equal(full, torch.full((40,), float(rank + 1))),
            "frozen": [tf.safe_get_full_fp32_param(params["scale"]), tf.safe_get_full_grad(params["scale"])] == [None, None],
        }
        engine.destroy()
    try:
        tf.safe_set_full_fp32_param(params["fc1.weight"], torch.zeros(3))
        out["after_destroy"] = "no-op"
    except UsageError as e:
        out["after_destroy"] = str(e)

    # groups answer for the last engine; before one, for the world
    out["groups"] = [groups._get_data_parallel_world_size(), groups._get_sequence_data_parallel_world_size(),
                     groups.get_tensor_model_parallel_world_size(), groups._get_broadcast_src_rank()]
    logging.getLogger("hf_zero").removeHandler(log)
    return out


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the sentence is what is checked
        return f"{type(e).__name__}: {e}"
    return "ran"


def _hooks(model: torch.nn.Module) -> int:
    """Forward hooks on the model's modules and gradient hooks on its parameters."""
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return modules + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _gather_ints(n: int) -> list[int]:
    from hf_zero.distributed import dist as hz_dist

    return [v[0] for v in hz_dist.gather_ints([n])]


def _hf_side(rank: int, world: int, root: str) -> dict:
    from safetensors.torch import save_file

    import hf_zero

    out = {"facts": sem.facts(hf_zero, rank, world, root), "accessors": []}
    for i, case in enumerate(sem.ACCESSOR_CASES):
        info, tensors = sem.accessors(hf_zero, rank, world, case)
        out["accessors"].append(info)
        if rank == 0:
            save_file(tensors, os.path.join(root, f"hf_accessors_{i}.safetensors"))
    out["hf_only"] = _hf_only(rank, world, root)
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("hf_semantics")
    return root, spawn(_hf_side, 2, str(root))


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    from tests import dsenv

    root = tmp_path_factory.mktemp("ds_semantics")
    dsenv.run_torchrun(Path(sem.__file__), 2, str(root), timeout=900)
    return root, [json.loads((root / f"result_rank{r}.json").read_text()) for r in (0, 1)]


def test_what_a_script_observes_is_deepspeeds(hf: tuple[Path, list[dict]], ds: tuple[Path, list[dict]]) -> None:
    for rank in (0, 1):
        ours, theirs = hf[1][rank]["facts"], ds[1][rank]["facts"]
        assert ours == theirs, {k: (ours.get(k), v) for k, v in theirs.items() if ours.get(k) != v}
    # the values the script pins down, as DeepSpeed gave them
    f = ds[1][0]["facts"]
    assert f["opt_z0"]["is_client"] and not f["opt_z2"]["is_client"] and f["opt_z3"]["stage3"], f
    assert f["load_nothing"] == [[None, None], [None, None]] and f["load_nothing_untouched"], f
    assert f["init_outside"] == [0, [8, 5], 40, "NOT_AVAILABLE", True] and f["init_after"] == [0, "NOT_AVAILABLE"], f
    assert f["tag_foo"] == "DeepSpeedConfigError" and f["tag_fail"] == "AssertionError" and f["tag_Warn"] == "saved", f
    assert f["z3_forward"][0] == "torch.float32" and f["z3_ds_tensor_numel"] == [8, 8], f  # an input as given
    assert f["z3_optimizer_step"][1] == ["NOT_AVAILABLE"] and f["ungrouped_trained"] == [False, True], f
    assert f["init_parent_apply"] == [6, [1.0] * 6] and ds[1][1]["facts"]["init_parent_apply"] == [6, [1.0] * 6], f
    assert f["device_count_local_size"] == 5 and f["repeating"] == [1, 2, 3, 1, 2, 3, 1] and f["sp_group"] == "KeyError", f


def test_accessors_equal_deepspeeds(hf: tuple[Path, list[dict]], ds: tuple[Path, list[dict]]) -> None:
    from safetensors.torch import load_file

    for i, case in enumerate(sem.ACCESSOR_CASES):
        ours = load_file(str(hf[0] / f"hf_accessors_{i}.safetensors"))
        theirs = load_file(str(ds[0] / f"accessors_{i}.safetensors"))
        info, their_info = hf[1][0]["accessors"][i], ds[1][0]["accessors"][i]
        if case["stage"] == 0:
            # DeepSpeed's fp32 engine at stage 0 keeps no fp32 copy and no wrapper: it answers None for the master and
            # the optimizer state (and its setters do nothing); hf_zero answers with the values, which in fp32 are
            # those of every other stage (DeepSpeed's stage 1 here)
            assert their_info["fp32.fc1.weight"] is None and their_info["exp_avg.fc1.weight"] is None, their_info
            stage1 = load_file(str(ds[0] / "accessors_1.safetensors"))
            theirs = {**{k: v for k, v in stage1.items() if not k.startswith(("next.", "grad."))}, **theirs}
        tol = 1e-6 if case["dtype"] == "fp32" else 2e-2  # bf16: gradients reduced in bf16 on both sides
        assert {k for k, v in info.items() if k.startswith(("grad.", "fp32.", "exp_avg")) and v is None} == {
            k for k, v in their_info.items() if k.startswith(("grad.", "fp32.", "exp_avg")) and v is None
            and not (case["stage"] == 0 and not k.startswith("grad.") and not k.endswith("scale"))}, (case, info)
        compared = 0
        for key, want in theirs.items():
            if key.startswith("next.") or key not in ours:
                continue  # after the set: see below
            got = ours[key]
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
            assert err <= tol, (case, key, err)
            compared += 1
        assert compared >= 18, (case, compared)
        # hf_zero's setter also sets the weights the model computes with (DeepSpeed's follow at the next step):
        # the next loss is a plain copy's with the weights as set
        for r in hf[1]:
            got, want = r["accessors"][i]["loss_after_set"], r["accessors"][i]["plain_loss_after_set"]
            assert abs(got - want) <= (1e-6 if case["dtype"] == "fp32" else 2e-2) * abs(want), (case, got, want)


def test_destroy_tags_load_and_local_accessors(hf: tuple[Path, list[dict]]) -> None:
    r0, r1 = (r["hf_only"] for r in hf[1])
    for stage in (0, 2, 3):
        d = r0[f"destroy_z{stage}"]
        assert d["hooks_before"] > 0 and d["hooks_after"] == 0, (stage, d)
        assert d["masters_freed"] and d["states_freed"] and d["opt_emptied"] and d["no_engine_attrs"], (stage, d)
        assert d["forward_after"].startswith("engine.destroy() was called"), d
        assert d["numel_outside"] == (0 if stage == 3 else 40) and d["weights_kept"] and d["trains_again"], (stage, d)
    # Warn: one checkpoint, under rank 0's tag, named once (on rank 0); Ignore: the same without a word
    assert r0["tags_Warn"] == ["tag-0", ["latest", "tag-0"], 1] and r1["tags_Warn"] == ["tag-0", ["latest", "tag-0"], 0], r0
    assert r0["tags_Ignore"][:2] == ["tag-0", ["latest", "tag-0"]] and r0["tags_Ignore"][2] == 0, r0
    assert r0["tags_Warn_loads"] == "tag-0", r0
    name, is_assert, msg, written = r0["tags_Fail"]
    assert name == "CheckpointTagError" and is_assert and not written and r1["tags_Fail"] == r0["tags_Fail"], r0
    assert "rank 0 passed tag 'tag-0' and rank 1 passed 'tag-1'" in msg and "tag_validation" in msg, msg
    assert r0["load_nothing"][0] == [None, None], r0
    assert r0["load_nothing"][1] and "Unable to find latest file at" in r0["load_nothing"][1][0], r0
    assert r0["latest_on_one_rank"] == r1["latest_on_one_rank"], (r0, r1)
    assert "rank 0 finds a 'latest' file there but rank 1 does not" in r0["latest_on_one_rank"], r0
    for stage in (0, 1, 2, 3):
        assert all(r0[f"local_z{stage}"].values()) and all(r1[f"local_z{stage}"].values()), (stage, r0, r1)
    assert r0["after_destroy"] == "no-op", r0
    assert "holds 8 elements, t has 3" in r0["ds_tensor_wrong_size"], r0
    a, b, steps = r0["after_optimizer_step"]  # written (1 / 2 per rank, times 1 / 2 per weight), then Adam's first step: -1
    want = [0.0] * 8 + [1.0] * 7, [1.0] * 8 + [3.0] * 7  # Adam's first step moves by lr * g / (|g| + eps)
    assert max(abs(x - y) for got, w in zip((a, b), want) for x, y in zip(got, w)) < 1e-6 and steps == 0, r0
    assert r0["optimizer_step_after_destroy"].startswith("UsageError: this optimizer belongs to no engine"), r0
    msg = r0["fp32_into_bf16_linear"]
    assert msg.startswith("UsageError: the model's weights are bfloat16 but engine(...) got float32 inputs"), msg
    assert r0["bf16_into_bf16_linear"] == "torch.bfloat16" and r0["apply_restored"], r0
    assert r0["fp16_auto_cast_True"] == "torch.float16" and r0["fp16_auto_cast_False"] == "torch.float32", r0
    assert r0["groups"] == [2, 2, 1, 0], r0
