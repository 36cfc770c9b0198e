"""``hf_zero.TrainingArguments`` and ``hf_zero.Trainer``: transformers' own, with ``zero_config``.

transformers has no plug-in point for a training engine (DeepSpeed is wired in through branches
on ``is_deepspeed_enabled``), so this subclasses, without patching either library:

- ``TrainingArguments`` is transformers' dataclass with one more field, ``zero_config``.
- ``Trainer`` makes its ``accelerator`` an :class:`hf_zero.Accelerator`, whose ``prepare`` builds
  the ZeRO engine from the model and the optimizer the Trainer created (or the config's
  ``optimizer``/``scheduler`` sections). The Trainer keeps doing what it does: it divides the loss
  for gradient accumulation, decides the boundaries, clips through ``clip_grad_norm_``, steps its
  scheduler, logs, evaluates and calls back. Saving goes through the engine: ``save_model`` writes
  consolidated safetensors, checkpoints carry the engine's reshardable resume state (no pickle),
  and resuming / ``load_best_model_at_end`` read it back.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import accelerate
import transformers

from hf_zero.engine import UsageError
from hf_zero.integrations.accelerate import Accelerator, load_zero_config

ZERO_STATE_TAG = "zero_state"


@dataclass(repr=False)
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments`` plus ``zero_config`` (a DeepSpeed-style JSON path or dict)."""

    zero_config: str | None = field(
        default=None,
        metadata={"help": "ZeRO config: path to a DeepSpeed-style JSON file (or a dict). \"auto\" values are "
                  "filled from these training arguments."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero_config is not None and self.deepspeed is not None:
            raise ValueError("TrainingArguments: set zero_config or deepspeed, not both; hf_zero replaces DeepSpeed")
        self.zero_config_dict = load_zero_config(self.zero_config) if self.zero_config is not None else None

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("zero_config_dict", None)
        return d


def fill_auto(config: dict, args: transformers.TrainingArguments, world_size: int) -> dict:
    """The engine's config for a Trainer run, with ``"auto"`` taken from the training arguments.

    The Trainer divides the loss for gradient accumulation and decides where steps happen, so the
    engine runs with one micro-step per step (``gradient_accumulation_steps`` 1) and clips at
    whatever ``clip_grad_norm_`` asks; the config's batch keys are checked against the arguments.
    """
    cfg = copy.deepcopy(config)
    mismatches = []

    def check(key: str, want: Any, arg: str) -> None:
        have = cfg.get(key, "auto")
        if have != "auto" and have is not None and have != want:
            mismatches.append(f"{key}: config has {have}, TrainingArguments has {want} (--{arg})")

    gas = int(args.gradient_accumulation_steps)
    micro = int(args.per_device_train_batch_size)
    check("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    check("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    check("train_batch_size", micro * gas * world_size, "per_device_train_batch_size x gradient_accumulation_steps x world size")
    check("gradient_clipping", float(args.max_grad_norm), "max_grad_norm")
    opt = cfg.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("params"), dict):
        params = opt["params"]
        for key, want, arg in (("lr", args.learning_rate, "learning_rate"), ("weight_decay", args.weight_decay, "weight_decay"),
                               ("eps", args.adam_epsilon, "adam_epsilon"),
                               ("betas", [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2")):
            have = params.get(key, "auto")
            if have != "auto" and (list(have) if isinstance(have, (list, tuple)) else have) != want:
                mismatches.append(f"optimizer.params.{key}: config has {have}, TrainingArguments has {want} (--{arg})")
    sched = cfg.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        have = sched["params"].get("warmup_max_lr", "auto")
        if have != "auto" and have != args.learning_rate:
            mismatches.append(f"scheduler.params.warmup_max_lr: config has {have}, TrainingArguments has "
                              f"{args.learning_rate} (--learning_rate)")
    for key, on, arg in (("bf16", bool(args.bf16), "bf16"), ("fp16", bool(args.fp16), "fp16")):
        section = cfg.get(key)
        if isinstance(section, dict):
            if section.get("enabled") == "auto":
                section["enabled"] = on
            elif bool(section.get("enabled", False)) != on:
                mismatches.append(f"{key}.enabled: config has {section.get('enabled')}, TrainingArguments has {on} (--{arg})")
        elif on:
            cfg[key] = {"enabled": True}
    if mismatches:
        raise UsageError("zero_config contradicts the training arguments: " + "; ".join(mismatches))
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("train_batch_size", None)
    cfg["gradient_clipping"] = 0.0  # the Trainer clips through accelerator.clip_grad_norm_
    return cfg


class Trainer(transformers.Trainer):
    """transformers' ``Trainer``; with ``args.zero_config`` the model trains in a ZeRO engine."""

    @property
    def zero_enabled(self) -> bool:
        return getattr(self.args, "zero_config_dict", None) is not None

    @property
    def engine(self) -> Any:
        engines = getattr(self.accelerator, "_zero_engines", [])
        return engines[-1] if engines else None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if not self.zero_enabled:
            return
        acc = self.accelerator
        if type(acc) is not accelerate.Accelerator:
            raise UsageError(f"hf_zero's Trainer expected Accelerate's Accelerator, found {type(acc).__name__}")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise UsageError("zero_config cannot be combined with DeepSpeed or FSDP from the Accelerate config; use one")
        # The accelerator was built from all of the Trainer's arguments; it becomes hf_zero's subclass
        # (which only adds prepare/backward/clip/save behaviour) rather than being rebuilt from them.
        acc.__class__ = Accelerator
        acc.zero_config = fill_auto(self.args.zero_config_dict, self.args, acc.num_processes)
        acc._zero_engines = []

    # ---------------------------------------------------------- optimizer from the config

    def create_optimizer(self, model: Any = None) -> Any:
        section = (self.args.zero_config_dict or {}).get("optimizer") if self.zero_enabled else None
        if section is None or self.optimizer is not None:
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        from hf_zero.optim import build_optimizer

        params = dict(section.get("params", {}))
        for key, value in (("lr", self.args.learning_rate), ("weight_decay", self.args.weight_decay),
                           ("betas", [self.args.adam_beta1, self.args.adam_beta2]), ("eps", self.args.adam_epsilon)):
            if params.get(key, "auto") == "auto":
                params[key] = value
        target = model if model is not None else self.model
        decay = set(self.get_decay_parameter_names(target))
        groups = [
            {"params": [p for n, p in target.named_parameters() if n in decay and p.requires_grad], "weight_decay": params["weight_decay"]},
            {"params": [p for n, p in target.named_parameters() if n not in decay and p.requires_grad], "weight_decay": 0.0},
        ]
        self.optimizer = build_optimizer(section["type"], params, [g for g in groups if g["params"]])
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        section = (self.args.zero_config_dict or {}).get("scheduler") if self.zero_enabled else None
        if section is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        from hf_zero.optim import build_scheduler

        params = dict(section.get("params", {}))
        fills = {
            "warmup_min_lr": 0.0, "warmup_max_lr": self.args.learning_rate,
            "warmup_num_steps": self.args.get_warmup_steps(num_training_steps), "total_num_steps": num_training_steps,
        }
        mismatches = []
        for key, value in fills.items():
            have = params.get(key)
            if have == "auto":
                params[key] = value
            elif key != "warmup_min_lr" and have is not None and have != value:
                # an explicit step count the arguments contradict would warm up or decay over a run nobody asked for
                mismatches.append(f"scheduler.params.{key}: config has {have}, the Trainer computed {value} "
                                  f"(--{'learning_rate' if key == 'warmup_max_lr' else 'warmup_steps/max_steps'})")
        if mismatches:
            raise UsageError("zero_config contradicts the training arguments: " + "; ".join(mismatches))
        opt = optimizer if optimizer is not None else self.optimizer
        self.lr_scheduler = build_scheduler(section["type"], params, getattr(opt, "optimizer", opt))
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # ------------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, merge_adapters: bool = False) -> None:
        """Consolidated safetensors (``from_pretrained`` loads them), gathered unit by unit.

        A peft ``PeftModel`` is saved as peft saves it (``adapter_model.safetensors`` and
        ``adapter_config.json``, only the adapters gathered), or with ``merge_adapters=True`` as full
        weights with the adapters merged in. The folder records the run (resolved ZeRO config,
        hyperparameters, results, devices) for the model card that ``push_to_hub`` or ``hf-zero push`` writes.
        """
        if not self.zero_enabled or self.engine is None:
            if merge_adapters:
                raise UsageError(
                    "save_model(merge_adapters=True) merges through hf_zero's engine, which exists once a Trainer with "
                    "zero_config has started training; otherwise merge with peft: model.merge_and_unload().save_pretrained(dir)"
                )
            return super().save_model(output_dir, _internal_call=_internal_call)
        from hf_zero.model_cards import record

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.save_pretrained(output_dir, merge_adapters=merge_adapters)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            with open(os.path.join(output_dir, "training_args.json"), "w") as f:
                f.write(self.args.to_json_string())
            record.update_record(output_dir, record.trainer_record(self, merged=merge_adapters), keep=record.TRAINER_FILLS_ONLY)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(
        self, language: str | None = None, license: str | None = None, tags: str | list[str] | None = None,
        model_name: str | None = None, finetuned_from: str | None = None, tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """``README.md`` in ``output_dir`` (rank 0), built with huggingface_hub's ``ModelCard`` from the run's record.

        transformers' arguments mean what they mean there; the card adds what transformers' does not
        know: the resolved ZeRO config, the devices, world size and framework versions, and
        ``library_name: peft`` with the base model for an adapter. Evaluation results become a
        ``model-index`` when a dataset is named (``dataset``/``dataset_tags``, or a Hub dataset's own name).
        """
        if not self.zero_enabled:
            return super().create_model_card(
                language=language, license=license, tags=tags, model_name=model_name, finetuned_from=finetuned_from,
                tasks=tasks, dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args,
            )
        if not self.is_world_process_zero():
            return
        from hf_zero.hub import _write_atomic
        from hf_zero.model_cards import record
        from hf_zero.model_cards.card import render_model_card

        folder = self.args.output_dir
        merged = bool(record.read_record(folder).get("merged_adapters"))  # as save_model left the folder
        record.update_record(folder, record.trainer_record(self, merged=merged), keep=record.TRAINER_FILLS_ONLY)
        extra: dict[str, Any] = {"tags": [tags] if isinstance(tags, str) else list(tags or [])}
        if language is not None:
            extra["language"] = language
        if license is not None:
            extra["license"] = license
        if tasks:
            extra["pipeline_tag"] = tasks if isinstance(tasks, str) else tasks[0]
        datasets = dataset if dataset is not None else dataset_tags
        text = render_model_card(
            folder, base_model=finetuned_from, datasets=datasets, extra=extra, repo_id=getattr(self.args, "hub_model_id", None) or None,
            model_name=model_name,
        )
        _write_atomic(os.path.join(folder, "README.md"), text)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.zero_enabled or self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        self.engine.save_checkpoint(output_dir, tag=ZERO_STATE_TAG, client_state={"lr_scheduler": sched})

    def _save_rng_state(self, output_dir: str) -> None:
        if not self.zero_enabled:
            return super()._save_rng_state(output_dir)
        # the engine checkpoint carries every rank's RNG state (safetensors, not pickle)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self.zero_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # weights come back with the engine state once the engine exists (_load_optimizer_and_scheduler)
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_STATE_TAG)):
            raise UsageError(
                f"{resume_from_checkpoint} has no hf_zero resume state ('{ZERO_STATE_TAG}'); resume from a checkpoint "
                "that this Trainer saved with zero_config (save_only_model must be off)"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.zero_enabled or checkpoint is None or self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        _, client = self.engine.load_checkpoint(checkpoint, tag=ZERO_STATE_TAG)
        if self.lr_scheduler is not None and client.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(client["lr_scheduler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self.zero_enabled:
            return super()._load_rng_state(checkpoint)

    def _load_best_model(self) -> None:
        if not self.zero_enabled or self.engine is None:
            return super()._load_best_model()
        self.engine.load_checkpoint(self.state.best_model_checkpoint, tag=ZERO_STATE_TAG, load_module_only=True)


@dataclass(repr=False)
class Seq2SeqTrainingArguments(TrainingArguments, transformers.Seq2SeqTrainingArguments):
    """transformers' ``Seq2SeqTrainingArguments`` (``predict_with_generate``, ...) plus ``zero_config``."""


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """transformers' ``Seq2SeqTrainer`` on a ZeRO engine: evaluation and prediction can generate.

    Under stage 3 a no-grad forward leaves each block gathered until the next training forward,
    so ``generate`` does one all-gather per block and then decodes with no collectives at all:
    ranks that finish at different lengths do not need transformers' ``synced_gpus``.
    """
