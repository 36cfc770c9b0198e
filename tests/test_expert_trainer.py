"""Expert parallelism through ``hf_zero.Trainer`` (and TRL's SFTTrainer and PEFT's parameter-targeted LoRA).

On 4 gloo ranks a tiny Mixtral (8 experts, top-2, ``output_router_logits`` on, so the router's aux loss is in the
loss the model returns) trains through ``hf_zero.Trainer`` with ``TrainingArguments(zero_config=...)`` holding
``"expert_parallel": {"enabled": true, "autoep_size": 2}`` at ZeRO-2, saving every 2 steps, then resumes from
``checkpoint-4`` for 2 more steps. The oracle is the same Trainer on the same ranks without the section (its
experts whole on every rank; ``tests/test_expert_parallel.py`` checks that both equal one process): every logged
loss (rel. 1e-5), and a run with ``router_aux_loss_coef`` 0 logs other losses, so the aux loss is what is logged.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from tests.distributed import spawn
from tests.test_expert_parallel import VOCAB, tiny_moe

SEQ = 8


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _life(case: dict) -> dict:
    from datasets import Dataset

    import hf_zero

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (48, SEQ), generator=g).tolist()
    train = Dataset.from_dict({"input_ids": ids, "labels": ids})
    zero: dict = {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto",
                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    if case["ep"] > 1:
        zero["expert_parallel"] = {"enabled": True, "autoep_size": case["ep"]}
    args = hf_zero.TrainingArguments(
        output_dir=case["dir"], report_to="none", disable_tqdm=True, seed=0, logging_steps=1, learning_rate=5e-3,
        max_steps=4, save_strategy="steps", save_steps=2, lr_scheduler_type="constant", max_grad_norm=0.5,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, zero_config=zero)
    model = tiny_moe("mixtral")
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = case["aux"]  # the model keeps its own copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = hf_zero.Trainer(model=model, args=args, train_dataset=train)
        trainer.train()
        trainer.args.max_steps = 6
        trainer.train(resume_from_checkpoint=True)  # checkpoint-4: steps 5 and 6
    return {"losses": {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h},
            "checkpoints": sorted(p for p in os.listdir(case["dir"]) if p.startswith("checkpoint-"))}


def _run(rank: int, world: int, cases: list) -> list:
    out = []
    for case in cases:
        _reset()
        out.append(_life(case))
    return out


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-6)


def test_trainer_with_expert_parallel_saves_and_resumes(tmp_path: Path) -> None:
    cases = [{"ep": ep, "aux": aux, "dir": str(tmp_path / f"ep{ep}_aux{aux}")} for ep, aux in ((2, 0.1), (1, 0.1), (1, 0.0))]
    for rank, (ep, plain, no_aux) in enumerate(spawn(_run, 4, cases)):
        assert ep["checkpoints"] == plain["checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], ep
        assert ep["losses"].keys() == plain["losses"].keys() and len(ep["losses"]) == 6, (rank, ep, plain)
        assert all(_close(ep["losses"][k], v) for k, v in plain["losses"].items()), (rank, ep["losses"], plain["losses"])
        # the logged loss holds the router's aux loss (at coefficient 0.1 it differs from the run without it)
        assert all(abs(plain["losses"][k] - v) > 1e-4 for k, v in no_aux["losses"].items()), (plain, no_aux)
