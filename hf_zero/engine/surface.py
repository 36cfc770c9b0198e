"""DeepSpeed's engine surface around the step: its getters, and its names for the engine's collaborators.

DeepSpeed scripts, Accelerate and transformers ask an engine many small questions (``train_batch_size()``,
``zero_optimization_stage()``, ``bfloat16_enabled()``, ``get_lr()``, ``engine.config`` of the wrapped
model, ...) and call it by DeepSpeed's names for jobs that are not the step (``save_checkpoint``,
``load_checkpoint``, ``save_16bit_model``, ``wait_for_checkpoint``, ...). Those live here, in
:class:`DeepSpeedSurface`, a base class of ``ZeroEngine``: the getters only read what the engine set up,
and the saves and loads are one-line calls into the engine's ``Persistence`` (``persistence.py``) and
``LongRuns`` (``long_runs.py``), so the engine class itself keeps the step. An attribute none of them has
is the wrapped module's (:meth:`DeepSpeedSurface.__getattr__`), as on DeepSpeed's engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hf_zero.errors import UsageError
from hf_zero.precision.policies import reduce_dtype
from hf_zero.training.module_setup import no_kv_cache_in_training
from hf_zero.zero import collectives as C

if TYPE_CHECKING:
    from hf_zero.checkpoint.ranks import CheckpointLayout
    from hf_zero.config import ZeroConfig
    from hf_zero.engine.long_runs import LongRuns
    from hf_zero.engine.persistence import Persistence
    from hf_zero.parallel import ParallelGrid
    from hf_zero.parallel.tensor_parallel import TensorParallelGroups
    from hf_zero.precision.policies import LossScaler
    from hf_zero.zero.optimizer import ShardedOptimizer


class DeepSpeedSurface:
    """The questions a DeepSpeed engine answers without running anything (batch arithmetic, dtypes, the stage,
    learning rates, the grid's degrees, the last step's norm) and DeepSpeed's names for saves, loads and the
    preemption signal. Mixed into ``ZeroEngine`` ahead of ``torch.nn.Module``, so :meth:`__getattr__` sees the
    module's own lookup first."""

    # What the engine sets in its __init__ (hf_zero/engine/zero_engine.py); only read here.
    module: torch.nn.Module
    config: ZeroConfig
    grid: ParallelGrid | None
    world_size: int
    compute_dtype: torch.dtype
    loss_scaler: LossScaler | None
    zero_optimizer: ShardedOptimizer | None
    _sp_view: Any
    _tp_view: TensorParallelGroups | None
    _global_grad_norm: torch.Tensor | None
    _step_applied: bool
    _compiled: bool
    persistence: Persistence
    long_runs: LongRuns

    if TYPE_CHECKING:  # TrainStateSource's (train_state.py), beside this class in the engine's bases

        def checkpoint_layout(self) -> CheckpointLayout: ...

    # ----------------------------------------------------- the config

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """The dtype the model computes in and the dtype gradients are averaged in."""
        return self.compute_dtype, reduce_dtype(self.config)

    def steps_per_print(self) -> int | None:
        """How often the engine logs its step line (None: never)."""
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """Whether forward, backward and step are timed (``hf_zero/training/timers.py``)."""
        return bool(self.config.wall_clock_breakdown)

    def fp16_auto_cast(self) -> bool:
        """Whether ``engine(...)`` casts floating inputs to fp16 (``fp16.auto_cast``)."""
        return bool(self.config.fp16.auto_cast)

    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's: ``fp16.loss_scale`` is 0, the scale moves with overflows (read even with fp16 off, as there)."""
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """``2 ** fp16.initial_scale_power``: where a dynamic loss scale starts."""
        return 2 ** int(self.config.fp16.initial_scale_power)

    def torch_autocast_enabled(self) -> bool:
        return bool(self.config.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """``torch_autocast.dtype`` (None: torch's default for the device)."""
        return self.config.autocast_dtype

    def optimizer_params(self) -> dict | None:
        """The config's ``optimizer.params`` (None without an ``optimizer`` section)."""
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    # ----------------------------------------------------- the ZeRO section

    def zero_reduce_bucket_size(self) -> int:
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_prefetch_bucket_size(self) -> int:
        return int(self.config.zero_optimization.stage3_prefetch_bucket_size)

    def zero_param_persistence_threshold(self) -> int:
        return int(self.config.zero_optimization.stage3_param_persistence_threshold)

    def zero_max_live_parameters(self) -> int:
        return int(self.config.zero_optimization.stage3_max_live_parameters)

    def zero_max_reuse_distance(self) -> int:
        return int(self.config.zero_optimization.stage3_max_reuse_distance)

    def zero_ignore_unused_parameters(self) -> bool:
        return bool(self.config.zero_optimization.ignore_unused_parameters)

    def zero_optimization_partition_gradients(self) -> bool:
        """Stage 2 and up: each rank keeps only the gradient shard it steps."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Stage 3: the parameters themselves are sharded."""
        return self.zero_optimization_stage() >= 3

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state waits in host memory (``offload_optimizer.device`` "cpu")."""
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether the optimizer state waits on NVMe (``offload_optimizer.device`` "nvme")."""
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "nvme"

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler else 1.0

    loss_scale = cur_scale

    # ----------------------------------------------------- the grid

    @property
    def dp_world_size(self) -> int:
        """The data-parallel degree: what batch sizes and samplers count (the grid's ``dp_replicate x dp_shard``)."""
        return self.grid.dp_size if self.grid is not None else 1

    @property
    def mp_world_size(self) -> int:
        """The model-parallel (tensor-parallel) degree: the grid's ``tp`` axis, 1 without tensor parallelism."""
        return self.grid.size("tp") if self.grid is not None else 1

    @property
    def sequence_parallel_groups(self) -> Any:
        """The grid's ``sp`` axis (``hf_zero/sequence/groups.py``), None without sequence parallelism."""
        return self._sp_view

    @property
    def tensor_parallel_groups(self) -> TensorParallelGroups | None:
        """The grid's ``tp`` axis (``hf_zero/parallel/tensor_parallel.py``), None without tensor parallelism."""
        return self._tp_view

    # ----------------------------------------------------- the optimizer and the last step

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.zero_optimizer.param_groups] if self.zero_optimizer else []

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's ``betas``, SGD's ``momentum`` (DeepSpeed's ``get_mom``)."""
        if not self.zero_optimizer:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.zero_optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged gradients before clipping, at the last applied step."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def is_compiled(self) -> bool:
        """Whether the blocks run compiled (DeepSpeed's property of the same name)."""
        return self._compiled

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        if self.zero_optimizer is None:
            return {"params": sum(p.numel() * p.element_size() for p in self.module.parameters()), "grads": 0, "optim": 0}
        return self.zero_optimizer.memory_bytes()

    # ----------------------------------------------------- DeepSpeed's calls the layers below answer

    def empty_partition_cache(self) -> None:
        """Stage 3: release the blocks that no-grad forwards (evaluation, ``generate``) left gathered."""
        if self.zero_optimizer is not None:
            self.zero_optimizer.release_inference()

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """DeepSpeed's: finish reducing this backward's gradients. ``engine.backward`` already did (and waited, as
        DeepSpeed's backward calls this itself): at stages 2-3 on every micro-step, at stages 0-1 at the boundary,
        so a call after it changes nothing. ``bucket_size`` is DeepSpeed's; hf_zero's buckets are the config's."""
        del bucket_size
        if self.zero_optimizer is not None:
            C.wait_for(self.zero_optimizer.comm_stream)

    # ----------------------------------------------------- compiling the blocks

    def compile(self, backend: str | Any = "inductor", compile_kwargs: dict | None = None) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` each block of the model (see :mod:`hf_zero.training.compile`).

        Blocks, not the whole model, so the ZeRO hooks stay outside the graphs; the config's
        ``compile`` section does the same at ``initialize``.
        """
        from hf_zero.training.compile import compile_blocks

        no_kv_cache_in_training(self.module, "compile")
        if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
            raise UsageError(f"engine.compile(compile_kwargs=...) expects a dict of torch.compile arguments, got {type(compile_kwargs).__name__}")
        if compile_blocks(self.module, backend, compile_kwargs) == 0 and not self._compiled:
            raise UsageError(f"engine.compile(): {type(self.module).__name__} has no blocks to compile")
        self._compiled = True

    # ----------------------------------------------------- long runs: the engine's LongRuns (long_runs.py)

    def preemption_signal(self) -> int | None:
        """The signal every rank agreed to stop on (``checkpoint.save_on_signal``), or None.

        Set by the accumulation-boundary ``step()`` at which the ranks decided, the same step on every
        rank. With ``save_on_preemption`` left True the engine has already saved and exited by then;
        an owner that saves its own way (hf_zero's Trainer) reads it after each step.
        """
        return self.long_runs.signal()

    # ----------------------------------------------------- saves and loads: the engine's Persistence (persistence.py)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for the checkpoint being written in the background (``checkpoint.async_save``).

        Returns its path, or None when none was in flight; its error, if the write failed on any rank,
        is raised here on every rank (every rank calls this at the same point). ``save_checkpoint``,
        ``load_checkpoint``, ``destroy()`` and a preemption wait on their own; the process's end waits
        for it too.
        """
        return self.persistence.wait()

    @property
    def _background(self) -> Any:
        """The background writer of ``checkpoint.async_save`` (None before the first such save)."""
        return self.persistence.background

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        keep_last: int | None = None) -> str:
        """Write a resume checkpoint (every rank calls this): :meth:`Persistence.save_checkpoint`."""
        return self.persistence.save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                                keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str, dict]:
        """Restore a checkpoint at any world size and stage (also DeepSpeed's): :meth:`Persistence.load_checkpoint`."""
        return self.persistence.load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                                load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: str | int, expp_rank: int | None = None) -> str:
        """DeepSpeed's name of the file holding a rank's optimizer state: :meth:`Persistence.optimizer_ckpt_name`."""
        return self.persistence.optimizer_ckpt_name(checkpoints_path, tag, expp_rank)

    def save_pretrained(self, save_directory: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                        merge_adapters: bool = False) -> list[str]:
        """The full weights in Hugging Face's layout (every rank calls this): :meth:`Persistence.save_pretrained`."""
        return self.persistence.save_pretrained(save_directory, max_shard_size, dtype, merge_adapters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The state dict in the compute dtype, in one file (every rank calls this): :meth:`Persistence.save_16bit_model`."""
        return self.persistence.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

    def push_to_hub(self, repo_id: str, save_directory: str, *, revision: str | None = None,
                    private: bool | None = None, commit_message: str | None = None, token: str | None = None,
                    include_resume_state: bool = False, card_kwargs: dict | None = None) -> str | None:
        """``save_pretrained`` into ``save_directory`` and upload it (every rank calls this): :meth:`Persistence.push_to_hub`."""
        return self.persistence.push_to_hub(repo_id, save_directory, revision=revision, private=private,
                                            commit_message=commit_message, token=token,
                                            include_resume_state=include_resume_state, card_kwargs=card_kwargs)

    # ----------------------------------------------------- the wrapped module's attributes

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine lacks is the wrapped module's, as on DeepSpeed's engine.

        Scripts written for DeepSpeed read their model's own attributes through the engine
        (``engine.config`` of a transformers model, ``engine.id``, a custom ``engine.generate``); the engine's
        own attributes, parameters and submodules come first (``torch.nn.Module``'s lookup).
        """
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # torch.nn.Module's, next in the engine's MRO
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and not name.startswith("__"):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    def __repr__(self) -> str:
        return (f"ZeroEngine(stage={self.zero_optimization_stage()}, world_size={self.world_size}, "
                f"module={self.module.__class__.__name__})")
