"""What saved folders say about themselves: ``config.json``'s class, the training record, and model cards.

On 2 CPU processes: a BERT classifier loaded from a folder whose config names ``BertModel`` (as the
main job's pretrained MiniLM does) and trained by ``hf_zero.Trainer`` with an all-``"auto"`` ZeRO
config; a Llama built with ``from_config`` (no ``architectures`` at all) saved by the engine at
stage 3; a LoRA adapter saved at stage 3. The oracles: the class transformers' own
``save_pretrained`` would record, ``huggingface_hub.ModelCard.load`` parsing the cards back, the
Trainer's own evaluation metrics, and peft loading the pushed adapter by repo id from a Hub
stand-in (tests/hub_server.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import spawn
from tests.hub_server import HubServer

REPO_ROOT = Path(__file__).resolve().parent.parent
SEQ, VOCAB, LABELS = 8, 64, 3
AUTO_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
ENGINE_CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40}}


def _bert_config():  # noqa: ANN202
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=SEQ, num_labels=LABELS, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def _llama(name_or_path: str = ""):  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        name_or_path=name_or_path))


def _save(rank: int, world: int, root: str) -> dict:
    from datasets import Dataset
    from transformers import BertForSequenceClassification

    import hf_zero

    out: dict[str, Any] = {}
    # 1. the Trainer: a classifier from a folder that says BertModel, "auto" everywhere, evaluated
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(os.path.join(root, "pretrained"), num_labels=LABELS)
    model.name_or_path = model.config._name_or_path = "org/tiny-bert"  # as if from_pretrained("org/tiny-bert")
    g = torch.Generator().manual_seed(5)
    data = Dataset.from_dict({"input_ids": torch.randint(1, VOCAB, (32, SEQ), generator=g).tolist(),
                              "labels": torch.randint(0, LABELS, (32,), generator=g).tolist()})

    def accuracy(pred: Any) -> dict:
        return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}

    args = hf_zero.TrainingArguments(
        output_dir=os.path.join(root, "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=1e-3, max_grad_norm=0.7, report_to="none", use_cpu=True, seed=0,
        save_strategy="no", eval_strategy="steps", eval_steps=2, disable_tqdm=True, zero_config=AUTO_CONFIG,
    )
    trainer = hf_zero.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)),
                              compute_metrics=accuracy)
    trainer.train()
    trainer.save_model(os.path.join(root, "trainer", "final"))
    trainer.create_model_card(dataset="user/sentences", license="apache-2.0")
    out["eval"] = [h for h in trainer.state.log_history if "eval_loss" in h][-1]

    # 2. the engine, a from_config model (architectures unset), stage 3
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    llama = _llama()
    out["architectures_before"] = llama.config.architectures
    engine, _, _, _ = hf_zero.initialize(model=llama, config=ENGINE_CONFIG)
    engine.save_pretrained(os.path.join(root, "llama"))
    try:
        engine.save_pretrained(os.path.join(root, "nothing"), merge_adapters=True)
    except hf_zero.UsageError as e:
        out["merge_refused"] = str(e)

    # 3. a LoRA adapter at stage 3, on a base named like a Hub checkpoint
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(_llama("org/tiny-llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 task_type="CAUSAL_LM"))
    engine, _, _, _ = hf_zero.initialize(model=lora, config=ENGINE_CONFIG)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_pretrained(os.path.join(root, "adapter"))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("peft")
    from transformers import BertModel

    root = tmp_path_factory.mktemp("cards")
    torch.manual_seed(0)
    BertModel(_bert_config()).save_pretrained(root / "pretrained")
    assert json.loads((root / "pretrained" / "config.json").read_text())["architectures"] == ["BertModel"]
    return root, spawn(_save, 2, str(root))[0]


def _autos(node: Any) -> list:
    if isinstance(node, dict):
        return [a for v in node.values() for a in _autos(v)]
    if isinstance(node, list):
        return [a for v in node for a in _autos(v)]
    return [node] if node == "auto" else []


def _json_block(text: str) -> dict:
    return json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))


def test_config_json_names_the_trained_class_and_estimate_builds_it(saved: tuple, capsys: pytest.CaptureFixture) -> None:
    from transformers import BertForSequenceClassification

    from hf_zero.launch import cli
    from hf_zero.planning.estimate import build_model_on_meta, count_model_parameters

    root, out = saved
    final = root / "trainer" / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    assert out["architectures_before"] is None
    assert json.loads((root / "llama" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    assert type(build_model_on_meta(final)).__name__ == "BertForSequenceClassification"
    real = BertForSequenceClassification(_bert_config())
    assert count_model_parameters(final) == sum(p.numel() for p in real.parameters())
    assert cli.main(["estimate", "--model", str(final), "--num_gpus", "2"]) == 0
    assert "(BertForSequenceClassification, built on the meta device)" in capsys.readouterr().out


def test_trainer_card_has_metadata_results_and_the_resolved_config(saved: tuple) -> None:
    from huggingface_hub import ModelCard

    root, out = saved
    card = ModelCard.load(root / "trainer" / "README.md")
    data = card.data
    assert data.library_name == "transformers" and data.base_model == "org/tiny-bert"
    assert data.pipeline_tag == "text-classification" and data.datasets == ["user/sentences"]
    assert data.license == "apache-2.0" and {"hf_zero", "transformers", "zero-stage-2"} <= set(data.tags)
    results = {r.metric_type: r.metric_value for r in data.eval_results}
    assert results == {"loss": out["eval"]["eval_loss"], "accuracy": out["eval"]["eval_accuracy"]}
    assert all(r.dataset_type == "user/sentences" for r in data.eval_results)

    text = card.text
    config = _json_block(text)
    assert _autos(config) == [], config
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 2 * 2 * 2 and config["gradient_clipping"] == 0.7
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}
    zo = config["zero_optimization"]  # transformers' rules from hidden size 32, with hf_zero's bucket floor
    assert zo == {"stage": 2, "reduce_bucket_size": 25_000_000, "stage3_prefetch_bucket_size": int(0.9 * 32 * 32),
                  "stage3_param_persistence_threshold": 320}
    assert "2 x CPU (gloo, world size 2)" in text
    assert "| learning_rate | 0.001 |" in text and "| distributed_type | hf_zero ZeRO stage 2 |" in text
    assert f"- torch {torch.__version__.split('+')[0]}" in text and "- transformers " in text
    assert 'AutoModelForSequenceClassification.from_pretrained("path/to/this/folder")' in text
    assert "| accuracy |" in text

    # the folder save_model wrote carries the same record: the card `hf-zero push` renders later agrees
    from hf_zero.hub.transfer import render_model_card

    pushed = ModelCard(render_model_card(root / "trainer" / "final", repo_id="user/bert"))
    assert pushed.data.library_name == "transformers" and pushed.data.base_model == "org/tiny-bert"
    assert _json_block(pushed.text) == config and "2 x CPU (gloo, world size 2)" in pushed.text
    assert "not recorded" not in pushed.text.lower()


def test_engine_record_resolves_the_config_it_ran(saved: tuple) -> None:
    from hf_zero.hub.model_cards.record import read_record

    root, out = saved
    rec = read_record(root / "llama")
    assert rec["library_name"] == "transformers" and rec["model_class"] == "LlamaForCausalLM"
    assert rec["world_size"] == 2 and rec["devices"] == {"CPU": 2} and rec["backend"] == "gloo"
    assert rec["zero_config"] == ENGINE_CONFIG and rec["zero_stage"] == 3 and rec["global_steps"] == 0
    assert rec["framework_versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert out["merge_refused"] == (
        "merge_adapters=True: the model is a LlamaForCausalLM, not a peft PeftModel, so it has no adapters to merge; "
        "save without merge_adapters"
    )


def test_resolve_autos_fills_every_section_and_drops_what_nothing_used() -> None:
    from hf_zero.hub.model_cards.record import resolve_autos

    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-8}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 5}},
              "zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto"}, "steps_per_print": "auto",
              "wall_clock_breakdown": False}
    values = {"optimizer.params.lr": 3e-4, "optimizer.params.betas": (0.9, 0.95), "scheduler.params.total_num_steps": 100,
              "zero_optimization.prefetch_bucket_size": 921}
    assert resolve_autos(config, values) == {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": 3, "prefetch_bucket_size": 921}, "wall_clock_breakdown": False,
    }


def test_push_of_an_adapter_folder_writes_a_peft_card_and_peft_loads_it_by_repo_id(saved: tuple, tmp_path: Path) -> None:
    root, _ = saved
    adapter = root / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(adapter))
    assert not {"model.safetensors", "config.json", "README.md"} & set(os.listdir(adapter))
    hub = HubServer(token="hf_" + secrets.token_hex(16)).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_"))}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "home"), HF_TOKEN=hub.token,
                   HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))

        def run(argv: list[str]) -> str:
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            return proc.stdout

        run([sys.executable, "-m", "hf_zero.launch.cli", "push", str(adapter), "user/lora"])
        head = hub.repos["user/lora"].commits[hub.repos["user/lora"].refs["main"]]
        assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(head.files)
        loaded = run([sys.executable, "-c", textwrap.dedent(f"""
            import torch
            from peft import PeftModel
            from safetensors.torch import load_file
            from tests.test_model_cards import _llama
            model = PeftModel.from_pretrained(_llama(), "user/lora")
            saved = load_file({str(adapter / "adapter_model.safetensors")!r})
            live = {{k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}}
            print("SAME", sorted(live) == sorted(saved) and all(torch.equal(live[k], saved[k]) for k in saved))
        """)])
        assert "SAME True" in loaded, loaded
        assert not hub.unknown_calls, hub.unknown_calls
    finally:
        hub.stop()
    from huggingface_hub import ModelCard

    card = ModelCard.load(adapter / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model == "org/tiny-llama"
    assert card.data.pipeline_tag == "text-generation" and {"hf_zero", "peft", "lora", "zero-stage-3"} <= set(card.data.tags)
    assert 'AutoPeftModelForCausalLM.from_pretrained("user/lora")' in card.text
    assert "1 x" not in card.text and "2 x CPU (gloo, world size 2)" in card.text
    assert _json_block(card.text) == ENGINE_CONFIG


def test_a_local_folder_never_becomes_base_model_and_eval_results_name_their_data(tmp_path: Path) -> None:
    """``base_model`` is a Hub id or nothing: a folder in huggingface_hub's cache gives the id it was downloaded
    from, any other folder none (not even its config's ``_name_or_path``, which names *its* base); results on data
    that is not on the Hub still become a model-index entry when the data is named."""
    from huggingface_hub import ModelCard
    from transformers import BertForSequenceClassification

    from hf_zero.hub.model_cards.card import render_model_card
    from hf_zero.hub.model_cards.record import hub_id_of, update_record

    cached = tmp_path / "hub" / "models--org--tiny-bert" / "snapshots" / ("a" * 40)
    plain = tmp_path / "my-bert"
    for folder in (cached, plain):
        BertForSequenceClassification(_bert_config()).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "someone/its-own-base"}))
    assert hub_id_of(str(cached)) == "org/tiny-bert" and hub_id_of(str(plain)) is None
    assert hub_id_of("org/tiny-bert") == "org/tiny-bert" and hub_id_of("./not-here") is None

    out = tmp_path / "out"
    BertForSequenceClassification(_bert_config()).save_pretrained(out)
    update_record(out, {"metrics": {"accuracy": 0.875}, "base_model": None})
    evaluated = {"type": "my-sentences", "name": "my own sentences", "split": "test"}
    for base, want in ((str(cached), "org/tiny-bert"), (str(plain), None)):
        card = ModelCard(render_model_card(out, base_model=base, eval_dataset=evaluated, model_name="tiny"))
        assert card.data.base_model == want and str(tmp_path) not in card.content, card.content
        assert ("a local folder whose Hub id was not recorded" in card.text) == (want is None)
        [result] = card.data.eval_results
        assert (result.metric_type, result.metric_value, result.dataset_type, result.dataset_split) == (
            "accuracy", 0.875, "my-sentences", "test")
        assert result.task_type == "text-classification" and card.data.model_name == "tiny"
    # the record carries them for a card rendered later (hf-zero push)
    update_record(out, {"base_model": "org/tiny-bert", "eval_dataset": evaluated})
    card = ModelCard(render_model_card(out))
    assert card.data.base_model == "org/tiny-bert" and card.data.eval_results[0].dataset_name == "my own sentences"
    from hf_zero.errors import HubError

    with pytest.raises(HubError, match="has no name"):
        render_model_card(out, eval_dataset={"type": "x"})
