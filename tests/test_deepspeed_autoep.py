"""DeepSpeed's AutoEP checkpoints, made by DeepSpeed 0.19.8 on the CPU, load in hf_zero as its other checkpoints do.

``tests/ds_oracle_autoep.py`` (one torchrun of DeepSpeed's interpreter, 4 gloo ranks, under a minute on two cores)
trains a tiny Mixtral at ZeRO 2 and 3 (and at ZeRO 1 in bf16), a tiny Qwen3-MoE at ZeRO 2 and a tiny Qwen2-MoE (a
shared expert with its gate, which AutoEP renames) at ZeRO 3, each with 8 experts, top-2 and the aux loss on, with
``"expert_parallel": {"enabled": true, "autoep_size": 2}``, saves after 2 steps, records DeepSpeed's fp32 masters and
Adam moments at the save (under the model's names, its fused expert tensors whole) and trains 2 more steps; that
script's docstring says the one run-time patch it makes to run AutoEP with transformers 5.24 (a registry ``get``
without a default) and why. hf_zero then, with ``engine.load_checkpoint`` of DeepSpeed's folder:

- at the same layout (4 ranks, EP 2, the same stage), at another EP degree (EP 4), without EP, and at world size 2
  (EP 2 and no EP; twice the accumulation, so a step averages the same micro-batches), at the other ZeRO stage too
  (2 and 3, :data:`LOADS`): every weight
  and both Adam moments of every parameter, gathered whole, equal DeepSpeed's at the save exactly (a copy of fp32
  values: an expert block put in another EP rank's place, the gate and up halves swapped, or a moment read from the
  wrong ZeRO partition is off by far more), and the 2 steps after it give DeepSpeed's losses of the same
  micro-batches within 1e-5 (the second step's loss follows the first update, so Adam's moments and step count
  count too; in bf16 within 2e-3 relative, each run rounding its own bf16 arithmetic);
- ``hf-zero consolidate`` of DeepSpeed's folder writes safetensors that ``from_pretrained`` loads to DeepSpeed's
  weights, whose loss on a fixed batch, computed by the model's own forward in one process, is the one DeepSpeed's
  engine computed with AutoEP's layers: the layout of the fused tensors is checked apart from how the oracle wrote it;
  ``hf_zero.utils.zero_to_fp32`` reads the same folder to the same weights;
- ``hf-zero convert-deepspeed`` writes an EP block the way hf_zero's own EP checkpoints store it (``name@ep1of2``,
  its global expert range in the parameter table);
- what it cannot map is refused in one sentence (on every rank for a load): experts placed other than in contiguous
  blocks, the model's names renamed by the section's pattern keys, DeepSpeed's own MoE layers' files.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import ds_oracle_autoep as oracle
from tests.distributed import spawn

TOL = 1e-5
# case -> the layouts it is loaded into: (world size, EP degree, ZeRO stage); the first is the layout that saved it
LOADS = {
    "mixtral_z2": [(4, 2, 2), (4, 4, 3), (2, 1, 2)],
    "mixtral_z3": [(4, 2, 3), (4, 1, 2), (2, 2, 3)],
    "qwen3_moe_z2": [(4, 2, 2), (2, 1, 3)],
    "qwen2_moe_z3": [(4, 2, 3), (2, 1, 2)],
    "mixtral_z1_bf16": [(4, 2, 1), (2, 1, 3)],
}
KIND = {c["name"]: c["kind"] for c in oracle.CASES}
DTYPE = {c["name"]: c.get("dtype", "fp32") for c in oracle.CASES}


@pytest.fixture(scope="module")
def ds_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    return oracle.oracle_output(tmp_path_factory)


# --------------------------------------------------------------------------- hf_zero side (spawned)


def _engine(kind: str, stage: int, ep: int, world: int, dtype: str = "fp32"):  # noqa: ANN202
    import hf_zero

    cfg: dict = {"train_micro_batch_size_per_gpu": oracle.MICRO, "gradient_accumulation_steps": oracle.MICROS // world,
                 "steps_per_print": 10_000, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_zero.initialize(model=oracle.make_model(kind), config=cfg,
                                  optimizer=lambda g: torch.optim.AdamW(g, lr=oracle.LR, eps=oracle.EPS, weight_decay=0.0))[0]


def _whole(engine, what: str | None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every parameter's fp32 master (``what`` None) or Adam moment, whole (an EP rank's experts gathered)."""
    from hf_zero.expert.slices import gather_whole, slice_of
    from hf_zero.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for n, p in engine.module.named_parameters():
        t = safe_get_full_fp32_param(p) if what is None else safe_get_full_optimizer_state(p, what)
        s = slice_of(p)
        out[n] = (gather_whole(t, s) if s is not None else t).float().clone()
    return out


def _steps(engine, rank: int, world: int) -> list[list[float]]:  # noqa: ANN001
    """The ``AFTER`` steps after the save; every global micro-batch's loss of each, in DeepSpeed's order."""
    import torch.distributed as dist

    gas = oracle.MICROS // world
    out = []
    for t in range(oracle.SAVE_AT, oracle.SAVE_AT + oracle.AFTER):
        mine = torch.zeros(oracle.MICROS, dtype=torch.float64)
        for g in range(gas):
            ids = oracle.micro_batch(t, rank * gas + g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            mine[rank * gas + g] = loss.item()
        dist.all_reduce(mine)
        out.append(mine.tolist())
    return out


def _load_all(rank: int, world: int, out: str, loads: list[tuple[str, int, int]]) -> dict:
    results: dict = {}
    for name, ep, stage in loads:
        res, folder = oracle.result(out, name), os.path.join(out, name)
        engine = _engine(KIND[name], stage, ep, world, DTYPE[name])
        path, client = engine.load_checkpoint(res["save_dir"])
        got: dict = {"path": path, "client": client, "steps": engine.global_steps}
        for what in ("weights", "exp_avg", "exp_avg_sq"):
            want = load_file(os.path.join(folder, f"at_save-{what}.safetensors"))
            mine = _whole(engine, None if what == "weights" else what)
            got[what] = {"names": sorted(set(mine) ^ set(want)),
                         "max": max((mine[k] - want[k]).abs().max().item() for k in want if k in mine)}
        got["losses"] = _steps(engine, rank, world)
        engine.destroy()
        results[f"{name}@{world}x{ep}z{stage}"] = got
    return results


def _refused(rank: int, world: int, folder: str) -> str:
    engine = _engine("mixtral", 2, 2, world)
    try:
        engine.load_checkpoint(folder)
        return "loaded"
    except Exception as e:  # noqa: BLE001 - the sentence is the result
        return f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module")
def loaded(ds_out: str) -> dict[int, list[dict]]:
    by_world: dict[int, list[tuple[str, int, int]]] = {}
    for name, layouts in LOADS.items():
        for world, ep, stage in layouts:
            by_world.setdefault(world, []).append((name, ep, stage))
    return {world: spawn(_load_all, world, ds_out, loads) for world, loads in by_world.items()}


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,world,ep,stage", [(n, *lay) for n, lays in LOADS.items() for lay in lays])
def test_load_equals_deepspeeds_state_and_continues_as_it_did(loaded: dict, ds_out: str, name: str, world: int,
                                                               ep: int, stage: int) -> None:
    ref = oracle.result(ds_out, name)
    theirs = ref["losses"][oracle.SAVE_AT :]
    for rank, res in enumerate(loaded[world]):
        got = res[f"{name}@{world}x{ep}z{stage}"]
        assert got["steps"] == oracle.SAVE_AT and got["client"] == {} and got["path"].endswith(ref["tag"]), got
        for what in ("weights", "exp_avg", "exp_avg_sq"):  # the model's names, DeepSpeed's values as they were saved
            assert got[what]["names"] == [] and got[what]["max"] == 0.0, (rank, what, got[what])
        # bf16: the same fp32 masters, but each run rounds its own bf16 arithmetic (DeepSpeed's AutoEP layer, the
        # model's): relative 2e-3, as tests/test_deepspeed_checkpoints.py allows DeepSpeed's bf16 runs
        worst = max(abs(a - b) / (1.0 if DTYPE[name] == "fp32" else abs(b))
                    for mine, want in zip(got["losses"], theirs) for a, b in zip(mine, want))
        assert worst < (TOL if DTYPE[name] == "fp32" else 2e-3), (rank, worst, got["losses"], theirs)


@pytest.mark.parametrize("name", [n for n in LOADS if DTYPE[n] == "fp32"])  # the fixed batch's loss in fp32
def test_consolidate_writes_the_models_own_weights(ds_out: str, tmp_path: Path, name: str) -> None:
    """``hf-zero consolidate`` of DeepSpeed's folder: ``from_pretrained`` gives DeepSpeed's weights, and the model's own
    forward gives the fixed batch's loss DeepSpeed's AutoEP engine gave (so gate and up, and the blocks, are where the
    model reads them); ``hf_zero.utils.zero_to_fp32`` reads the same weights."""
    import transformers

    from hf_zero.launch import cli
    from hf_zero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ref = oracle.result(ds_out, name)
    want = load_file(os.path.join(ds_out, name, "at_save-weights.safetensors"))
    assert cli.main(["consolidate", ref["save_dir"], str(tmp_path / "hf")]) == 0  # config.json: the one beside it
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    mine = model.state_dict()
    assert set(mine) == set(want)
    for n, t in want.items():
        assert torch.equal(mine[n], t), n
    assert mine["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8
    with torch.no_grad():
        ids = oracle.fixed_batch()
        assert float(model(input_ids=ids, labels=ids).loss) == pytest.approx(ref["fixed_loss"], abs=TOL)
    state = get_fp32_state_dict_from_zero_checkpoint(ref["save_dir"])
    assert set(state) == set(want) and all(torch.equal(state[n], t) for n, t in want.items())


def test_convert_stores_ep_blocks_as_hf_zero_does(ds_out: str, tmp_path: Path) -> None:
    from hf_zero.checkpoint.consolidated import read_state_dict
    from hf_zero.launch import cli

    ref = oracle.result(ds_out, "mixtral_z3")
    assert cli.main(["convert-deepspeed", ref["save_dir"], str(tmp_path / "hz")]) == 0
    meta = json.loads((tmp_path / "hz" / ref["tag"] / "checkpoint.json").read_text())
    entry = meta["params"]["model.layers.1.mlp.experts.gate_up_proj@ep1of2"]
    assert entry["shape"] == [4, 48, 32] and entry["ep"] == {"dim": 0, "size": 2, "full_shape": [8, 48, 32],
                                                             "experts": [4, 8]}
    assert "model.layers.1.mlp.gate.weight" in meta["params"] and not any(".router." in n for n in meta["params"])
    assert len(meta["optimizer"]["param_groups"]) == 1  # DeepSpeed's expert param group folded back into its own
    want = load_file(os.path.join(ds_out, "mixtral_z3", "at_save-weights.safetensors"))
    got = read_state_dict(str(tmp_path / "hz"))
    assert all(torch.equal(got[n], t) for n, t in want.items())


def _tampered(src: str, dst: Path, edit) -> str:  # noqa: ANN001
    """A copy of DeepSpeed's folder whose model-states file went through ``edit`` (a dict -> None)."""
    from hf_zero.checkpoint.deepspeed_read import load_pickle

    shutil.copytree(src, dst)
    path = dst / "mp_rank_00_model_states.pt"
    m0 = dict(load_pickle(str(path)))  # memory-mapped: written beside it, then renamed over it
    edit(m0)
    torch.save(m0, dst / "edited.pt")
    os.replace(dst / "edited.pt", path)
    return str(dst)


def test_what_cannot_be_mapped_is_refused(ds_out: str, tmp_path: Path) -> None:
    from hf_zero.checkpoint import deepspeed as ds_checkpoint

    ref = oracle.result(ds_out, "mixtral_z2")
    src = os.path.join(ref["save_dir"], ref["tag"])

    def shuffled(m0: dict) -> None:
        layers = [dict(e) for e in m0["ds_autoep_layers"]]
        placement = dict(layers[0]["expert_placement"])
        placement["ranks"] = [{"rank": 0, "experts": [0, 2, 4, 6]}, {"rank": 1, "experts": [1, 3, 5, 7]}]
        layers[0]["expert_placement"] = placement
        m0["ds_autoep_layers"] = layers

    def renamed(m0: dict) -> None:
        m0["ds_config"] = {**m0["ds_config"], "expert_parallel": {**m0["ds_config"]["expert_parallel"],
                                                                  "expert_w1": "w_in"}}

    def classic(m0: dict) -> None:
        m0["ds_autoep_layers"] = None

    placed = _tampered(src, tmp_path / "placed" / ref["tag"], shuffled)
    for msg in spawn(_refused, 2, placed):
        assert msg.startswith("DeepSpeedCheckpointError: ") and "is a DeepSpeed AutoEP checkpoint that hf_zero cannot " \
            "map: its AutoEP layer 'model.layers.0.mlp' places the experts other than in contiguous equal blocks" in msg, msg
    for edit, match in ((renamed, "its expert_parallel section sets expert_w1, which renames"),
                        (classic, "of DeepSpeed's own MoE layers")):
        folder = _tampered(src, tmp_path / edit.__name__ / ref["tag"], edit)
        with pytest.raises(ds_checkpoint.DeepSpeedCheckpointError, match=match):
            ds_checkpoint.convert(folder, str(tmp_path / "out"), progress=False)
        assert not (tmp_path / "out" / ref["tag"]).exists()
