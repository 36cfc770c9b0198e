"""The Trainer's whole life on 2 CPU ranks, against transformers' own Trainer (DDP over gloo) doing the same:

- evaluate and predict before any train (ZeRO 2 and 3), then train and evaluate, as the plain Trainer;
- a GPT-2 (decoder, tied embeddings) at ZeRO stage 3: train, evaluate, train again resuming from the
  last checkpoint, evaluate, train again from where it is, predict, ``save_model`` (it reloads with
  ``from_pretrained``); every loss, eval loss and prediction as the plain Trainer's (fp32, rel. 1e-5);
- a T5 (encoder-decoder) through ``Seq2SeqTrainer`` at stage 3 with ``predict_with_generate``: the
  same generated tokens and eval loss;
- a BERT classifier whose optimizer and schedule come from the config's sections, given as
  ``deepspeed="ds.json"`` with every value "auto": the same losses as the plain Trainer handed the
  equivalent ``torch.optim.AdamW`` over all trainable parameters (DeepSpeed's one group) and a
  ``LambdaLR`` written from DeepSpeed's WarmupDecayLR formulas;
- a misspelt key refused on every rank when ``TrainingArguments`` is built.

The hf_zero cases never set ``use_cpu``: on a machine without GPUs hf_zero's arguments see to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn

SEQ, VOCAB = 8, 32
WARMUP, SECTION_STEPS = 2, 5


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _args(case: dict, seq2seq: bool = False, **kw):  # noqa: ANN202
    """hf_zero's arguments with the case's config, or transformers' own (use_cpu) for the plain run."""
    import transformers

    import hf_zero

    base = dict(output_dir=case["dir"], report_to="none", disable_tqdm=True, seed=0, logging_steps=1,
                per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate=5e-3, **kw)
    if case.get("zero") is None and case.get("deepspeed") is None:
        cls = transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments
        return cls(use_cpu=True, **base)
    cls = hf_zero.Seq2SeqTrainingArguments if seq2seq else hf_zero.TrainingArguments
    extra = {"zero_config": case["zero"]} if case.get("zero") is not None else {"deepspeed": case["deepspeed"]}
    return cls(**base, **extra)


def _trainer_cls(case: dict, seq2seq: bool = False):  # noqa: ANN202
    import transformers

    import hf_zero

    plain = case.get("zero") is None and case.get("deepspeed") is None
    if seq2seq:
        return transformers.Seq2SeqTrainer if plain else hf_zero.Seq2SeqTrainer
    return transformers.Trainer if plain else hf_zero.Trainer


def _ids(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n, SEQ), generator=g).tolist()


def _losses(trainer) -> dict:  # noqa: ANN001
    return {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}


def _life(case: dict) -> dict:
    """train / evaluate / train (resume) / evaluate / train (continue) / predict / save, on a GPT-2."""
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = _ids(48, seed=1)
    train, held = Dataset.from_dict({"input_ids": ids, "labels": ids}), Dataset.from_dict({"input_ids": ids[:6], "labels": ids[:6]})
    args = _args(case, max_steps=4, save_strategy="steps", save_steps=2, lr_scheduler_type="constant")
    trainer = _trainer_cls(case)(model=model, args=args, train_dataset=train, eval_dataset=held)
    out: dict = {}
    trainer.train()
    out["eval1"] = trainer.evaluate()["eval_loss"]
    trainer.args.max_steps = 6
    trainer.train(resume_from_checkpoint=True)  # checkpoint-4: steps 5 and 6
    out["eval2"] = trainer.evaluate()["eval_loss"]
    out["resumed"] = _losses(trainer)
    trainer.args.max_steps, trainer.args.save_strategy = 2, "no"
    trainer.train()  # again, from the weights it has now
    out["again"] = _losses(trainer)
    out["predict"] = trainer.predict(held).predictions.reshape(-1)[::7].tolist()
    trainer.save_model(os.path.join(case["dir"], "final"))
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    out["weights"] = {k: v.float().reshape(-1).tolist() for k, v in weights.items()}
    return out


def _seq2seq(case: dict) -> dict:
    """Seq2SeqTrainer on a T5: two training steps, then evaluation and prediction that generate."""
    from datasets import Dataset
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, num_heads=2, d_ff=24, num_layers=2,
                                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    src, tgt = _ids(16, seed=2), [row[:5] for row in _ids(16, seed=3)]
    data = Dataset.from_dict({"input_ids": src, "labels": tgt})
    args = _args(case, seq2seq=True, max_steps=2, save_strategy="no", predict_with_generate=True, generation_max_length=6)
    trainer = _trainer_cls(case, seq2seq=True)(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(6)))
    trainer.train()
    out = {"eval": trainer.evaluate()["eval_loss"]}
    out["generated"] = trainer.predict(data.select(range(6, 12))).predictions.tolist()
    return out


def ds_warmup_decay(step: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warm-up from 0) as a LambdaLR factor, for optimizer step ``step + 1``.

    DeepSpeed sets the lr at construction (iteration -1: the floor) and advances one iteration
    after each optimizer step, so step k runs at iteration k - 2: the first two steps at the floor.
    """
    it = step - 1
    if it < 0:
        return 0.0
    if it < WARMUP:
        return it / WARMUP
    return max(0.0, (SECTION_STEPS - it) / max(1, SECTION_STEPS - WARMUP))


def _sections(case: dict) -> dict:
    """A BERT classifier whose optimizer and schedule come from the config (plain run: their torch equivalents)."""
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = _ids(40, seed=4)
    data = Dataset.from_dict({"input_ids": ids, "labels": [row[1] % 3 for row in ids]})
    args = _args(case, max_steps=SECTION_STEPS, gradient_accumulation_steps=2, warmup_steps=WARMUP, weight_decay=0.1,
                 max_grad_norm=0.5, adam_beta2=0.99, adam_epsilon=1e-7, save_strategy="no")
    optimizers = (None, None)
    if case.get("deepspeed") is None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, ds_warmup_decay))
    trainer = _trainer_cls(case)(model=model, args=args, train_dataset=data, optimizers=optimizers)
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    return {"losses": _losses(trainer), "lrs": lrs, "weights": {k: v.float().reshape(-1).tolist() for k, v in weights.items()}}


def _evaluate_first(case: dict) -> dict:
    """evaluate() and predict() before any train(), then train() and evaluate() again.

    The plain Trainer's oracle uses one Trainer (and model) for the evaluation and a fresh Trainer and
    model for the training: transformers' own Trainer, evaluated first on several CPU ranks, never wraps
    the model in DDP afterwards and trains the ranks unsynchronised (its model_wrapped stays the bare model).
    """
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    model = fresh()
    ids = _ids(48, seed=1)
    train, held = Dataset.from_dict({"input_ids": ids, "labels": ids}), Dataset.from_dict({"input_ids": ids[:6], "labels": ids[:6]})
    args = _args(case, max_steps=3, save_strategy="no", lr_scheduler_type="constant")
    trainer = _trainer_cls(case)(model=model, args=args, train_dataset=train, eval_dataset=held)
    out = {"eval0": trainer.evaluate()["eval_loss"],
           "predict0": trainer.predict(held).predictions.reshape(-1)[::7].tolist()}
    if case.get("zero") is None:
        _reset()
        args = _args(case, max_steps=3, save_strategy="no", lr_scheduler_type="constant")
        trainer = _trainer_cls(case)(model=fresh(), args=args, train_dataset=train, eval_dataset=held)
    trainer.train()
    out.update(losses=_losses(trainer), eval1=trainer.evaluate()["eval_loss"], wrapped=type(trainer.model_wrapped).__name__)
    return out


def _misspelt(case: dict) -> dict:
    import hf_zero

    try:
        hf_zero.TrainingArguments(output_dir=case["dir"], report_to="none", zero_config={"zero_optimisation": {"stage": 3}})
    except hf_zero.ConfigError as e:
        return {"error": str(e)}
    return {"error": None}


def _run(rank: int, world: int, cases: list) -> list:
    jobs = {"life": _life, "seq2seq": _seq2seq, "sections": _sections, "misspelt": _misspelt, "evalfirst": _evaluate_first}
    out = []
    for case in cases:
        _reset()
        out.append(jobs[case["job"]](case))
    return out


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-6)


def test_trainer_life_at_stage3_sections_and_seq2seq(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zero3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20},
             "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    sections = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                  "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                                  "warmup_type": "linear"}}}
    (tmp_path / "ds.json").write_text(json.dumps(sections))
    cases = [
        {"job": "misspelt", "dir": str(tmp_path / "bad")},
        {"job": "life", "dir": str(tmp_path / "life_plain")},
        {"job": "life", "dir": str(tmp_path / "life_z3"), "zero": zero3},
        {"job": "seq2seq", "dir": str(tmp_path / "t5_plain")},
        {"job": "seq2seq", "dir": str(tmp_path / "t5_z3"), "zero": zero3},
        {"job": "sections", "dir": str(tmp_path / "sec_plain")},
        {"job": "sections", "dir": str(tmp_path / "sec_ds"), "deepspeed": str(tmp_path / "ds.json")},
        {"job": "evalfirst", "dir": str(tmp_path / "first_plain")},
        {"job": "evalfirst", "dir": str(tmp_path / "first_z3"), "zero": zero3},
        {"job": "evalfirst", "dir": str(tmp_path / "first_z2"), "zero": {**zero3, "zero_optimization": {"stage": 2}}},
    ]
    per_rank = spawn(_run, 2, cases)
    for bad, *_ in per_rank:  # refused on both ranks, when the arguments were built
        assert bad["error"] == "zero_optimisation: unknown key; did you mean 'zero_optimization'?", bad
    _, plain, z3, t5_plain, t5_z3, sec_plain, sec_ds, first_plain, first_z3, first_z2 = per_rank[0]

    # evaluate() and predict() before train() (stage 3: on the training engine, sharded), then train() and evaluate()
    for first in (first_z3, first_z2):
        assert _close(first["eval0"], first_plain["eval0"]) and _close(first["eval1"], first_plain["eval1"]), (first, first_plain)
        assert max(abs(a - b) for a, b in zip(first["predict0"], first_plain["predict0"])) < 1e-4
        assert first["losses"].keys() == first_plain["losses"].keys() == {"1", "2", "3"}
        assert all(_close(first["losses"][k], v) for k, v in first_plain["losses"].items()), (first, first_plain)
    assert first_z3["wrapped"] == "ZeroEngine" and first_plain["wrapped"] == "DistributedDataParallel"

    for key in ("resumed", "again"):
        assert plain[key].keys() == z3[key].keys() and len(plain[key]) == (6 if key == "resumed" else 2), (plain[key], z3[key])
        for step, loss in plain[key].items():
            assert _close(z3[key][step], loss), (key, step, z3[key], plain[key])
    assert _close(z3["eval1"], plain["eval1"]) and _close(z3["eval2"], plain["eval2"]), (z3, plain)
    diff = max(abs(a - b) for a, b in zip(z3["predict"], plain["predict"]))
    assert len(z3["predict"]) == len(plain["predict"]) and diff < 1e-4, (diff, z3["predict"][:8], plain["predict"][:8])
    assert z3["weights"].keys() == plain["weights"].keys()
    a = torch.cat([torch.tensor(z3["weights"][n]) for n in plain["weights"]])
    b = torch.cat([torch.tensor(w) for w in plain["weights"].values()])
    assert float((a - b).norm() / b.norm()) < 1e-5 and float((a - b).abs().max()) < 1e-4  # after 12 Adam steps
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "life_z3" / "final"))
    for name, p in loaded.state_dict().items():
        if name in z3["weights"]:
            assert p.reshape(-1).tolist() == z3["weights"][name], name

    assert t5_z3["generated"] == t5_plain["generated"] and _close(t5_z3["eval"], t5_plain["eval"]), (t5_z3, t5_plain)

    assert sorted(sec_plain["losses"], key=int) == [str(s) for s in range(1, SECTION_STEPS + 1)]
    assert sec_ds["lrs"] == pytest.approx(sec_plain["lrs"], rel=1e-12) and sec_plain["lrs"][0] == 0.0, (sec_ds["lrs"], sec_plain["lrs"])
    for step, loss in sec_plain["losses"].items():
        assert _close(sec_ds["losses"][step], loss), (step, sec_ds["losses"], sec_plain["losses"])
    for name, w in sec_plain["weights"].items():  # LayerNorm weights and biases decay too (DeepSpeed's one group)
        a, b = torch.tensor(sec_ds["weights"][name]), torch.tensor(w)
        assert float((a - b).abs().max()) < 1e-5, name

    # hf-zero consolidate of the Trainer's output dir takes its newest checkpoint-N (6: phase 3 did not save)
    from safetensors.torch import load_file

    from hf_zero.launch.cli import main as cli

    run = tmp_path / "life_z3"
    assert cli(["consolidate", str(run), str(tmp_path / "cons")]) == 0
    assert "reading " + str(run / "checkpoint-6") in capsys.readouterr().err
    got, want = load_file(str(tmp_path / "cons" / "model.safetensors")), load_file(str(run / "checkpoint-6" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert cli(["consolidate", str(run), str(tmp_path / "cons2"), "--tag", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-zero consolidate: error: --tag nope: ") and "\n" not in err, err
    assert cli(["consolidate", str(tmp_path / "bad"), str(tmp_path / "cons2")]) == 2
    assert "pass tag=" not in capsys.readouterr().err
