"""A standing parity test against DeepSpeed 0.19.8 itself, on the CPU.

The same tied GPT-2 (frozen position embedding, two AdamW param groups), the same DeepSpeed
config (gradient accumulation 2, clipping at 1.0, WarmupLR) and the same per-rank micro-batches
on 2 gloo ranks: hf_zero's losses at ZeRO stages 0-3 in fp32 equal DeepSpeed's at every one of
10 micro-steps, bit for bit (the assertion allows rel. 1e-6 so that a harmless change of summation
order in either library reads as what it is; the test prints the largest difference). bf16 and
fp16 are compared too, to the precision those formats give, and so are bf16 masters (masters,
gradients and Adam state in bf16: ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``) and
``torch_autocast`` over fp32 parameters, both to fp32's bound: they do the same arithmetic (autocast with
``lower_precision_safe_modules: []``, see ``ds_oracle_train.ds_config``). DeepSpeed's runs come from
``tests/ds_oracle_train.py`` (shared with ``tests/test_deepspeed_checkpoints.py`` in one session).
"""

from __future__ import annotations

import pytest

from tests import ds_oracle_train as oracle
from tests.distributed import spawn

MICRO_STEPS = 10
CASES = [("z0_fp32", 0, "fp32"), ("z1_fp32", 1, "fp32"), ("z2_fp32", 2, "fp32"), ("z3_fp32", 3, "fp32"),
         ("z1_bf16", 1, "bf16"), ("z3_bf16", 3, "bf16"), ("z2_fp16", 2, "fp16"),
         *((f"z{s}_bf16master", s, "bf16master") for s in (1, 2, 3)),
         *((f"z{s}_autocast", s, "autocast") for s in (0, 2, 3))]


def _train(rank: int, world: int, cases: list) -> dict:
    import hf_zero

    out = {}
    for name, stage, dtype in cases:
        model = oracle.make_model()
        engine, *_ = hf_zero.initialize(model=model, model_parameters=oracle.param_groups(model),
                                        config=oracle.ds_config(stage, dtype))
        losses = []
        for t in range(MICRO_STEPS):
            ids = oracle.micro_batch(t, world, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
        out[name] = {"losses": losses, "skipped": engine.skipped_steps}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    out = oracle.oracle_output(tmp_path_factory)
    return out, spawn(_train, 2, CASES)


@pytest.mark.parametrize("name,stage,dtype", CASES)
def test_losses_equal_deepspeeds(runs: tuple[str, list], name: str, stage: int, dtype: str) -> None:
    out, results = runs
    theirs = oracle.result(out, name)
    assert len(theirs["losses"]) == MICRO_STEPS and theirs["skipped_steps"] == 0
    worst = 0.0
    for rank in (0, 1):
        mine = results[rank][name]
        assert mine["skipped"] == 0
        for t in range(MICRO_STEPS):
            a, b = mine["losses"][t], theirs["losses"][t][rank]
            worst = max(worst, abs(a - b) / abs(b))
    print(f"{name}: hf_zero stage {stage} vs DeepSpeed, largest relative loss difference {worst:.3g}")
    assert worst <= {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-4, "bf16master": 1e-6, "autocast": 1e-6}[dtype]
