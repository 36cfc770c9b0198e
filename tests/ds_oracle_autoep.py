"""DeepSpeed's side of ``tests/test_deepspeed_autoep.py``: AutoEP checkpoints, made by DeepSpeed 0.19.8 on the CPU.

    python -m torch.distributed.run --nproc-per-node 4 tests/ds_oracle_autoep.py OUT_DIR

(``tests/dsenv.py:run_torchrun`` starts it; CPU processes over gloo.) For each case of :data:`CASES` it trains a tiny
transformers MoE model (8 experts, top-2, the router's aux loss in the loss) through ``deepspeed.initialize`` with
``"expert_parallel": {"enabled": true, "autoep_size": 2}`` on 4 ranks (two EP groups of 2, so every expert block is
ZeRO-partitioned over an expert-data-parallel group of 2), ``SAVE_AT`` steps, then ``engine.save_checkpoint``; then it
writes what DeepSpeed's engine holds at that moment and trains ``AFTER`` more steps:

- ``OUT_DIR/<case>/ckpt``: DeepSpeed's checkpoint folder, with the model's ``config.json`` beside its tag folder (as
  transformers' Trainer leaves it);
- ``OUT_DIR/<case>/result.json``: every global micro-batch's loss at every step, and a fixed batch's loss at the save;
- ``OUT_DIR/<case>/at_save-{weights,exp_avg,exp_avg_sq}.safetensors``: DeepSpeed's fp32 masters and Adam moments at
  the save (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, an EP rank's block gathered from its EP
  group), under the Hugging Face model's own names and layout. The layout is written here on its own, from what
  DeepSpeed's ``repack_expert_weights`` does to a fused ``gate_up_proj`` [E, 2I, H]: ``w1`` its first I rows per
  expert (the gate), ``w3`` the last I (the up projection), ``w2`` is ``down_proj``; the router ``router.gate`` is the
  block's ``gate``; the shared expert and its gate take the name the model has for them (Qwen2-MoE's
  ``shared_expert``, AutoEP's ``shared_experts``), and the names must be exactly the model's. The fixed batch's loss, which the test reproduces with ``from_pretrained`` on hf_zero's
  consolidation, checks that layout independently of it.

One patch, made at run time in this process only: transformers 5.24's ``_CanRecordRegistry.get(model)`` takes no
default, while DeepSpeed 0.19.8's AutoEP (``auto_ep_presets/base.py``, ``_install_instance_transformers_output_recorders``)
calls ``registry.get(key, default)`` with the registry's string keys when it retargets the router-logit recorder to
its own router, and fails with "TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given".
The patched ``get`` takes a string key (or a model, as transformers' own callers pass) and a default, as a dict's
does. Nothing else of DeepSpeed or transformers is changed: the all-to-all runs over gloo and the grouped GEMM on the
CPU as DeepSpeed ships them. (Reading the Adam moments at ZeRO 2 re-runs DeepSpeed's own
``_lazy_init_hp_params_optimizer_state`` once, after the save: see :func:`run_case`.)

The model and data builders import only torch and transformers, so the test imports them from here.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ as a package
from tests.models import tiny_moe  # noqa: E402

VOCAB, SEQ, MICRO = 32, 8, 2
WORLD, EP = 4, 2  # DeepSpeed's run: 4 ranks, EP groups [0, 1] and [2, 3], expert-data-parallel groups [0, 2], [1, 3]
MICROS = 4  # micro-batches per optimizer step over all ranks (DeepSpeed: one per rank)
SAVE_AT, AFTER = 2, 2  # optimizer steps before the save, and after it
LR, EPS = 5e-3, 1e-8
CASES = [
    {"name": "mixtral_z2", "kind": "mixtral", "stage": 2},
    {"name": "mixtral_z3", "kind": "mixtral", "stage": 3},
    {"name": "qwen3_moe_z2", "kind": "qwen3_moe", "stage": 2},
    {"name": "qwen2_moe_z3", "kind": "qwen2_moe", "stage": 3},  # DeepSpeed's qwen3_moe preset, which covers Qwen2-MoE
    {"name": "mixtral_z1_bf16", "kind": "mixtral", "stage": 1, "dtype": "bf16"},  # bf16 weights over fp32 masters
]


def make_model(kind: str) -> Any:
    """The tiny MoE model of the expert-parallel tests (tests/models.py), at this oracle's vocabulary and length."""
    return tiny_moe(kind, vocab=VOCAB, seq=SEQ)


def micro_batch(step: int, j: int) -> torch.Tensor:
    """The ``j``-th of the ``MICROS`` micro-batches of optimizer step ``step``."""
    ids = torch.randint(0, VOCAB, (SAVE_AT + AFTER, MICROS * MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    return ids[step, j * MICRO : (j + 1) * MICRO]


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(7))


def ds_config(stage: int, dtype: str = "fp32") -> dict:
    # No gradient clipping: DeepSpeed averages an expert group's gradient norm over its expert-data-parallel ranks
    # (stage_1_and_2.py, _average_expert_grad_norms), a norm of its own; the losses after a load compare the updates.
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICROS // WORLD,
            "steps_per_print": 10_000, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "expert_parallel": {"enabled": True, "autoep_size": EP}, **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}


def _patch_transformers_registry() -> None:
    """The one run-time patch (module docstring): ``get`` of transformers' output-recorder registry with a default."""
    from transformers.utils import output_capturing as oc

    def get(self: dict, key: Any, default: Any = None) -> Any:
        found = dict.get(self, key if isinstance(key, str) else str(key.__class__), default)
        return {} if found is None else found

    oc._CanRecordRegistry.get = get


def _step_losses(engine: Any, step: int, rank: int) -> list[float]:
    """One optimizer step; every global micro-batch's loss, in order (gathered from the ranks)."""
    import deepspeed.comm as dist

    gas = MICROS // WORLD
    mine = []
    for g in range(gas):
        ids = micro_batch(step, rank * gas + g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mine.append(float(loss.detach()))
    out = [torch.zeros(gas, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(out, torch.tensor(mine, dtype=torch.float64))
    return [float(x) for t in out for x in t]


def _whole(engine: Any, what: str | None, kind: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 masters (``what`` None) or an Adam moment, every parameter whole, in the HF model's layout."""
    import deepspeed.comm as dist
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    layers = {n: m for n, m in engine.module.named_modules() if isinstance(m, AutoEPMoELayer)}
    model_names = set(make_model(kind).state_dict())
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        t = safe_get_full_fp32_param(p) if what is None else safe_get_full_optimizer_state(p, what)
        t = t.detach().float().clone()
        prefix, _, leaf = name.rpartition(".experts.")
        if prefix in layers and leaf in ("w1", "w2", "w3"):  # this EP rank's block: gathered from its EP group
            blocks = [torch.empty_like(t) for _ in range(EP)]
            dist.all_gather(blocks, t, group=groups._get_expert_parallel_group(layers[prefix].ep_group_name))
            t = torch.cat(blocks)
        out[name] = t
    hf: dict[str, torch.Tensor] = {}
    for name, t in out.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if prefix in layers and leaf == "w1":
            hf[f"{prefix}.experts.gate_up_proj"] = torch.cat([t, out[f"{prefix}.experts.w3"]], dim=1)
        elif prefix in layers and leaf == "w2":
            hf[f"{prefix}.experts.down_proj"] = t
        elif prefix in layers and leaf == "w3":
            continue
        elif name.endswith(".router.gate.weight") and name.removesuffix(".router.gate.weight") in layers:
            hf[name.removesuffix(".router.gate.weight") + ".gate.weight"] = t
        elif ".shared_experts" in name:  # the block kept the model's shared expert (and its gate) under its own names
            prefix, _, rest = name.partition(".shared_experts")
            hf[next(n for n in (name, f"{prefix}.shared_expert{rest}") if n in model_names)] = t
        else:
            hf[name] = t
    if set(hf) != model_names:
        raise AssertionError(f"the oracle's names are not the model's: {sorted(set(hf) ^ model_names)[:4]}")
    return hf


def run_case(case: dict, out_dir: str, rank: int) -> None:
    import deepspeed
    from safetensors.torch import save_file

    model = make_model(case["kind"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(case["stage"], case.get("dtype", "fp32")))
    losses = [_step_losses(engine, t, rank) for t in range(SAVE_AT)]
    save_dir = os.path.join(out_dir, case["name"], "ckpt")
    engine.save_checkpoint(save_dir)
    if rank == 0:  # beside the checkpoint, as transformers' Trainer leaves it
        model.config.save_pretrained(save_dir)
    with torch.no_grad():
        ids = fixed_batch()
        fixed = float(engine(input_ids=ids, labels=ids).loss)
    if case["stage"] < 3:
        # ZeRO 1-2 link each parameter's view of the optimizer state after the first param group's first step, before
        # torch's Adam has made the expert group's state (DeepSpeed steps one param group at a time), so
        # safe_get_full_optimizer_state then finds no exp_avg for an expert; linked again now that it exists.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state = {what or "weights": _whole(engine, what, case["kind"]) for what in (None, "exp_avg", "exp_avg_sq")}
    losses += [_step_losses(engine, t, rank) for t in range(SAVE_AT, SAVE_AT + AFTER)]
    if rank == 0:
        for what, tensors in state.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, case["name"], f"at_save-{what}.safetensors"))
        with open(os.path.join(out_dir, case["name"], "result.json"), "w") as f:
            json.dump({"losses": losses, "fixed_loss": fixed, "save_dir": save_dir,
                       "tag": f"global_step{SAVE_AT}"}, f)
    engine.destroy()


def main() -> None:
    _patch_transformers_registry()
    import deepspeed

    out_dir = sys.argv[1]
    deepspeed.init_distributed("gloo")
    rank = int(os.environ["RANK"])
    for case in CASES:
        run_case(case, out_dir, rank)
    import deepspeed.comm as dist

    dist.barrier()
    # every rank has passed the barrier after rank 0 wrote the last case: leave without gloo's C++ teardown, which
    # aborted a rank now and then while rank 0 was still writing ("terminate called without an active exception" on a
    # clean clone's CI run; tests/distributed.py says why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- test side


_RUN: dict[str, Any] = {}


def oracle_output(tmp_path_factory: Any) -> str:
    """Test side: run every case under DeepSpeed once per pytest session; the folder holding the results."""
    if "error" in _RUN:
        raise AssertionError(_RUN["error"])
    if "out" not in _RUN:
        from pathlib import Path

        from tests import dsenv

        out = tmp_path_factory.mktemp("deepspeed_autoep")
        try:
            dsenv.run_torchrun(Path(__file__), WORLD, str(out), timeout=900)
        except AssertionError as e:
            _RUN["error"] = str(e)
            raise
        _RUN["out"] = str(out)
    return _RUN["out"]


def result(out: str, name: str) -> dict:
    with open(os.path.join(out, name, "result.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    main()
