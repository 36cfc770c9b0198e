"""Coming from DeepSpeed: its checkpoints, generated here by DeepSpeed 0.19.8 on the CPU, resume in hf_zero.

``tests/ds_oracle_train.py`` trains a tied GPT-2 (frozen position embedding, two AdamW param
groups, clipping, WarmupLR, accumulation 2) under DeepSpeed on 2 gloo ranks, ZeRO 1-3 in fp32
and bf16 (plus ZeRO 0 fp32, ZeRO 2 fp16 and a transformers Trainer at ZeRO 3), checkpoints it
after 2 optimizer steps and trains 6 more micro-steps. hf_zero then:

- at world size 2, loads each checkpoint (into another ZeRO stage than the one that saved it)
  and trains the same 6 micro-steps: the losses equal DeepSpeed's own continuation and the final
  weights equal ``zero_to_fp32`` of DeepSpeed's last checkpoint (fp32: rel 1e-5);
- at world size 3, loads each one and a fixed batch's loss equals DeepSpeed's at the checkpoint;
- resumes the Trainer's ``checkpoint-2`` with ``resume_from_checkpoint`` to DeepSpeed's numbers;
- ``hf-zero convert-deepspeed --consolidated`` equals ``zero_to_fp32`` (DeepSpeed ran it and
  wrote safetensors; nothing DeepSpeed writes is unpickled here except through hf_zero's
  weights-only reader, which is what is under test);
- refuses, in one sentence naming it, a planted pickle whose reduce would run ``os.system``
  (the marker file it would create never appears), a missing rank file, tensor/pipeline-parallel
  files and an NVMe swap folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import ds_oracle_train as oracle
from tests.distributed import spawn

FP32 = ["z1_fp32", "z2_fp32", "z3_fp32"]
BF16 = ["z1_bf16", "z2_bf16", "z3_bf16"]
DTYPE = {c["name"]: c["dtype"] for c in oracle.CASES if "dtype" in c}  # "fp32", "bf16", "bf16_fp32acc", "fp16"
AFTER = 6  # micro-steps trained after the checkpoint


@pytest.fixture(scope="module")
def ds_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    return oracle.oracle_output(tmp_path_factory)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


# --------------------------------------------------------------------------- hf_zero side (spawned)


def _engine(stage: int, dtype: str, n_layer: int = 2) -> object:
    import hf_zero

    model = oracle.make_model(n_layer=n_layer)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=oracle.param_groups(model), config=oracle.ds_config(stage, dtype))
    return engine


def _fixed_loss(engine: object) -> float:
    engine.eval()
    with torch.no_grad():
        ids = oracle.fixed_batch()
        loss = float(engine(input_ids=ids, labels=ids).loss.float())
    engine.train()
    return loss


def _resume(rank: int, world: int, out: str, cases: list, bad: list, trainer: dict | None) -> dict:
    """Load DeepSpeed's first checkpoint of each case, check a fixed batch, train on; refusals; the Trainer."""
    results: dict = {}
    for name, stage in cases:
        res = oracle.result(out, name)
        engine = _engine(stage, DTYPE[name])
        path, client = engine.load_checkpoint(res["save_dir"], tag=res["tags"][0])
        got = {"path": path, "client": client, "steps": engine.global_steps, "fixed": _fixed_loss(engine),
               "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
               "lr": engine.get_lr()}
        if world == 2:
            losses = []
            for t in range(2 * 2, 2 * 2 + AFTER):
                ids = oracle.micro_batch(t, world, rank)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach().float()))
            got["losses"] = losses
            engine.save_pretrained(os.path.join(out, "hf_zero", f"{name}-as-stage{stage}"))
        results[f"{name}->{stage}"] = got
    for name, stage in [c for c in cases if "exclfrozen" in c[0]] if world == 2 else []:
        # offline (hf-zero convert-deepspeed, no model at hand to name the left-out frozen parameters), then loaded
        import torch.distributed as dist

        from hf_zero.checkpoint import deepspeed as ds_checkpoint

        res = oracle.result(out, name)
        dst = os.path.join(out, "hf_zero", f"{name}-converted")
        if rank == 0:
            shutil.rmtree(dst, ignore_errors=True)
            ds_checkpoint.convert(res["save_dir"], dst, tag=res["tags"][0], progress=False)
        dist.barrier()
        engine = _engine(stage, DTYPE[name])
        engine.load_checkpoint(dst)
        got = {"fixed": _fixed_loss(engine), "losses": []}
        for t in range(2 * 2, 2 * 2 + AFTER):
            ids = oracle.micro_batch(t, world, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            got["losses"].append(float(loss.detach().float()))
        results[f"offline {name}->{stage}"] = got
    for label, path in bad:
        engine = _engine(1, "fp32", n_layer=3 if label == "other model" else 2)
        try:
            engine.load_checkpoint(path)
            results[label] = "loaded"
        except Exception as e:  # noqa: BLE001 - the sentence is the result
            results[label] = f"{type(e).__name__}: {e}"
    if trainer is not None:
        import hf_zero

        kw = oracle.trainer_args(trainer["output_dir"], 3)
        config = kw.pop("config")
        t = hf_zero.Trainer(model=oracle.make_model(), args=hf_zero.TrainingArguments(**kw, zero_config=config),
                            train_dataset=oracle.trainer_dataset())
        t.train(resume_from_checkpoint=trainer["resume"])
        results["trainer"] = [e for e in t.state.log_history if "loss" in e]
    return results


def _plant(src: str, dst: Path, marker: Path) -> str:
    """A copy of a DeepSpeed checkpoint whose rank-1 optimizer file would run ``touch marker`` if unpickled."""

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    shutil.copytree(src, dst)
    torch.save({"optimizer_state_dict": Evil()}, dst / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    return str(dst)


def _bad_folders(out: str, tmp: Path) -> list[tuple[str, str]]:
    res = oracle.result(out, "z1_fp32")
    tag_dir = os.path.join(res["save_dir"], res["tags"][0])
    missing = tmp / "missing" / "global_step2"
    shutil.copytree(tag_dir, missing)
    os.remove(missing / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    return [("planted", _plant(tag_dir, tmp / "planted" / "global_step2", tmp / "marker")), ("missing", str(missing)),
            ("other model", tag_dir)]


@pytest.fixture(scope="module")
def world2(ds_out: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("ds_bad")
    # each checkpoint into another stage than the one that saved it (and ZeRO 0, fp16 into their own)
    cases = [("z1_fp32", 3), ("z2_fp32", 1), ("z3_fp32", 2), ("z1_bf16", 2), ("z2_bf16", 3), ("z3_bf16", 1),
             ("z0_fp32", 0), ("z0_fp32", 2), ("z0_bf16", 1), ("z1_bf16acc", 3), ("z2_fp16", 2), ("z2_bf16master", 3),
             ("z3_autocast", 2), ("z2_exclfrozen", 3), ("z3_exclfrozen", 2)]
    trainer = {"output_dir": str(tmp / "trainer"),
               "resume": os.path.join(ds_out, "trainer_z3", "trainer", "checkpoint-2")}
    results = spawn(_resume, 2, ds_out, cases, _bad_folders(ds_out, tmp), trainer)
    return results, tmp


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", FP32 + BF16 + ["z0_fp32", "z0_bf16", "z1_bf16acc", "z2_fp16", "z2_bf16master",
                                                "z3_autocast", "z2_exclfrozen", "z3_exclfrozen"])
def test_world2_continues_as_deepspeed_did(world2: tuple[dict, Path], ds_out: str, name: str) -> None:
    results, _ = world2
    ref = oracle.result(ds_out, name)
    for key in [k for k in results[0] if k.startswith(name + "->")]:
        for rank in (0, 1):
            got = results[rank][key]
            assert got["steps"] == 2 and got["client"] == {"epoch": 3, "note": "from deepspeed"}
            assert got["path"].endswith(ref["tags"][0])
            theirs = [step[rank] for step in ref["losses"][4 : 4 + AFTER]]
            # bf16/fp16 steps round differently from DeepSpeed's; bf16 masters and autocast (with DeepSpeed reducing in
            # fp32, ds_oracle_train.ds_config) do the same arithmetic
            tol = 1e-5 if DTYPE[name] in ("fp32", "bf16master", "autocast") else 2e-3
            assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], theirs)) <= tol, (key, got["losses"], theirs)
            assert got["fixed"] == pytest.approx(ref["fixed_loss"], rel=1e-6 if DTYPE[name] == "fp32" else 1e-3)
        if DTYPE[name] != "fp32" or name.startswith("z0"):
            continue  # 16-bit weights are the masters rounded; ZeRO 0 has no zero_to_fp32
        final = load_file(os.path.join(ds_out, name, f"zero_to_fp32_{ref['tags'][1]}.safetensors"))
        mine = load_file(os.path.join(ds_out, "hf_zero", key.replace("->", "-as-stage"), "model.safetensors"))
        for n, t in mine.items():
            if n not in final:  # zero_to_fp32 leaves out ZeRO 1's frozen parameters (see the convert test), and
                # a checkpoint saved without them holds none: the model's own value, as DeepSpeed's run kept it
                assert n == "transformer.wpe.weight" and (name.startswith("z1") or "exclfrozen" in name), n
                if "exclfrozen" in name:
                    torch.testing.assert_close(t, oracle.make_model().transformer.wpe.weight.detach(), rtol=0, atol=0)
                continue
            # Elementwise: GPT-2's key bias gets a gradient that is only rounding noise (softmax ignores it),
            # which Adam scales up to whole steps, so another stage's summation order moves it by ~1e-7.
            torch.testing.assert_close(t, final[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["z2_exclfrozen", "z3_exclfrozen"])
def test_offline_conversion_of_a_folder_saved_without_frozen_parameters_resumes(world2: tuple[dict, Path], ds_out: str,
                                                                                name: str) -> None:
    """``hf-zero convert-deepspeed`` has no model to name what ``exclude_frozen_parameters=True`` left out: the copy
    says it was saved so, and a load keeps the model's own values for what is frozen there (as DeepSpeed's run did)."""
    results, _ = world2
    ref = oracle.result(ds_out, name)
    keys = [k for k in results[0] if k.startswith(f"offline {name}->")]
    assert keys
    for key in keys:
        for rank in (0, 1):
            got = results[rank][key]
            theirs = [step[rank] for step in ref["losses"][4 : 4 + AFTER]]
            assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], theirs)) <= 1e-5, (key, got["losses"], theirs)
            assert got["fixed"] == pytest.approx(ref["fixed_loss"], rel=1e-6)


def test_world2_fp16_loss_scaler_and_scheduler(world2: tuple[dict, Path]) -> None:
    results, _ = world2
    got = results[0]["z2_fp16->2"]
    # DeepSpeed's dynamic scaler at 2**8 (initial_scale_power 8) after 2 clean steps; WarmupLR one step into 3
    assert got["scaler"] == {"scale": 256.0, "cur_hysteresis": 2, "cur_iter": 2, "last_overflow_iter": -1}
    assert results[0]["z1_fp32->3"]["lr"] == pytest.approx([1e-2 / 3, 1e-2 / 3])


def test_trainer_resumes_a_deepspeed_checkpoint(world2: tuple[dict, Path], ds_out: str) -> None:
    results, tmp = world2
    theirs = oracle.result(ds_out, "trainer_z3")["log"]
    for rank in (0, 1):
        mine = results[rank]["trainer"]
        assert [e["step"] for e in mine] == [1, 2, 3, 4]
        for a, b in zip(mine[2:], theirs[2:]):  # steps 3 and 4 trained here, from DeepSpeed's checkpoint-2
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    from hf_zero.checkpoint.consolidated import read_state_dict

    mine = read_state_dict(str(tmp / "trainer" / "checkpoint-4"), tag="zero_state")
    final = load_file(os.path.join(ds_out, "trainer_z3", "zero_to_fp32_checkpoint-4.safetensors"))
    for n, t in mine.items():
        assert _rel(t, final[n]) <= 1e-5, n


def test_a_planted_global_is_refused_on_every_rank_and_never_runs(world2: tuple[dict, Path]) -> None:
    results, tmp = world2
    for rank in (0, 1):
        msg = results[rank]["planted"]
        assert "DeepSpeedCheckpointError" in msg and "'posix.system'" in msg and "zero_pp_rank_1" in msg, msg
        assert "could run code" in msg
    assert not (tmp / "marker").exists()
    from hf_zero.checkpoint import deepspeed as ds_checkpoint

    with pytest.raises(ds_checkpoint.DeepSpeedCheckpointError, match="posix.system"):
        ds_checkpoint.convert(str(tmp / "planted" / "global_step2"), str(tmp / "planted_out"), progress=False)
    assert not (tmp / "marker").exists() and not (tmp / "planted_out" / "global_step2").exists()


def test_a_missing_rank_file_is_refused_on_every_rank(world2: tuple[dict, Path]) -> None:
    results, _ = world2
    for rank in (0, 1):
        assert "is incomplete: zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in results[rank]["missing"]


def test_another_model_is_refused_naming_the_deepspeed_folder(world2: tuple[dict, Path]) -> None:
    results, _ = world2
    for rank in (0, 1):
        msg = results[rank]["other model"]
        assert "global_step2 was saved from a different model: it has no 'transformer.h.2.ln_1.weight'" in msg, msg


def _world3(rank: int, world: int, out: str, cases: list) -> dict:
    return _resume(rank, world, out, cases, [], None)


def test_world3_loads_every_stage_and_dtype(ds_out: str) -> None:
    cases = [("z1_fp32", 1), ("z2_fp32", 3), ("z3_fp32", 3), ("z1_bf16", 3), ("z2_bf16", 2), ("z3_bf16", 2),
             ("z0_fp32", 3), ("z0_bf16", 2), ("z1_bf16acc", 1), ("z2_fp16", 1)]
    results = spawn(_world3, 3, ds_out, cases)
    for name, stage in cases:
        ref = oracle.result(ds_out, name)
        for rank in range(3):
            got = results[rank][f"{name}->{stage}"]
            assert got["steps"] == 2 and got["client"]["note"] == "from deepspeed"
            assert got["fixed"] == pytest.approx(ref["fixed_loss"], rel=1e-6 if DTYPE[name] == "fp32" else 1e-3), name


# ------------------------------------------------------------------------ convert-deepspeed (CLI)


@pytest.mark.parametrize("name", FP32 + BF16)
def test_convert_consolidated_equals_zero_to_fp32(ds_out: str, tmp_path: Path, name: str) -> None:
    from hf_zero.launch import cli

    ref = oracle.result(ds_out, name)
    tag = ref["tags"][0]
    assert cli.main(["convert-deepspeed", ref["save_dir"], str(tmp_path / "hz"), "--tag", tag, "--consolidated"]) == 0
    mine = load_file(str(tmp_path / "hz" / "consolidated" / "model.safetensors"))
    theirs = load_file(os.path.join(ds_out, name, f"zero_to_fp32_{tag}.safetensors"))
    for n, t in theirs.items():
        if n == "lm_head.weight":  # zero_to_fp32 repeats the tied head; save_pretrained does not
            assert n not in mine and torch.equal(t, theirs["transformer.wte.weight"])
            continue
        assert mine[n].dtype == torch.float32 and torch.equal(mine[n], t), n
    # ZeRO 1 keeps frozen parameters only in the module state dict, which zero_to_fp32 does not read
    for n in set(mine) - set(theirs):
        assert n == "transformer.wpe.weight" and name.startswith("z1"), n
        frozen = oracle.make_model().transformer.wpe.weight.detach()  # held in the compute dtype by DeepSpeed
        assert torch.equal(mine[n], frozen.to(torch.bfloat16 if DTYPE[name] == "bf16" else torch.float32).float())
    meta = json.loads((tmp_path / "hz" / tag / "checkpoint.json").read_text())
    assert (tmp_path / "hz" / "latest").read_text() == tag and meta["global_steps"] == 2 and meta["world_size"] == 2
    assert meta["client_state"] == {"epoch": 3, "note": "from deepspeed"}


def test_convert_reads_what_zero_to_fp32_cannot(ds_out: str, tmp_path: Path) -> None:
    """ZeRO 1 in bf16 with fp32 gradient accumulation saves BF16_Optimizer's files, which zero_to_fp32 refuses."""
    from hf_zero.checkpoint import deepspeed as ds_checkpoint
    from hf_zero.checkpoint.deepspeed_read import load_pickle

    ref = oracle.result(ds_out, "z1_bf16acc")
    assert "is not a zero checkpoint" in ref["zero_to_fp32_error"]
    tag = ref["tags"][0]
    ds_checkpoint.consolidate(ref["save_dir"], str(tmp_path), tag=tag, progress=False)
    mine = load_file(str(tmp_path / "model.safetensors"))
    module = load_pickle(os.path.join(ref["save_dir"], tag, "mp_rank_00_model_states.pt"))["module"]
    for n, t in mine.items():  # DeepSpeed's bf16 weights are its fp32 masters rounded
        assert torch.equal(t.to(torch.bfloat16), module[n]), n


def test_convert_a_trainer_checkpoint_gives_a_from_pretrained_folder(ds_out: str, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    from hf_zero.checkpoint.consolidated import read_state_dict
    from hf_zero.launch import cli

    src = os.path.join(ds_out, "trainer_z3", "trainer", "checkpoint-4")
    assert cli.main(["convert-deepspeed", src, str(tmp_path / "hz"), "--consolidated", str(tmp_path / "weights")]) == 0
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "weights"))
    theirs = load_file(os.path.join(ds_out, "trainer_z3", "zero_to_fp32_checkpoint-4.safetensors"))
    for n, p in model.state_dict().items():
        assert torch.equal(p, theirs[n]), n
    # the hf_zero checkpoint itself reads back through hf_zero's own consolidation
    for n, t in read_state_dict(str(tmp_path / "hz")).items():
        assert torch.equal(t, theirs[n]), n


def test_zero0_with_two_param_groups_converts_only_where_the_order_is_known(ds_out: str, tmp_path: Path) -> None:
    """ZeRO 0 stores optimizer state by position; offline, two param groups leave the order unknown."""
    from hf_zero.checkpoint import deepspeed as ds_checkpoint

    ref = oracle.result(ds_out, "z0_fp32")
    with pytest.raises(ds_checkpoint.DeepSpeedCheckpointError, match="stored by position only"):
        ds_checkpoint.convert(ref["save_dir"], str(tmp_path / "out"), tag=ref["tags"][0], progress=False)
    assert not (tmp_path / "out" / ref["tags"][0]).exists()


def test_a_damaged_rank_file_is_named(ds_out: str, tmp_path: Path) -> None:
    from hf_zero.checkpoint import deepspeed as ds_checkpoint

    ref = oracle.result(ds_out, "z3_fp32")
    src = tmp_path / "ckpt" / ref["tags"][0]
    shutil.copytree(os.path.join(ref["save_dir"], ref["tags"][0]), src)
    victim = src / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:2000])
    with pytest.raises(ds_checkpoint.DeepSpeedCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt cannot be "
                       "read as a torch checkpoint .*; the file is damaged"):
        ds_checkpoint.convert(str(src), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out" / ref["tags"][0]).exists() and not (tmp_path / "out" / f".{ref['tags'][0]}.partial").exists()


@pytest.mark.parametrize("plant,match", [
    ("mp_rank_01_model_states.pt", "tensor/model-parallel rank files \\('mp_rank_01_model_states.pt'\\)"),
    ("layer_01-model_00-model_states.pt", "pipeline-parallel layer files"),
    ("offloaded_tensors/", "NVMe offload swap folder"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", "mixture-of-experts files"),
])
def test_layouts_hf_zero_does_not_take_are_refused(ds_out: str, tmp_path: Path, plant: str, match: str) -> None:
    from hf_zero.launch import cli

    ref = oracle.result(ds_out, "z2_fp32")
    src = tmp_path / "ckpt" / ref["tags"][0]
    shutil.copytree(os.path.join(ref["save_dir"], ref["tags"][0]), src)
    if plant.endswith("/"):
        (src / plant).mkdir()
    else:
        (src / plant).write_bytes(b"")
    with pytest.raises(Exception, match=match):
        from hf_zero.checkpoint import deepspeed as ds_checkpoint

        ds_checkpoint.convert(str(src), str(tmp_path / "out"), progress=False)
    assert cli.main(["convert-deepspeed", str(src), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out" / ref["tags"][0]).exists()
