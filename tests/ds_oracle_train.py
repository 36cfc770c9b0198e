"""DeepSpeed's side of the migration and parity tests, run with DeepSpeed's own interpreter.

    python -m torch.distributed.run --nproc-per-node 2 tests/ds_oracle_train.py OUT_DIR CASES_JSON

(``tests/dsenv.py:run_torchrun`` starts it; CPU processes over gloo.) For each case it trains a small
GPT-2 with tied embeddings and a frozen position embedding through ``deepspeed.initialize``, saves a
checkpoint after ``steps_before_save`` optimizer steps, evaluates a fixed batch, trains
``micro_after`` more micro-steps, saves again, and writes what the hf_zero side compares against:
``OUT_DIR/<case>/result.json`` (every rank's loss at every micro-step, the fixed batch's loss) and,
for ZeRO stages 1-3, ``zero_to_fp32``'s consolidation of both checkpoints as safetensors (the tied
head is cloned so safetensors can hold it). Nothing comes back as a pickle.

The model and data builders (:func:`make_model`, :func:`micro_batch`, :func:`fixed_batch`) import
only torch and transformers, so the hf_zero tests import them from here and train the same thing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

VOCAB = 37
SEQ = 6
MICRO = 2

# Every DeepSpeed run the tests compare against, made by one torchrun of this script (about a minute
# on two cores): ZeRO 1-3 in fp32 and bf16, ZeRO 0 in fp32 and bf16 (DeepSpeed's fp16/bf16 wrapper
# without ZeRO), ZeRO 1 in bf16 with fp32 gradient accumulation (its BF16_Optimizer), ZeRO 2 in
# fp16 (dynamic loss scaling), and a transformers Trainer at ZeRO 3.
CASES = [
    *({"name": f"z{s}_{d}", "stage": s, "dtype": d, "steps_before_save": 2, "micro_after": 6}
      for d in ("fp32", "bf16") for s in (1, 2, 3)),
    {"name": "z0_fp32", "stage": 0, "dtype": "fp32", "steps_before_save": 2, "micro_after": 6},
    {"name": "z0_bf16", "stage": 0, "dtype": "bf16", "steps_before_save": 2, "micro_after": 6},
    {"name": "z1_bf16acc", "stage": 1, "dtype": "bf16_fp32acc", "steps_before_save": 2, "micro_after": 6},
    {"name": "z2_fp16", "stage": 2, "dtype": "fp16", "steps_before_save": 2, "micro_after": 6},
    {"name": "trainer_z3", "stage": 3, "trainer": True},
    # bf16 masters, gradients and Adam state (no fp32 copy), and torch_autocast over fp32 parameters
    *({"name": f"z{s}_bf16master", "stage": s, "dtype": "bf16master", "steps_before_save": 2, "micro_after": 6}
      for s in (1, 2, 3)),
    *({"name": f"z{s}_autocast", "stage": s, "dtype": "autocast", "steps_before_save": 2, "micro_after": 6}
      for s in (0, 2, 3)),
    # save_checkpoint(exclude_frozen_parameters=True), as transformers' Trainer saves PEFT models: no frozen values
    *({"name": f"z{s}_exclfrozen", "stage": s, "dtype": "fp32", "steps_before_save": 2, "micro_after": 6,
       "exclude_frozen": True} for s in (2, 3)),
]
_RUN: dict[str, Any] = {}


def oracle_output(tmp_path_factory: Any) -> str:
    """Test side: run every case under DeepSpeed once per pytest session; the folder holding the results.

    Skips (through ``tests/dsenv.py``) where DeepSpeed cannot be installed.
    """
    if "error" in _RUN:
        raise AssertionError(_RUN["error"])
    if "out" not in _RUN:
        from pathlib import Path

        from tests import dsenv

        out = tmp_path_factory.mktemp("deepspeed_oracle")
        (out / "cases.json").write_text(json.dumps(CASES))
        try:
            dsenv.run_torchrun(Path(__file__), 2, str(out), str(out / "cases.json"), timeout=1200)
        except AssertionError as e:
            _RUN["error"] = str(e)
            raise
        _RUN["out"] = str(out)
    return _RUN["out"]


def result(out: str, name: str) -> dict:
    """One case's ``result.json``."""
    with open(os.path.join(out, name, "result.json")) as f:
        return json.load(f)


def make_model(seed: int = 0, n_layer: int = 2) -> Any:
    """A 2-layer GPT-2 with tied input/output embeddings and a frozen ``wpe``.

    Odd sizes on purpose (width 9, vocabulary 37): parameters of odd length make ZeRO 3 pad
    their last slice, and the trainable total (2529) makes ZeRO 1-2 pad their last partition.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=9, n_layer=n_layer, n_head=3, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(cfg)
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def param_groups(model: Any) -> list[dict]:
    """Two groups, as transformers' Trainer builds them: weight decay for matrices, none for the rest."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def micro_batch(t: int, world: int, rank: int, micro: int = MICRO) -> torch.Tensor:
    """Micro-step ``t``'s input ids for ``rank``: its rows of one global batch drawn from seed ``1000 + t``."""
    g = torch.Generator().manual_seed(1000 + t)
    ids = torch.randint(0, VOCAB, (world * micro, SEQ), generator=g)
    return ids[rank * micro : (rank + 1) * micro]


def fixed_batch() -> torch.Tensor:
    """The batch whose loss is compared after a checkpoint is loaded (the same on every rank)."""
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(7))


def ds_config(stage: int, dtype: str, gas: int = 2, clip: float = 1.0) -> dict:
    """The DeepSpeed config of one case; hf_zero reads the same JSON."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if dtype in ("bf16", "bf16_fp32acc"):
        cfg["bf16"] = {"enabled": True}
    elif dtype == "bf16master":
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    elif dtype == "autocast":
        # lower_precision_safe_modules []: DeepSpeed then reduces every gradient in fp32, as hf_zero does (docs/precision.md,
        # Autocast). With its default list it reduces nn.Linear gradients in bf16 (here the LM head tied to
        # wte), arithmetic hf_zero does not do, and the two runs drift apart by an amount that depends on which
        # bf16 roundings the CPU's kernels flip (3e-5 relative in the losses here); with [] they are equal.
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.bfloat16", "lower_precision_safe_modules": []}
    if dtype == "bf16_fp32acc":  # ZeRO 1 then runs DeepSpeed's BF16_Optimizer, another checkpoint layout
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _losses(engine: Any, start: int, count: int, world: int, rank: int) -> list[list[float]]:
    """Train ``count`` micro-steps from micro-step ``start``; every rank's loss at each."""
    import torch.distributed as dist

    out = []
    for t in range(start, start + count):
        ids = micro_batch(t, world, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        both = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(both, loss.detach().float().reshape(()))
        out.append([float(x) for x in both])
    return out


def _consolidate(save_dir: str, tag: str, path: str) -> None:
    """zero_to_fp32's full fp32 state dict of one checkpoint, as safetensors."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
    save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, path)


def run_case(case: dict, out_dir: str, world: int, rank: int) -> None:
    import deepspeed
    import torch.distributed as dist

    here = os.path.join(out_dir, case["name"])
    save_dir = os.path.join(here, "ckpt")
    os.makedirs(save_dir, exist_ok=True)
    cfg = ds_config(case["stage"], case["dtype"], case.get("gas", 2), case.get("clip", 1.0))
    model = make_model()
    if case["dtype"] == "fp16":
        # DeepSpeed's CPU accelerator refuses fp16 (it asks oneDNN for AVX512-FP16 kernels); torch runs
        # fp16 on any CPU, so the check is lifted here to produce a genuine fp16 checkpoint.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    gas = cfg["gradient_accumulation_steps"]
    before = case["steps_before_save"] * gas
    result: dict[str, Any] = {"losses": _losses(engine, 0, before, world, rank)}
    excl = bool(case.get("exclude_frozen"))
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "note": "from deepspeed"}, exclude_frozen_parameters=excl)
    tag_a = f"global_step{engine.global_steps}"
    engine.eval()
    with torch.no_grad():
        ids = fixed_batch()
        result["fixed_loss"] = float(engine(input_ids=ids, labels=ids).loss.float())
    engine.train()
    result["losses"] += _losses(engine, before, case["micro_after"], world, rank)
    engine.save_checkpoint(save_dir, exclude_frozen_parameters=excl)
    tag_b = f"global_step{engine.global_steps}"
    result.update(tags=[tag_a, tag_b], save_dir=save_dir, skipped_steps=engine.skipped_steps)
    if engine.zero_optimization_stage() == 3:
        engine.empty_partition_cache()
    dist.barrier()
    if rank == 0:
        if case["stage"] >= 1:
            for tag in (tag_a, tag_b):
                try:
                    _consolidate(save_dir, tag, os.path.join(here, f"zero_to_fp32_{tag}.safetensors"))
                except ValueError as e:  # zero_to_fp32 does not read BF16_Optimizer's files ("not a zero checkpoint")
                    result["zero_to_fp32_error"] = str(e)
        with open(os.path.join(here, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def trainer_dataset(n: int = 16) -> list[dict]:
    """Rows for the Trainer runs (the same on every rank; the Trainer shards and shuffles them)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def trainer_args(output_dir: str, stage: int, **extra: Any) -> dict:
    """TrainingArguments (as a dict) and the ZeRO config for the Trainer runs, DeepSpeed's and hf_zero's alike."""
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    return dict(output_dir=output_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=2, max_steps=4,
                save_strategy="steps", save_steps=2, logging_steps=1, learning_rate=1e-2, weight_decay=0.01,
                max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=1, report_to=[], seed=0, use_cpu=True,
                config=config, **extra)


def run_trainer_case(case: dict, out_dir: str, world: int, rank: int) -> None:
    """transformers' Trainer under DeepSpeed: checkpoints at steps 2 and 4, every logged loss."""
    from transformers import Trainer, TrainingArguments

    here = os.path.join(out_dir, case["name"])
    kwargs = trainer_args(os.path.join(here, "trainer"), case["stage"])
    config = kwargs.pop("config")
    trainer = Trainer(model=make_model(), args=TrainingArguments(**kwargs, deepspeed=config), train_dataset=trainer_dataset())
    trainer.train()
    if rank == 0:
        with open(os.path.join(here, "result.json"), "w") as f:
            json.dump({"log": [e for e in trainer.state.log_history if "loss" in e]}, f)
        _consolidate(os.path.join(here, "trainer", "checkpoint-4"), "global_step4",
                     os.path.join(here, "zero_to_fp32_checkpoint-4.safetensors"))


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    out_dir, cases_json = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    with open(cases_json) as f:
        cases = json.load(f)
    for case in cases:
        (run_trainer_case if case.get("trainer") else run_case)(case, out_dir, world, rank)
    dist.barrier()
    # every rank wrote its results and passed the barrier: leave without gloo's C++ teardown (tests/distributed.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
