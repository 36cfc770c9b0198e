"""LoRA through ``hf_zero.Trainer`` at ZeRO stages 0-3 on 2 CPU processes, against transformers' own Trainer with peft.

The oracles are nobody's here: transformers' ``Trainer`` (DDP) training the same ``peft`` model
gives the adapter weights (rel. 1e-5, fp32), and peft's own ``save_pretrained`` in that run gives
the folder layout; ``PeftModel.from_pretrained`` must load ours to the same outputs, and a merged
save must equal peft's ``merge_and_unload`` on it exactly. A causal LM (Llama) and a classifier
(BERT, whose head peft trains whole through ``modules_to_save``) are built from small configs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn

pytest.importorskip("peft")

SEQ, VOCAB, LABELS = 8, 64, 3
STEPS = 4


def _base(kind: str):  # noqa: ANN202
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQ, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _lora(kind: str):  # noqa: ANN202
    from peft import LoraConfig, get_peft_model

    if kind == "llama":
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    else:
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(_base(kind), cfg)


def _data(kind: str):  # noqa: ANN202
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (64, SEQ), generator=g).tolist()
    labels = ids if kind == "llama" else torch.randint(0, LABELS, (64,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": labels})


def _probe() -> torch.Tensor:
    return torch.randint(1, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))


def _zero(stage: int, offload: bool = False) -> dict:
    zo: dict = {"stage": stage, "stage3_param_persistence_threshold": 40}
    if offload:  # LoRA over a ZeRO-3 offload config: the frozen base's shards and the adapters' optimizer on the host
        zo.update(offload_optimizer={"device": "cpu", "pin_memory": True}, offload_param={"device": "cpu", "pin_memory": True})
    return {"zero_optimization": zo, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto"}


def _train(rank: int, world: int, cases: list) -> list:
    import hf_zero

    out = []
    for case in cases:
        from accelerate.state import AcceleratorState, GradientState
        from peft import get_peft_model_state_dict

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        kind = case["kind"]
        kw = dict(
            output_dir=case["dir"], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
            learning_rate=2e-2, max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, seed=0,
            save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps") or 500,
            disable_tqdm=True, gradient_checkpointing=bool(case.get("gc")),
        )
        if case.get("gc_kwargs"):
            kw["gradient_checkpointing_kwargs"] = case["gc_kwargs"]
        if case.get("stage") is not None:
            kw["zero_config"] = _zero(case["stage"], bool(case.get("offload")))
        model = _lora(kind)
        trainer = hf_zero.Trainer(model=model, args=hf_zero.TrainingArguments(**kw), train_dataset=_data(kind))
        trainer.train(resume_from_checkpoint=case.get("resume"))
        final = os.path.join(case["dir"], "final")
        gathered = _count_gathers() if case.get("stage") == 3 else None
        trainer.save_model(final)
        if gathered is not None:
            gathered.undo()
        if case.get("merged"):
            trainer.save_model(os.path.join(case["dir"], "merged"), merge_adapters=True)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        adapters = get_peft_model_state_dict(model, state_dict=state)
        result = {"losses": losses, "adapters": {k: v.float().reshape(-1).tolist() for k, v in adapters.items()}}
        if case.get("offload"):  # every sharded group's 16-bit shard in host memory, the frozen base's included
            groups = trainer.engine.zero_optimizer.stage3_groups
            result["on_host"] = bool(groups) and all(g.shard_on_host for g in groups)
        if gathered is not None:
            result["gathered"] = gathered.kinds
        if rank == 0 and case.get("stage") is None:  # the oracle's outputs on a probe, for the loaded folders
            model.eval()
            with torch.no_grad():
                result["probe"] = model(input_ids=_probe()).logits.reshape(-1).tolist()
        out.append(result)
    return out


class _count_gathers:  # noqa: N801 - used like a function
    """Record whether each stage-3 parameter group gathered is trainable, until ``undo()``."""

    def __init__(self) -> None:
        from hf_zero.zero.stage3 import ShardedParamGroup

        self.kinds: list[bool] = []
        self.cls, self.original = ShardedParamGroup, ShardedParamGroup.gather

        def gather(group: ShardedParamGroup, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.kinds.append(bool(group.trainable))
            return self.original(group, *args, **kwargs)

        ShardedParamGroup.gather = gather

    def undo(self) -> None:
        self.cls.gather = self.original


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _close_adapters(got: dict, ref: dict, tol: float, what: str) -> None:
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    for k, v in ref.items():
        assert _rel(torch.tensor(got[k]), torch.tensor(v)) < tol, (what, k)


def _check_adapter_folder(folder: Path, oracle: Path, probe: list, kind: str) -> None:
    """Our folder holds exactly peft's files with peft's names, and loads to the oracle's outputs."""
    from peft import PeftModel
    from safetensors.torch import load_file

    names = set(os.listdir(folder))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names, names
    assert not names & {"model.safetensors", "config.json"}, names
    ours, theirs = load_file(folder / "adapter_model.safetensors"), load_file(oracle / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(".default." not in k for k in ours)
    for k in theirs:
        assert _rel(ours[k], theirs[k]) < 1e-5, k
    assert _config(folder) == _config(oracle)
    loaded = PeftModel.from_pretrained(_base(kind), str(folder)).eval()
    with torch.no_grad():
        logits = loaded(input_ids=_probe()).logits.reshape(-1)
    assert _rel(logits, torch.tensor(probe)) < 1e-5


def _config(folder: Path) -> dict:
    """adapter_config.json, with peft's sets (saved as lists in whatever order the set had) sorted."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    return {k: sorted(v) if k in ("target_modules", "modules_to_save") and isinstance(v, list) else v for k, v in cfg.items()}


def _check_merged(merged_dir: Path, adapter_dir: Path, kind: str) -> None:
    """A merged folder loads with the Auto class and equals peft's merge_and_unload of the adapter folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if kind == "llama" else AutoModelForSequenceClassification
    config = json.loads((merged_dir / "config.json").read_text())
    assert config["architectures"] == [type(_base(kind)).__name__], config["architectures"]
    got = auto.from_pretrained(str(merged_dir)).state_dict()
    want = PeftModel.from_pretrained(_base(kind), str(adapter_dir)).merge_and_unload().state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_lora_trains_saves_merges_and_resumes_at_every_stage(tmp_path: Path) -> None:
    d = {name: str(tmp_path / name) for name in ("plain", "z0", "z1", "z2", "z3", "resume", "bert", "bert3", "z3off")}
    cases = [
        {"kind": "llama", "dir": d["plain"]},
        {"kind": "llama", "dir": d["z0"], "stage": 0, "gc": True},
        {"kind": "llama", "dir": d["z1"], "stage": 1, "gc": True, "gc_kwargs": {"use_reentrant": True}},
        {"kind": "llama", "dir": d["z2"], "stage": 2, "gc": True},
        {"kind": "llama", "dir": d["z3"], "stage": 3, "gc": True, "save_steps": 2, "merged": True},
        {"kind": "llama", "dir": d["resume"], "stage": 3, "gc": True, "resume": os.path.join(d["z3"], "checkpoint-2")},
        {"kind": "bert", "dir": d["bert"]},
        {"kind": "bert", "dir": d["bert3"], "stage": 3, "gc": True, "gc_kwargs": {"use_reentrant": True}, "merged": True},
        {"kind": "llama", "dir": d["z3off"], "stage": 3, "gc": True, "offload": True, "merged": True},
    ]
    plain, z0, z1, z2, z3, resumed, bert, bert3, z3off = spawn(_train, 2, cases)[0]
    steps = list(range(1, STEPS + 1))
    assert z3off["on_host"]
    for name, got in (("z0", z0), ("z1", z1), ("z2", z2), ("z3", z3), ("z3 offload", z3off)):
        assert sorted(int(s) for s in got["losses"]) == steps
        for s, loss in plain["losses"].items():
            assert abs(got["losses"][s] - loss) / loss < 1e-5, (name, s, got["losses"], plain["losses"])
        _close_adapters(got["adapters"], plain["adapters"], 1e-5, name)
    _close_adapters(bert3["adapters"], bert["adapters"], 1e-5, "bert stage 3")
    for got in (z3, resumed, bert3, z3off):  # saving the adapters at stage 3 gathered adapter groups, never a base weight
        assert got["gathered"] and all(got["gathered"]), got["gathered"]
    assert any("classifier" in k for k in bert3["adapters"])  # peft's modules_to_save head came along

    # resume from the stage-3 Trainer checkpoint: exactly the uninterrupted run
    for s in ("3", "4"):
        assert resumed["losses"][s] == z3["losses"][s], (resumed["losses"], z3["losses"])
    assert resumed["adapters"] == z3["adapters"]

    root = {k: Path(v) for k, v in d.items()}
    for name in ("z0", "z1", "z2", "z3", "resume", "z3off"):
        _check_adapter_folder(root[name] / "final", root["plain"] / "final", plain["probe"], "llama")
    _check_merged(root["z3off"] / "merged", root["z3off"] / "final", "llama")
    # a Trainer checkpoint holds the adapter layout too: the one its resume state consolidates to offline
    from hf_zero.launch.cli import main

    assert main(["consolidate", str(root["z3"] / "checkpoint-2"), str(tmp_path / "off2")]) == 0
    _check_adapter_folder(root["z3"] / "checkpoint-2", tmp_path / "off2", _forward(tmp_path / "off2"), "llama")
    _check_adapter_folder(root["bert3"] / "final", root["bert"] / "final", bert["probe"], "bert")
    _check_merged(root["z3"] / "merged", root["z3"] / "final", "llama")
    _check_merged(root["bert3"] / "merged", root["bert3"] / "final", "bert")

    # offline, from the Trainer checkpoint's resume state: the adapter layout, and merged full weights
    ckpt = root["z3"] / f"checkpoint-{STEPS}"
    assert main(["consolidate", str(ckpt), str(tmp_path / "off_adapter")]) == 0
    _check_adapter_folder(tmp_path / "off_adapter", root["z3"] / "final", plain["probe"], "llama")
    assert main(["consolidate", str(ckpt), str(tmp_path / "off_merged"), "--merge-adapters"]) == 0
    _check_merged(tmp_path / "off_merged", root["z3"] / "final", "llama")


def _forward(folder: Path) -> list:
    """The outputs peft gives for an adapter folder (to compare two folders of one run)."""
    from peft import PeftModel

    with torch.no_grad():
        return PeftModel.from_pretrained(_base("llama"), str(folder)).eval()(input_ids=_probe()).logits.reshape(-1).tolist()


def test_without_peft_merging_says_so_in_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    from hf_zero.integrations import peft as hz_peft
    from hf_zero.launch import cli

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now fails as if it were not installed
    assert not hz_peft.is_peft_model(torch.nn.Linear(2, 2))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("global_step1")  # looks like a checkpoint folder to the command
    assert cli.main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--merge-adapters"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hf-zero consolidate: error: --merge-adapters needs the peft package, which is not installed; "
        "install it with pip install 'hf_zero[peft]'"
    ]
