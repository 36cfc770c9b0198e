"""Expert parallelism through ``hf_zero.Trainer`` (and TRL's SFTTrainer and PEFT's parameter-targeted LoRA).

On 4 gloo ranks a tiny Mixtral (8 experts, top-2, ``output_router_logits`` on, so the router's aux loss is in the
loss the model returns) trains through ``hf_zero.Trainer`` with ``TrainingArguments(zero_config=...)`` holding
``"expert_parallel": {"enabled": true, "autoep_size": 2}`` at ZeRO-2, saving every 2 steps, then resumes from
``checkpoint-4`` for 2 more steps. The oracle is the same Trainer on the same ranks without the section (its
experts whole on every rank; ``tests/test_expert_parallel.py`` checks that both equal one process): every logged
loss (rel. 1e-5), and a run with ``router_aux_loss_coef`` 0 logs other losses, so the aux loss is what is logged.
The same holds for a ``PeftModel`` with LoRA on the attention and on the fused experts (``target_parameters``,
``tests/test_expert_peft.py``'s model) at ZeRO-3: its resume checkpoints hold each EP rank's experts' factors.

TRL: ``hf_zero.integrations.trl.SFTTrainer`` on a tiny Mixtral with the section, full fine-tune, with a PEFT LoRA on the
attention (``peft_config``: the experts and the router frozen, held by EP ranks as before) and with a LoRA on the
attention and the fused experts (``target_parameters``: each EP rank trains its experts' factors), logs the losses of
the same trainer without the section (rel. 1e-5); the router stays frozen under LoRA, and the adapters
``save_model`` writes (PEFT's layout, every expert's factors) load with ``PeftModel.from_pretrained`` to the run's
without the section (1e-5).
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
    if case.get("lora"):
        from tests.test_expert_peft import lora_model

        zero["zero_optimization"]["stage"] = 3
        model = lora_model("mixtral")
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
    cases += [{"ep": ep, "aux": 0.1, "lora": True, "dir": str(tmp_path / f"lora_ep{ep}")} for ep in (2, 1)]
    for rank, (ep, plain, no_aux, lora_ep, lora) in enumerate(spawn(_run, 4, cases)):
        for got, want in ((ep, plain), (lora_ep, lora)):
            assert got["checkpoints"] == want["checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], got
            assert got["losses"].keys() == want["losses"].keys() and len(got["losses"]) == 6, (rank, got, want)
            assert all(_close(got["losses"][k], v) for k, v in want["losses"].items()), (rank, got["losses"], want["losses"])
        # the logged loss holds the router's aux loss (at coefficient 0.1 it differs from the run without it)
        assert all(abs(plain["losses"][k] - v) > 1e-4 for k, v in no_aux["losses"].items()), (plain, no_aux)


def _sft_model(vocab: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False, pad_token_id=0))


def _sft(case: dict) -> dict:
    import hf_zero.integrations.trl as hz_trl
    from tests.test_trl import _sft_data, _tokenizer

    tok = _tokenizer()
    model = _sft_model(tok.vocab_size)
    zero: dict = {"zero_optimization": {"stage": case["stage"]}, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    if case["ep"] > 1:
        zero["expert_parallel"] = {"enabled": True, "autoep_size": case["ep"]}
    args = hz_trl.SFTConfig(
        output_dir=case["dir"], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, seed=0,
        save_strategy="no", disable_tqdm=True, bf16=False, dataloader_drop_last=True, max_length=32, zero_config=zero)
    peft_config = None
    if case["lora"]:
        from peft import LoraConfig

        experts = ["experts.gate_up_proj", "experts.down_proj"] if case["lora"] == "experts" else None
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 target_parameters=experts, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = hz_trl.SFTTrainer(model=model, args=args, train_dataset=_sft_data(), processing_class=tok,
                                    peft_config=peft_config)
        trainer.train()
        if case["lora"] == "experts":
            trainer.save_model(f"{case['dir']}/adapters")
    router = [p.requires_grad for n, p in trainer.model.named_parameters() if n.endswith("mlp.gate.weight")]
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "router_trained": any(router)}


def _adapters(folder: str) -> dict[str, torch.Tensor]:
    """The adapters of ``folder`` as ``PeftModel.from_pretrained`` loads them onto the base model, by name."""
    from peft import PeftModel

    from tests.test_trl import _tokenizer

    model = PeftModel.from_pretrained(_sft_model(_tokenizer().vocab_size), folder)
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


def _trl_run(rank: int, world: int, cases: list) -> dict:
    out = []
    for case in cases:
        _reset()
        out.append(_sft(case))
    saved = None
    if rank == 0:  # the expert LoRA's saved adapters, with and without the section
        ep, plain = (_adapters(f"{c['dir']}/adapters") for c in cases if c["lora"] == "experts")
        whole = all(p.shape == plain[n].shape for n, p in ep.items()) and any(".experts." in n for n in ep)
        saved = {"same_names": ep.keys() == plain.keys(), "whole": whole,
                 "diff": max((p - plain[n]).abs().max().item() for n, p in ep.items())}
    return {"sft": out, "saved": saved}


def test_trl_sft_and_peft_with_expert_parallel(tmp_path: Path) -> None:
    cases = [{"ep": ep, "lora": lora, "stage": stage, "dir": str(tmp_path / f"sft{ep}{lora}")}
             for lora, stage in ((False, 3), (True, 2), ("experts", 3)) for ep in (2, 1)]
    results = spawn(_trl_run, 4, cases)
    for rank, res in enumerate(results):
        full_ep, full, lora_ep, lora, experts_ep, experts = res["sft"]
        for got, want in ((full_ep, full), (lora_ep, lora), (experts_ep, experts)):
            assert len(got["losses"]) == len(want["losses"]) == 3, (rank, got, want)
            assert all(_close(a, b) for a, b in zip(got["losses"], want["losses"])), (rank, got, want)
        assert full_ep["router_trained"] and not lora_ep["router_trained"]  # LoRA leaves the router frozen
        assert not experts_ep["router_trained"]
    saved = results[0]["saved"]
    assert saved["same_names"] and saved["whole"] and saved["diff"] < 1e-5, saved
