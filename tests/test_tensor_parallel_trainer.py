"""Tensor parallelism through ``hf_zero.Trainer``, against transformers' own Trainer doing the same work.

On 2 gloo ranks, a Llama (untied embeddings) and a Qwen2 (biased q/k/v projections) with
``"tensor_parallel": {"autotp_size": 2}`` and ZeRO-2: one data-parallel replica, so each step
takes 2 samples. The oracle is the plain Trainer under DDP on the same 2 ranks with one sample
per rank, the same 2 samples per step. Train (with checkpoints), evaluate, train again resuming
from a checkpoint, predict and ``save_model``: every logged loss, eval loss and prediction as the
plain Trainer's (fp32, rel. 1e-5), predictions counted once per sample (not once per rank), and
the saved folder loads with ``from_pretrained`` to the whole weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distributed import spawn
from tests.models import tiny_causal_lm

SEQ, VOCAB = 8, 32


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _model(kind: str):  # noqa: ANN202
    return tiny_causal_lm(kind, vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


def _life(case: dict) -> dict:
    import transformers
    from datasets import Dataset

    import hf_zero

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (24, SEQ), generator=g).tolist()
    train, held = Dataset.from_dict({"input_ids": ids, "labels": ids}), Dataset.from_dict({"input_ids": ids[:6], "labels": ids[:6]})
    base = dict(output_dir=case["dir"], report_to="none", disable_tqdm=True, seed=0, logging_steps=1, learning_rate=5e-3,
                max_steps=4, save_strategy="steps", save_steps=2, lr_scheduler_type="constant", max_grad_norm=0.5)
    if case["tp"]:
        zero = {"zero_optimization": {"stage": case["stage"]}, "tensor_parallel": {"autotp_size": 2}, "gradient_clipping": "auto",
                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
        args = hf_zero.TrainingArguments(**base, per_device_train_batch_size=2, per_device_eval_batch_size=2, zero_config=zero)
        cls = hf_zero.Trainer
    else:
        args = transformers.TrainingArguments(**base, per_device_train_batch_size=1, per_device_eval_batch_size=1, use_cpu=True)
        cls = transformers.Trainer
    trainer = cls(model=_model(case["model"]), args=args, train_dataset=train, eval_dataset=held)
    out: dict = {}
    trainer.train()
    out["eval1"] = trainer.evaluate()["eval_loss"]
    trainer.args.max_steps = 6
    trainer.train(resume_from_checkpoint=True)  # checkpoint-4: steps 5 and 6
    out["losses"] = {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
    out["eval2"] = trainer.evaluate()["eval_loss"]
    pred = trainer.predict(held).predictions
    out["pred_shape"] = list(pred.shape)
    out["predict"] = pred.reshape(-1)[::5].tolist()
    final = os.path.join(case["dir"], "final")
    trainer.save_model(final)
    weights = {k: v.float() for k, v in trainer.accelerator.get_state_dict(trainer.model_wrapped).items()}
    if trainer.args.should_save:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
        out["reload_diff"] = max(float((loaded[k].float() - w).abs().max()) for k, w in weights.items())
        out["shapes"] = {k: list(w.shape) for k, w in weights.items() if "q_proj.weight" in k}
    out["checkpoints"] = sorted(p for p in os.listdir(case["dir"]) if p.startswith("checkpoint-"))
    return out


def _run(rank: int, world: int, cases: list) -> list:
    out = []
    for case in cases:
        _reset()
        out.append(_life(case))
    return out


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-6)


def test_tp2_trainer_life_equals_the_plain_trainer(tmp_path: Path) -> None:
    # the Llama at tp 2 x ZeRO-2, the Qwen2 at tp 2 x ZeRO-3 (its slices sharded too)
    cases = [{"model": m, "tp": tp, "stage": 2 if m == "llama" else 3, "dir": str(tmp_path / f"{m}_{tp}")}
             for m in ("llama", "qwen2") for tp in (False, True)]
    per_rank = spawn(_run, 2, cases)
    for rank, results in enumerate(per_rank):
        for plain, tp in (results[0:2], results[2:4]):
            assert plain["losses"].keys() == tp["losses"].keys() and len(plain["losses"]) == 6, (plain, tp)
            assert all(_close(tp["losses"][k], v) for k, v in plain["losses"].items()), (plain["losses"], tp["losses"])
            assert _close(tp["eval1"], plain["eval1"]) and _close(tp["eval2"], plain["eval2"]), (plain, tp)
            assert tp["pred_shape"] == plain["pred_shape"] == [6, SEQ, VOCAB], (plain["pred_shape"], tp["pred_shape"])
            assert max(abs(a - b) for a, b in zip(tp["predict"], plain["predict"])) < 1e-4
            assert tp["checkpoints"] == plain["checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], tp
            if rank == 0:
                assert tp["reload_diff"] == 0.0, tp
                assert all(s == [16, 16] for s in tp["shapes"].values()), tp["shapes"]  # whole again in the folder
