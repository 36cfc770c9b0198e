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

Two collaborators live beside it: :mod:`hf_zero.integrations.trainer_preemption` (the callback that saves and exits
when the engine decides a preemption) and :mod:`hf_zero.integrations.trainer_checkpoints` (what a ``checkpoint-<step>``
folder holds, and which are complete enough to resume).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import accelerate
import torch
import transformers

from hf_zero.distributed import dist as hz_dist
from hf_zero.errors import ConfigError, UsageError
from hf_zero.integrations import deepspeed_plugin as ds_plugin
from hf_zero.integrations import parallelism as hz_parallelism
from hf_zero.integrations.accelerate import Accelerator, launched_without_gpus
from hf_zero.integrations.autofill import (
    fill_auto,
    load_zero_config,
    optimizer_args,
    trainer_scheduler_params,
)
from hf_zero.integrations.trainer_checkpoints import (
    ZERO_STATE_TAG,
    last_complete_checkpoint,
    saved_by_deepspeed,
)
from hf_zero.integrations.trainer_preemption import SaveOnPreemption, watch_signals
from hf_zero.parallel.tensor_parallel import degree_of
from hf_zero.sequence.setup import merge_sp_size, parallelism_config_for, resolve_sp_size

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments", "Trainer", "TrainingArguments", "fill_auto", "zero_args", "zero_trainer"]



@dataclass(repr=False)
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments`` plus ``zero_config`` (a DeepSpeed-style JSON path or dict).

    ``deepspeed=`` (``--deepspeed ds.json``) means the same as ``zero_config=``, so a DeepSpeed
    script switches by its import alone; afterwards ``args.deepspeed`` reads None (transformers'
    DeepSpeed branches would import the ``deepspeed`` package) and ``args.zero_config`` holds it.
    The config is checked when the arguments are built, on every rank, before any model is loaded:
    hf_zero's parser (a misspelt key, a feature hf_zero lacks) and its contradictions with these
    arguments. Launched as several processes on a machine without GPUs, the run uses the CPU over
    gloo (``use_cpu``) so the data is sharded and only rank 0 logs and saves. Started by ``hf-zero launch
    --config_file`` with a ``distributed_type: DEEPSPEED`` Accelerate YAML and no ``zero_config``, the
    YAML's DeepSpeed config is the ``zero_config`` (as transformers takes it from ``accelerate launch``).
    """

    zero_config: dict | str | None = field(
        default=None,
        metadata={"help": "ZeRO config: path to a DeepSpeed-style JSON file (or a dict). \"auto\" values are "
                  "filled from these training arguments. --deepspeed is the same flag."},
    )

    def __post_init__(self) -> None:
        if self.deepspeed is not None:
            if self.zero_config is not None:
                raise ValueError("TrainingArguments: got both zero_config and deepspeed, which are one setting in "
                                 "hf_zero; pass only one of them")
            self.zero_config, self.deepspeed = self.deepspeed, None
        if self.zero_config is None and ds_plugin.launched_with_deepspeed_yaml():
            # hf-zero launch --config_file: the YAML's DeepSpeed config, as transformers takes Accelerate's plugin
            # under ACCELERATE_USE_DEEPSPEED, in the run's precision (--fp16/--bf16, else the YAML's mixed_precision)
            mixed = "fp16" if self.fp16 else "bf16" if self.bf16 else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            self.zero_config = ds_plugin.zero_config_of(ds_plugin.plugin_from_environment(), mixed)
        config = load_zero_config(self.zero_config) if self.zero_config is not None else None
        if config is not None and not torch.cuda.is_available():
            if self.ddp_backend == "nccl":
                raise ValueError("TrainingArguments: ddp_backend='nccl' needs CUDA GPUs and this machine has none; "
                                 "drop it (hf_zero runs CPU processes over gloo here)")
            if launched_without_gpus():
                self.use_cpu = True
        super().__post_init__()
        self.zero_config_dict = config
        if config is not None:  # under sequence parallelism the batch multiplies by the data-parallel degree
            sp = resolve_sp_size(getattr(self, "parallelism_config", None), config)  # the config's own degree counts too
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            tp = degree_of(config)
            if world % tp:  # said here, before any model is built, as the engine would say it later
                raise ConfigError(f"tensor_parallel.autotp_size: got {tp}, which does not divide the {world} ranks of "
                                  f"this run; launch a multiple of {tp} processes or choose a divisor of {world}")
            fill_auto(config, self, world_size=world // sp // tp)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("zero_config_dict", None)
        return d


class Trainer(transformers.Trainer):
    """transformers' ``Trainer``; with ``args.zero_config`` the model trains in a ZeRO engine.

    The config's ``optimizer`` and ``scheduler`` sections build the optimizer and the schedule as
    they do under DeepSpeed ("auto" from the arguments; the section's optimizer over every trainable
    parameter, as DeepSpeed's one parameter group); without them the Trainer builds its own from the
    arguments. A section and an optimizer or scheduler handed to the Trainer for the same thing are
    refused (one sentence), as Accelerate refuses them for DeepSpeed. ``train``, ``evaluate`` and
    ``predict`` name a rank that died under them instead of raising the backend's socket error.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.zero_enabled:
            self._check_optimizer_sections()
            self.add_callback(SaveOnPreemption(self))

    @property
    def zero_enabled(self) -> bool:
        return getattr(self.args, "zero_config_dict", None) is not None

    def _prepare_input(self, data: Any) -> Any:
        """Floating inputs in the engine's dtype, as transformers casts them for DeepSpeed (``hf_ds_config.dtype()``):
        the engine, as DeepSpeed's, passes them as given, and a bf16 model's ``pixel_values`` or audio must match it."""
        if self.zero_enabled and isinstance(data, torch.Tensor) and torch.is_floating_point(data):
            return data.to(device=self.args.device, dtype=self._zero_input_dtype())
        return super()._prepare_input(data)

    def _zero_input_dtype(self) -> torch.dtype:
        cfg = getattr(self.accelerator, "zero_config", None) or self.args.zero_config_dict

        def on(key: str) -> bool:
            section = cfg.get(key)
            return isinstance(section, dict) and section.get("enabled") is True

        return torch.bfloat16 if on("bf16") or on("bfloat16") else torch.float16 if on("fp16") else torch.float32

    @property
    def engine(self) -> Any:
        engines = getattr(self.accelerator, "_zero_engines", [])
        return engines[-1] if engines else None

    def create_accelerator_and_postprocess(self) -> None:
        # The sequence-parallel degree from the ParallelismConfig or the zero_config's own sequence_parallel_size:
        # transformers splits batches (and counts them, and leaves the loss to the model) only when the
        # accelerator's state has a ParallelismConfig with sp_size, so one is made for a config that asks alone.
        pc = getattr(self.args, "parallelism_config", None)
        sp = resolve_sp_size(pc, self.args.zero_config_dict) if self.zero_enabled else 1
        given, pc = pc, parallelism_config_for(pc, sp)
        # Attached after Accelerate's checks, which accept sp_size only for its own DeepSpeed / multi-GPU, and would
        # build their own mesh for dp_replicate_size / dp_shard_size (hybrid sharding is the engine's grid here).
        ours = self.zero_enabled and (sp > 1 or hz_parallelism.asks_for_data_parallel_layout(pc))
        if ours:
            self.args.parallelism_config = None
        try:
            super().create_accelerator_and_postprocess()
        finally:
            if ours:
                self.args.parallelism_config = given
        if not self.zero_enabled:
            return
        acc = self.accelerator
        if ours:
            acc.state.parallelism_config = pc
        if type(acc) is not accelerate.Accelerator:
            raise UsageError(f"hf_zero's Trainer expected Accelerate's Accelerator, found {type(acc).__name__}")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise UsageError("zero_config cannot be combined with DeepSpeed or FSDP from the Accelerate config; use one")
        # The accelerator was built from all of the Trainer's arguments; it becomes hf_zero's subclass
        # (which only adds prepare/backward/clip/save behaviour) rather than being rebuilt from them.
        acc.__class__ = Accelerator
        acc.zero_config = self.args.zero_config_dict  # first, so that num_processes counts replicas (tensor parallelism)
        acc.zero_config = watch_signals(merge_sp_size(fill_auto(self.args.zero_config_dict, self.args, acc.num_processes // sp), sp))
        acc._zero_engines = []
        acc._eval_engines = []
        hz_dist.register_process()  # so that, should a peer die before the engine exists, it can be named

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """Under sequence parallelism the model's own loss is already the mean over the group's targets
        (transformers' ALST branch would reach for DeepSpeed's process groups instead)."""
        groups = getattr(self.engine, "sequence_parallel_groups", None) if self.zero_enabled else None
        if groups is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    # ---------------------------------------------------------- optimizer and scheduler

    def _section(self, name: str) -> dict | None:
        return (self.args.zero_config_dict or {}).get(name) if self.zero_enabled else None

    def _check_optimizer_sections(self) -> None:
        """The combinations of config sections and objects handed to the Trainer that DeepSpeed's integrations refuse."""
        has_opt, has_sched = self._section("optimizer") is not None, self._section("scheduler") is not None
        if has_opt and (self.optimizer is not None or self.optimizer_cls_and_kwargs is not None):
            raise UsageError(
                "zero_config has an optimizer section and the Trainer was given an optimizer too (optimizers= or "
                "optimizer_cls_and_kwargs=); keep one: remove the section, or let the section build the optimizer"
            )
        if has_sched and self.lr_scheduler is not None:
            raise UsageError(
                "zero_config has a scheduler section and the Trainer was given a scheduler too (optimizers=); keep one: "
                "remove the section, or let the section build the scheduler"
            )
        if has_opt and self.lr_scheduler is not None:
            raise UsageError(
                "the Trainer was given a scheduler (optimizers=) but zero_config's optimizer section builds the "
                "optimizer it would drive; give the schedule as a scheduler section, or drop the optimizer section"
            )

    def create_optimizer(self, model: Any = None) -> Any:
        section = self._section("optimizer")
        if section is None or self.optimizer is not None:
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        from hf_zero.optim.optimizers import build_optimizer

        params = dict(section.get("params") or {})
        for key, value, _ in optimizer_args(self.args):
            if params.get(key) == "auto":
                params[key] = value
        target = model if model is not None else self.model
        # DeepSpeed builds the section's optimizer over model_parameters, which transformers passes as
        # every trainable parameter in one group: weight decay applies to biases and norms too.
        trainable = [p for p in target.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(section["type"], params, trainable)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        section = self._section("scheduler")
        if section is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        from hf_zero.optim.schedules import build_scheduler

        params = trainer_scheduler_params(section, self.args, num_training_steps)
        opt = optimizer if optimizer is not None else self.optimizer
        self.lr_scheduler = build_scheduler(section["type"], params, getattr(opt, "optimizer", opt))
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # ---------------------------------------------------------- a rank that dies

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``train``; ``resume_from_checkpoint=True`` takes the newest *complete* ``checkpoint-<step>``.

        A checkpoint folder whose save was cut short (a second signal, a killed process, a background
        write that never finished) has no ``trainer_state.json`` or no published ``zero_state``; transformers
        would pick it by its number alone and fail to resume. Checkpoints written in the background
        (``checkpoint.async_save``) are complete when ``train()`` returns.
        """
        if resume_from_checkpoint is True and self.zero_enabled:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        with hz_dist.peer_failure_guard("Trainer.train()"), self._loss_filter_on_device():
            out = super().train(resume_from_checkpoint, *args, **kwargs)
            if self.zero_enabled and self.engine is not None:
                self.engine.wait_for_checkpoint()
                if self.engine.config.checkpoint_async_save:
                    self._rotate_to_the_limit()
            return out

    @contextlib.contextmanager
    def _loss_filter_on_device(self) -> Iterator[None]:
        """transformers' ``logging_nan_inf_filter`` applied on the device instead of the host.

        The training loop tests every micro-step's loss with ``torch.isnan(loss) or torch.isinf(loss)``:
        a host sync per micro-step, which stalls the CPU until the backward just queued has run, so
        the step's norm, clip and optimizer kernels are queued only after the GPU has drained. The
        same rule (a non-finite loss counts as the mean of the losses logged since the last log) is
        applied in :meth:`training_step` with ``torch.where``, and the flag reads ``False`` to the
        loop while ``train()`` runs; evaluation, which filters its own losses, sees the user's value.
        transformers versions without the on-device running loss (``_tr_loss``) keep the host test.
        """
        args = self.args
        wanted = self.zero_enabled and bool(getattr(args, "logging_nan_inf_filter", False))
        self._hz_loss_filter = wanted
        try:
            yield
        finally:
            self._hz_loss_filter = False
            if wanted:
                args.logging_nan_inf_filter = True

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        running = getattr(self, "_tr_loss", None)
        if not getattr(self, "_hz_loss_filter", False) or not isinstance(running, torch.Tensor) or loss.device != running.device:
            if getattr(self, "_hz_loss_filter", False):
                self.args.logging_nan_inf_filter = True  # (this transformers: the loop's host test, as it was)
            return loss
        self.args.logging_nan_inf_filter = False  # read by the loop right after this returns
        since = 1 + self.state.global_step - self._globalstep_last_logged
        return torch.where(torch.isfinite(loss), loss, running / since)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with hz_dist.peer_failure_guard("Trainer.evaluate()"):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with hz_dist.peer_failure_guard("Trainer.predict()"):
            return super().predict(*args, **kwargs)

    # ---------------------------------------------------------- evaluation before training

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        self._engine_for_evaluation()
        flag = self.args.logging_nan_inf_filter
        if getattr(self, "_hz_loss_filter", False):
            self.args.logging_nan_inf_filter = True  # evaluation inside train() filters its losses as the user asked
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = flag

    def _engine_for_evaluation(self) -> None:
        """``evaluate()`` / ``predict()`` before any ``train()`` at stage 3: the training engine, built now.

        transformers would prepare the bare model for evaluation only, which at stage 3 means a
        forward-only engine that shards (and, for a reference model, freezes) it; the ``train()``
        that follows then finds the model wrapped without its optimizer and cannot prepare it. So the
        engine ``train()`` would build is built here, with the Trainer's optimizer (created as
        ``train()`` creates it; Adam's state appears only at the first step): evaluation runs on the
        sharded model, and ``train()`` finds model and optimizer prepared, as on its second call.
        Stages 0-2 need nothing: Accelerate evaluates the whole model and ``train()`` prepares it later.
        """
        if not self.zero_enabled or self.accelerator._models or self.engine is not None:
            return
        zo = (self.args.zero_config_dict or {}).get("zero_optimization") or {}
        if int(zo.get("stage", 0) or 0) != 3:
            return
        self.create_optimizer()
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

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
        from hf_zero.hub.model_cards import record

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.save_pretrained(output_dir, merge_adapters=merge_adapters)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            with open(os.path.join(output_dir, "training_args.json"), "w") as f:
                f.write(self.args.to_json_string())
            record.update_record(output_dir, record.trainer_record(self, self.engine.train_state(), merged=merge_adapters),
                                 keep=record.TRAINER_FILLS_ONLY)
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
        from hf_zero.hub.model_cards import record
        from hf_zero.hub.model_cards.card import render_model_card
        from hf_zero.hub.transfer import _write_atomic

        folder = self.args.output_dir
        merged = bool(record.read_record(folder).get("merged_adapters"))  # as save_model left the folder
        state = self.engine.train_state() if self.engine is not None else None
        record.update_record(folder, record.trainer_record(self, state, merged=merged), keep=record.TRAINER_FILLS_ONLY)
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

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``save_total_limit`` counts complete checkpoints: while one is written in the background, one more stays.

        With ``checkpoint.async_save`` the engine's part of ``checkpoint-<step>`` is still being written when
        transformers rotates the old ones away at the end of this method; ``save_total_limit=1`` would then
        delete the last complete checkpoint, and a crash before the write ends would leave nothing to resume
        from. The rotation to the limit itself happens once the write is done (the next save, or the end of
        ``train()``).
        """
        limit = self.args.save_total_limit
        engine = self.engine if self.zero_enabled else None
        if not limit or limit <= 0 or engine is None or not engine.config.checkpoint_async_save:
            return super()._save_checkpoint(model, trial)
        self.args.save_total_limit = limit + 1
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit

    def _rotate_to_the_limit(self) -> None:
        """transformers' rotation of ``checkpoint-<step>`` folders with the real ``save_total_limit`` (rank 0)."""
        if not self.args.should_save or not self.args.save_total_limit:
            return
        run_dir = self._get_output_dir(trial=None)
        try:
            from transformers.trainer_utils import rotate_checkpoints
        except ImportError:  # transformers < 5: a Trainer method
            return self._rotate_checkpoints(use_mtime=False, output_dir=run_dir)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self.zero_enabled and self.engine is not None:
            self.engine.wait_for_checkpoint()  # (async_save) push the checkpoint whole
        return super()._push_from_checkpoint(checkpoint_folder)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self.zero_enabled:
            return super()._save_rng_state(output_dir)
        # the engine checkpoint carries every rank's RNG state (safetensors, not pickle)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self.zero_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # weights come back with the engine state once the engine exists (_load_optimizer_and_scheduler)
        if saved_by_deepspeed(resume_from_checkpoint):
            return
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_STATE_TAG)):
            raise UsageError(
                f"{resume_from_checkpoint} has no hf_zero resume state ('{ZERO_STATE_TAG}'); resume from a checkpoint "
                "that this Trainer saved with zero_config (save_only_model must be off)"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.zero_enabled or checkpoint is None or self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if saved_by_deepspeed(checkpoint):
            from hf_zero.checkpoint import deepspeed as ds_checkpoint

            with self.engine.resident_state():  # NVMe offload: the masters and state come out of their files for it
                progress = ds_checkpoint.resume_trainer(self.engine.train_state(), self.lr_scheduler, checkpoint)
            self.engine.restore_progress(progress)
            return None
        _, client = self.engine.load_checkpoint(checkpoint, tag=ZERO_STATE_TAG)
        if self.lr_scheduler is not None and client.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(client["lr_scheduler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self.zero_enabled or (checkpoint is not None and saved_by_deepspeed(checkpoint)):
            return super()._load_rng_state(checkpoint)  # transformers' rng_state_N.pth, read weights-only

    def _load_best_model(self) -> None:
        if not self.zero_enabled or self.engine is None:
            return super()._load_best_model()
        self.engine.load_checkpoint(self.state.best_model_checkpoint, tag=ZERO_STATE_TAG, load_module_only=True)


def zero_args(cls: type) -> type:
    """``cls`` (transformers' ``TrainingArguments`` or any dataclass subclass of it, e.g. TRL's ``SFTConfig``)
    with ``zero_config`` (and ``deepspeed=`` meaning the same), checked when built.

    The result is a dataclass whose fields are ``cls``'s plus ``zero_config``: combining the two by
    plain inheritance (``class C(hf_zero.TrainingArguments, SFTConfig)``) would keep the first
    parent's ``__init__``, which knows none of ``cls``'s own fields.
    """
    if not (isinstance(cls, type) and issubclass(cls, transformers.TrainingArguments)):
        raise TypeError(f"zero_args expects a subclass of transformers.TrainingArguments, got {cls!r}")
    if issubclass(cls, TrainingArguments):
        return cls
    made = type(cls.__name__, (TrainingArguments, cls), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                                           "__qualname__": cls.__qualname__})
    return dataclass(repr=False)(made)


def zero_trainer(cls: type) -> type:
    """``cls`` (transformers' ``Trainer`` or any subclass of it: TRL's ``SFTTrainer``, ``DPOTrainer``,
    ``RewardTrainer``, a user's own) training on hf_zero's engine when its arguments carry a ``zero_config``.

    hf_zero's :class:`Trainer` overrides only what the engine changes (the accelerator, optimizer and
    scheduler sections, saving and loading, a dead rank), each calling ``super()``; placed before
    ``cls`` in the method order, those calls reach ``cls``'s own behaviour (TRL's losses, collators,
    reference models) and then transformers'. Its arguments must come from :func:`zero_args`.
    """
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"zero_trainer expects a subclass of transformers.Trainer, got {cls!r}")
    if issubclass(cls, Trainer):
        return cls
    return type(cls.__name__, (Trainer, cls), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                               "__qualname__": cls.__qualname__})


@dataclass(repr=False)
class Seq2SeqTrainingArguments(TrainingArguments, transformers.Seq2SeqTrainingArguments):
    """transformers' ``Seq2SeqTrainingArguments`` (``predict_with_generate``, ...) plus ``zero_config``."""


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """transformers' ``Seq2SeqTrainer`` on a ZeRO engine: evaluation and prediction can generate.

    Under stage 3 a no-grad forward gathers and releases blocks as training does, keeping for the next decoding
    step only what fits under ``stage3_max_live_parameters`` (hf_zero/zero/inference.py); transformers passes
    ``synced_gpus`` (the stage-3 model asks for it, hf_zero/zero/attach.py), so ranks that finish at different
    lengths keep running forwards together until all are done.
    """
