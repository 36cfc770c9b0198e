"""``hf_zero.Trainer`` / ``TrainingArguments(zero_config=...)`` on 2 CPU processes: the same losses as
transformers' Trainer without it (fp32, rel. 1e-4), a resumed run that matches an uninterrupted
one, and ``save_model`` output that loads with ``from_pretrained``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distributed import spawn

SEQ, VOCAB = 8, 64


def _model():  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def _data():  # noqa: ANN202
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _run(rank: int, world: int, cases: list) -> list:
    import hf_zero

    out = []
    for case in cases:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        kw = dict(
            output_dir=case["dir"], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
            learning_rate=5e-3, max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, seed=0,
            save_strategy="steps" if case.get("save") else "no", save_steps=3, lr_scheduler_type="linear",
            warmup_steps=2, disable_tqdm=True,
        )
        if case.get("zero") is not None:
            kw["zero_config"] = case["zero"]
        if case.get("best"):
            kw.update(eval_strategy="steps", eval_steps=3, save_strategy="steps", load_best_model_at_end=True,
                      metric_for_best_model="loss", greater_is_better=True)  # "best" = the earlier checkpoint
        args = hf_zero.TrainingArguments(**kw)
        trainer = hf_zero.Trainer(model=_model(), args=args, train_dataset=_data(), eval_dataset=_data().select(range(8)))
        trainer.train(resume_from_checkpoint=case.get("resume"))
        extra = {}
        if case.get("best"):
            extra["best"] = trainer.state.best_model_checkpoint
            extra["predict_shape"] = list(trainer.predict(_data().select(range(6))).predictions.shape)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        saved = None
        if case.get("save_model"):
            trainer.save_model(os.path.join(case["dir"], "final"))
            saved = os.path.join(case["dir"], "final")
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        out.append({**extra, "losses": losses, "saved": saved,
                    "weights": {k: v.float().reshape(-1).tolist() for k, v in state.items()}})
    return out


def test_trainer_with_zero_config_matches_plain_trainer(tmp_path: Path) -> None:
    zero = lambda stage: {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40},  # noqa: E731
                          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
    cases = [{"dir": str(tmp_path / "plain")}]
    cases += [{"dir": str(tmp_path / f"z{s}"), "zero": zero(s), "save_model": s == 3} for s in (0, 2, 3)]
    cases += [{"dir": str(tmp_path / "zs"), "zero": zero(2), "save": True}]
    cases += [{"dir": str(tmp_path / "best"), "zero": zero(3), "best": True}]
    results = spawn(_run, 2, cases)[0]
    best = results.pop()
    resumed = spawn(_run, 2, [{"dir": str(tmp_path / "zs"), "zero": zero(2), "resume": str(tmp_path / "zs" / "checkpoint-3")}])[0][0]
    for r in [*results, resumed]:
        r["losses"] = {int(k): v for k, v in r["losses"].items()}  # JSON made the steps strings
    ref = results[0]
    assert sorted(ref["losses"]) == [1, 2, 3, 4, 5, 6]
    for got in results[1:]:
        for step, loss in ref["losses"].items():
            assert abs(got["losses"][step] - loss) / loss < 1e-4, (step, got["losses"], ref["losses"])
        for n, w in ref["weights"].items():
            a, b = torch.tensor(got["weights"][n]), torch.tensor(w)
            assert float((a - b).norm() / b.norm()) < 1e-4, n
    uninterrupted = results[-1]
    assert sorted(resumed["losses"]) == [1, 2, 3, 4, 5, 6]  # 1-3 come back with the trainer state
    for step in (4, 5, 6):
        assert resumed["losses"][step] == uninterrupted["losses"][step], (resumed["losses"], uninterrupted["losses"])
    from transformers import AutoModelForCausalLM

    z3 = results[3]
    loaded = AutoModelForCausalLM.from_pretrained(z3["saved"])
    for n, p in loaded.named_parameters():
        assert p.detach().reshape(-1).tolist() == z3["weights"][n], n

    # load_best_model_at_end under stage 3: the engine holds exactly the best checkpoint's weights
    from safetensors.torch import load_file

    assert best["best"] is not None and best["best"].endswith("checkpoint-3"), best["best"]
    saved_best = load_file(os.path.join(best["best"], "model.safetensors"))
    for n, w in best["weights"].items():
        if n in saved_best:
            assert saved_best[n].float().reshape(-1).tolist() == w, n
    assert best["predict_shape"] == [6, SEQ, VOCAB]


def _generate(rank: int, world: int, cases: list, out_dir: str) -> list:
    import hf_zero

    out = []
    for zero in cases:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        kw = dict(output_dir=out_dir, per_device_eval_batch_size=2, report_to="none", use_cpu=True,
                  predict_with_generate=True, generation_max_length=SEQ + 4, disable_tqdm=True)
        if zero is not None:
            kw["zero_config"] = zero
        args = hf_zero.Seq2SeqTrainingArguments(**kw)
        model = _model()
        model.generation_config.pad_token_id = model.config.pad_token_id = 0
        trainer = hf_zero.Seq2SeqTrainer(model=model, args=args, train_dataset=_data())
        trainer.args.max_steps = 1  # one training step builds the engine (and shards the model) first
        trainer.train()
        pred = trainer.predict(_data().select(range(4)), max_new_tokens=3 + rank)
        out.append(pred.predictions.tolist())
    return out


def test_seq2seq_trainer_generates_under_stage3(tmp_path: Path) -> None:
    zero = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    results = spawn(_generate, 2, [None, zero], str(tmp_path))
    for plain, sharded in results:
        assert plain == sharded


def _nan_run(rank: int, world: int, cases: list) -> list:
    """A loss made NaN at one step; counts the host-side ``torch.isnan`` tests of a 0-dim loss during ``train()``."""
    import transformers

    import hf_zero

    out = []
    for case in cases:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        base = hf_zero.Trainer if case.get("zero") else transformers.Trainer
        arg_cls = hf_zero.TrainingArguments if case.get("zero") else transformers.TrainingArguments

        class NanAt(base):  # type: ignore[misc, valid-type]
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                return loss * float("nan") if self.state.global_step == 1 else loss

        kw = dict(output_dir=case["dir"], per_device_train_batch_size=2, max_steps=4, learning_rate=5e-3,
                  logging_steps=2, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
        if case.get("zero"):
            kw["zero_config"] = case["zero"]
        args = arg_cls(**kw)
        trainer = NanAt(model=_model(), args=args, train_dataset=_data())
        calls = []
        real = torch.isnan

        def counting(t, *a, calls=calls, real=real, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            if isinstance(t, torch.Tensor) and t.dim() == 0:
                calls.append(1)
            return real(t, *a, **k)

        torch.isnan = counting
        try:
            trainer.train()
        finally:
            torch.isnan = real
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        out.append({"losses": losses, "host_tests": len(calls), "flag_after": trainer.args.logging_nan_inf_filter})
    return out


def test_nan_loss_filter_runs_on_the_device(tmp_path: Path) -> None:
    """transformers' ``logging_nan_inf_filter`` tests each micro-step's loss on the host (a device sync per
    micro-step); hf_zero's Trainer applies the same rule on the device: the logged loss of a window with a
    NaN step is the plain Trainer's, the loop made no host test, and the user's flag is back after train()."""
    zero = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "nonfinite_loss": "skip"}
    plain, z2 = spawn(_nan_run, 2, [{"dir": str(tmp_path / "p")}, {"dir": str(tmp_path / "z"), "zero": zero}])[0]
    assert plain["host_tests"] >= 4 and z2["host_tests"] == 0, (plain["host_tests"], z2["host_tests"])
    step2 = {int(k): v for k, v in plain["losses"].items()}[2]
    got = {int(k): v for k, v in z2["losses"].items()}
    assert abs(got[2] - step2) / step2 < 1e-5 and all(v == v for v in got.values()), (got, plain["losses"])
    assert z2["flag_after"] is True
