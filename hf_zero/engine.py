"""ZeroEngine: DeepSpeed's engine API (forward, backward, step) over the ZeRO stage policies.

The engine wraps the user's module without renaming anything (``engine.module`` is the
user's object) and keeps DeepSpeed's accounting: ``step()`` is called after every
micro-batch and applies the optimizer only on a gradient-accumulation boundary; the loss is
divided by ``gradient_accumulation_steps`` in ``backward`` so that accumulated gradients are
the mean over the global batch, exactly as one process training on the whole batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hf_zero import dist as hz_dist
from hf_zero.config import ZeroConfig
from hf_zero.precision import LossScaler, NonFiniteLossError, reduce_dtype
from hf_zero.zero import collectives as C
from hf_zero.zero.partition import ShardedOptimizer
from hf_zero.zero.preshard import is_presharded, materialize_

logger = logging.getLogger("hf_zero")


def _ensure_log_handler() -> None:
    """Print the periodic ``steps_per_print`` line the way DeepSpeed does, unless logging is configured."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_zero] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class UsageError(ValueError):
    """The engine's API was called in a way that cannot mean anything."""


def _to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """Move tensors (nested in tuples, lists and mappings) to ``device``; cast floats if asked."""
    if torch.is_tensor(obj):
        if float_dtype is not None and obj.is_floating_point() and obj.dtype != float_dtype:
            return obj.to(device=device, dtype=float_dtype, non_blocking=True)
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(v, device, float_dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device, float_dtype) for v in obj)
    if isinstance(obj, Mapping):
        moved = {k: _to_device(v, device, float_dtype) for k, v in obj.items()}
        try:
            return type(obj)(moved)
        except Exception:
            return moved
    return obj


def _shape_of(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if torch.is_tensor(x) else f"a {type(x).__name__}"


class ZeroEngine(torch.nn.Module):
    """Training engine for ZeRO stages 0-2 with DeepSpeed's method names and semantics."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ZeroConfig,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _ensure_log_handler()
        self.module = model
        self.config = config
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.dp_world_size = self.world_size
        self.global_rank = dist.get_rank()
        self.local_rank = hz_dist.local_rank()
        self.device = hz_dist.get_device()
        self.compute_dtype = config.compute_dtype
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._global_grad_norm: torch.Tensor | None = None
        self._step_applied = False
        self._no_sync = False
        self._boundary_override: bool | None = None
        self._built_presharded = False
        self._clip_override: float | None = None
        self._norm_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # computed early by current_grad_norm
        self._compiled = False

        stage = config.zero_optimization.stage
        hz_dist.register_process()  # so that, should a peer die, the survivors can name it
        self._check_presharded(model, stage, optimizer)
        self._move_to_device()
        self._broadcast_module()
        self.loss_scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        self.zero_optimizer: ShardedOptimizer | None = None
        if optimizer is not None:
            bucket = int(config.zero_optimization.reduce_bucket_size)
            self.zero_optimizer = ShardedOptimizer(
                model,
                optimizer,
                stage=stage,
                compute_dtype=self.compute_dtype,
                reduce_dtype=reduce_dtype(config),
                bucket_numel=max(1, bucket),
                group=group,
                device=self.device,
                persistence_threshold=int(config.zero_optimization.stage3_param_persistence_threshold),
                prefetch_numel=int(config.zero_optimization.stage3_prefetch_bucket_size),
                max_live_numel=int(config.zero_optimization.stage3_max_live_parameters),
            )
        self._cast_remaining_params()
        if config.compile.enabled:  # before checkpointing, so the recomputation runs the compiled blocks too
            self.compile(config.compile.backend, config.compile.kwargs)
        if config.activation_checkpointing.get("checkpoint_blocks", False):
            self._checkpoint_blocks()
        if self._built_presharded and self.device.type == "cuda":
            # The zero.Init slices were freed while the shards were laid out around them; hand those
            # blocks back so training's allocations start from unfragmented memory.
            torch.cuda.empty_cache()
        self.optimizer = self.zero_optimizer
        self.basic_optimizer = optimizer
        self.lr_scheduler = lr_scheduler

    # ------------------------------------------------------------- setup

    def compile(self, backend: str | Any = "inductor", compile_kwargs: dict | None = None) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` each block of the model (see :mod:`hf_zero.compile`).

        Blocks, not the whole model, so the ZeRO hooks stay outside the graphs; the config's
        ``compile`` section does the same at ``initialize``.
        """
        from hf_zero.compile import compile_blocks

        self._no_kv_cache_in_training("compile")
        if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
            raise UsageError(f"engine.compile(compile_kwargs=...) expects a dict of torch.compile arguments, got {type(compile_kwargs).__name__}")
        if compile_blocks(self.module, backend, compile_kwargs) == 0 and not self._compiled:
            raise UsageError(f"engine.compile(): {type(self.module).__name__} has no blocks to compile")
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether the blocks run compiled (DeepSpeed's property of the same name)."""
        return self._compiled

    def _no_kv_cache_in_training(self, why: str) -> None:
        """Turn a transformers model's ``config.use_cache`` off, as transformers does under gradient checkpointing.

        A KV cache filled while training is dead weight; its writes inside a recomputed block stop
        torch.compile from capturing the block, and its per-layer index makes dynamo compile each
        block separately (past ``torch._dynamo.config.cache_size_limit`` blocks, silently eager).
        ``generate`` passes ``use_cache`` itself, so decoding still caches.
        """
        mc = getattr(self.module, "config", None)
        if getattr(mc, "use_cache", False):
            logger.info("%s: setting the model's config.use_cache to False", why)
            mc.use_cache = False

    def _checkpoint_blocks(self) -> None:
        """Recompute each block's forward in backward instead of keeping its activations.

        The block's ``forward`` (not its ``__call__``) is wrapped, so stage 3's hooks run once per
        call as usual and the recomputation happens while backward has the block gathered.
        """
        from torch.utils.checkpoint import checkpoint

        from hf_zero.zero.params import find_units

        self._no_kv_cache_in_training("activation_checkpointing.checkpoint_blocks")
        for _, block in find_units(self.module):
            inner = block.forward

            def forward(*args: Any, _inner: Any = inner, _block: torch.nn.Module = block, **kwargs: Any) -> Any:
                if _block.training and torch.is_grad_enabled():
                    return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
                return _inner(*args, **kwargs)

            block.forward = forward

    def _check_presharded(self, model: torch.nn.Module, stage: int, optimizer: torch.optim.Optimizer | None) -> None:
        """A model built under ``zero.Init`` must be trained on the ranks that built it.

        Stages 0-2 and engines without an optimizer need whole parameters: they are gathered here.
        """
        pre = [p for p in model.parameters() if is_presharded(p)]
        self._built_presharded = bool(pre)
        if not pre:
            return
        built = pre[0].hf_zero_preshard.world_size
        if built != self.world_size:
            raise UsageError(
                f"the model was built under hf_zero.zero.Init on {built} ranks but the engine runs on "
                f"{self.world_size}; build it with the same data-parallel group as initialize()"
            )
        if stage != 3 or optimizer is None:
            materialize_(pre, self.device)

    def _move_to_device(self) -> None:
        """``module.to(device)``, leaving parameters that only exist as ``zero.Init`` slices alone."""
        if not any(is_presharded(p) for p in self.module.parameters()):
            self.module.to(self.device)
            return
        with torch.no_grad():
            for m in self.module.modules():
                for p in m._parameters.values():
                    if p is not None and not is_presharded(p) and p.device != self.device:
                        p.data = p.data.to(self.device)
                for key, b in m._buffers.items():
                    if b is not None and b.device != self.device:
                        m._buffers[key] = b.to(self.device)

    def _broadcast_module(self) -> None:
        """Start every rank from rank 0's weights and buffers, as DeepSpeed does.

        ``zero.Init`` slices are consistent by construction (cut from rank 0's values or read from
        the same files) and are not broadcast.
        """
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                if not is_presharded(t):
                    C.broadcast_(t.data, src, self.group, self.world_size)

    def _cast_remaining_params(self) -> None:
        """Frozen floating parameters follow the compute dtype too (trainable ones already do)."""
        if self.compute_dtype == torch.float32:
            return
        with torch.no_grad():
            for p in self.module.parameters():
                if p.is_floating_point() and p.dtype != self.compute_dtype:
                    p.data = p.data.to(self.compute_dtype)

    # ----------------------------------------------------- DeepSpeed API

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler else 1.0

    loss_scale = cur_scale

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the coming ``step()`` applies the optimizer (DeepSpeed's definition)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let a caller (Accelerate, a custom loop) decide where the boundary is."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip gradient communication; a later one outside reduces all."""
        if self.zero_optimization_stage() == 3:
            raise UsageError(
                "engine.no_sync() cannot be used with ZeRO stage 3, which must reduce-scatter gradients on every "
                "micro-step; use stage 0-2 or drop no_sync()"
            )
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.zero_optimizer.param_groups] if self.zero_optimizer else []

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's ``betas``, SGD's ``momentum`` (DeepSpeed's ``get_mom``)."""
        if not self.zero_optimizer:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.zero_optimizer.param_groups]

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """The dtype the model computes in and the dtype gradients are averaged in."""
        return self.compute_dtype, reduce_dtype(self.config)

    @property
    def mp_world_size(self) -> int:
        """Model (tensor) parallel degree: hf_zero has none, so 1, as DeepSpeed reports without an mpu."""
        return 1

    def empty_partition_cache(self) -> None:
        """Stage 3: release the blocks that no-grad forwards (evaluation, ``generate``) left gathered."""
        zo = self.zero_optimizer
        if zo is not None and zo.runtime is not None:
            zo.runtime.release_inference()

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged gradients before clipping, at the last applied step."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def set_clip_for_next_step(self, max_norm: float) -> None:
        """Clip the next applied step at ``max_norm`` (how Accelerate's ``clip_grad_norm_`` reaches the engine)."""
        self._clip_override = max_norm

    def current_grad_norm(self) -> torch.Tensor | None:
        """Global L2 norm of the reduced, unscaled gradients now (between the boundary backward and step)."""
        zo = self.zero_optimizer
        if zo is None or not zo.reduced or not self.is_gradient_accumulation_boundary():
            return None  # (stage 2 has reduced the micro-steps so far, but the step's gradient is not whole)
        if self._norm_stats is None:  # the step reuses it: one norm, one all-reduce per step
            self._norm_stats = zo.grad_norm_and_overflow(need_overflow=self.loss_scaler is not None)
        return self._norm_stats[0] / (self.loss_scaler.scale if self.loss_scaler is not None else 1.0)

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ------------------------------------------------------------ step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cast = self.compute_dtype if self.compute_dtype != torch.float32 else None
        args = _to_device(args, self.device, cast)
        kwargs = _to_device(kwargs, self.device, cast)
        if self.world_size == 1:
            return self.module(*args, **kwargs)
        with hz_dist.peer_failure_guard("forward"):  # stage 3 gathers parameters here
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of the micro-batch loss, scaled for accumulation (and fp16)."""
        if self.world_size == 1:
            return self._backward(loss, retain_graph, scale_wrt_gas)
        with hz_dist.peer_failure_guard(f"backward of step {self.global_steps}"):
            return self._backward(loss, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> torch.Tensor:
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise UsageError(
                f"engine.backward(loss) needs a scalar loss but got {_shape_of(loss)}; reduce it first, "
                "e.g. loss = torch.nn.functional.cross_entropy(outputs, labels) or outputs.mean()"
            )
        if not loss.requires_grad:
            raise UsageError(
                "engine.backward(loss) got a loss that does not require grad; compute it from the output "
                "of engine(...) outside torch.no_grad()"
            )
        if self.zero_optimizer is None:
            raise UsageError("engine.backward() needs an optimizer; give one in the config or to initialize()")
        scaled = loss.float()
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        zo = self.zero_optimizer
        sync = not self._no_sync and (self.is_gradient_accumulation_boundary() or zo.reduces_every_micro_step)
        zo.prepare_backward(sync)
        scaled.reshape(()).backward(retain_graph=retain_graph)
        self.zero_optimizer.finish_backward()
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Called after every micro-batch; applies the optimizer on accumulation boundaries."""
        del lr_kwargs
        if self.zero_optimizer is None:
            raise UsageError("engine.step() needs an optimizer; give one in the config or to initialize()")
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            if self.world_size == 1:
                self._take_model_step()
            else:
                with hz_dist.peer_failure_guard(f"step {self.global_steps}"):
                    self._take_model_step()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        self._boundary_override = None

    def _take_model_step(self) -> None:
        zo = self.zero_optimizer
        assert zo is not None
        if not zo.reduced:
            raise UsageError(
                "engine.step() reached an accumulation boundary but the gradients were never reduced across "
                "ranks (every backward ran inside engine.no_sync()); run the boundary's backward outside no_sync()"
            )
        scaler = self.loss_scaler
        stats, self._norm_stats = self._norm_stats, None
        clip = self._clip_override if self._clip_override is not None else self.gradient_clipping()
        if stats is None and scaler is None and clip <= 0 and self.config.nonfinite_loss == "off":
            # Nothing reads the norm: skip its pass over every gradient shard (as plain torch
            # does without clipping); get_global_grad_norm() is then None for this step.
            self._clip_override = None
            self._global_grad_norm = None
            self._apply_step(zo, 1.0, None, 1.0)
            return
        norm, bad = stats if stats is not None else zo.grad_norm_and_overflow(need_overflow=scaler is not None)
        scale = scaler.scale if scaler is not None else 1.0
        if scaler is not None and bool(bad > 0):  # fp16 needs this one host sync per step
            scaler.update(True)  # raises once the scale is already at min_loss_scale
            self._skip_step(f"fp16 gradient overflow, step skipped; loss scale now {scaler.scale:g}")
            return
        if scaler is None and self.config.nonfinite_loss != "off" and not bool(torch.isfinite(norm)):
            # bf16/fp32: one host sync per optimizer step (fp16 already has one, above). The global
            # norm is the same number on every rank, so every rank reaches the same verdict.
            if self.config.nonfinite_loss == "stop":
                raise NonFiniteLossError(
                    f"step {self.global_steps}: the loss or gradients are not finite (global gradient norm "
                    f"{float(norm)}); stopping before the optimizer touched anything, as \"nonfinite_loss\" is "
                    '"stop" (set it to "skip" to skip such steps instead)'
                )
            self._skip_step(
                f"the loss or gradients are not finite (global gradient norm {float(norm)}); step skipped, weights "
                f"and optimizer state unchanged ({self.skipped_steps + 1} skipped so far; \"nonfinite_loss\": \"stop\" "
                "stops instead)"
            )
            return
        norm = norm / scale
        self._global_grad_norm = norm
        coef: torch.Tensor | float = 1.0 / scale
        self._clip_override = None
        if clip > 0:
            coef = (clip / (norm + 1e-6)).clamp(max=1.0) / scale
        self._apply_step(zo, coef, scaler, scale)

    def _apply_step(self, zo: Any, coef: torch.Tensor | float, scaler: Any, scale: float) -> None:
        """Unscale/clip, step the optimizer on the shards, publish the weights, and count the step."""
        zo.scale_grads(coef)
        zo.step_and_publish()
        if scaler is not None:
            scaler.update(False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        zo.zero_grad()
        self._step_applied = True
        self.global_steps += 1
        if self.global_rank == 0 and self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0:
            lrs = ", ".join(f"{lr:.3e}" for lr in self.get_lr())
            extra = f", loss_scale={scale:g}" if scaler is not None else ""
            logger.info("step=%d, skipped=%d, lr=[%s]%s", self.global_steps, self.skipped_steps, lrs, extra)

    def _skip_step(self, why: str) -> None:
        """A step whose gradients cannot be applied (fp16 overflow, or inf/nan): count it, drop the gradients."""
        assert self.zero_optimizer is not None
        self._clip_override = None
        self.zero_optimizer.zero_grad()
        self.skipped_steps += 1
        logger.warning("step %d: %s", self.global_steps, why)
        self.global_steps += 1

    def zero_grad(self) -> None:
        self._norm_stats = None
        if self.zero_optimizer is not None:
            self.zero_optimizer.zero_grad()

    # ------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
        exclude_frozen_parameters: bool = False, keep_last: int | None = None,
    ) -> str:
        """Write a resume checkpoint (every rank calls this); ``tag`` defaults to ``global_step<N>``.

        The checkpoint loads at any world size and ZeRO stage; see :mod:`hf_zero.checkpoint.sharded`.
        ``keep_last=N`` (default: the config's ``checkpoint.keep_last``; None keeps all) deletes
        all but the N newest checkpoints in ``save_dir`` once this one is complete and ``latest``
        points at it; the one ``latest`` names is never deleted.
        """
        from hf_zero.checkpoint import sharded

        if exclude_frozen_parameters:
            raise UsageError("save_checkpoint(exclude_frozen_parameters=True) is not supported yet; leave it False")
        if keep_last is None:
            keep_last = self.config.checkpoint_keep_last
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise UsageError(f"save_checkpoint(keep_last=...): got {keep_last!r}, expected an integer >= 1 (or None to keep all)")
        with hz_dist.peer_failure_guard("save_checkpoint"):
            return sharded.save(self, save_dir, tag, client_state, save_latest=save_latest, keep_last=keep_last)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str, dict]:
        """Restore a checkpoint written by ``save_checkpoint`` at any world size and stage.

        A DeepSpeed checkpoint folder (ZeRO 0-3) is recognised and read as it is
        (``checkpoint/deepspeed.py``). Returns ``(path, client_state)`` as DeepSpeed does.
        """
        from hf_zero.checkpoint import deepspeed as ds_checkpoint
        from hf_zero.checkpoint import sharded

        if not load_module_strict:
            raise UsageError("load_checkpoint(load_module_strict=False) is not supported yet; the model must match the checkpoint")
        if custom_load_fn is not None:
            raise UsageError("load_checkpoint(custom_load_fn=...) is not supported; checkpoints are read as safetensors")
        with hz_dist.peer_failure_guard("load_checkpoint"):
            if ds_checkpoint.is_deepspeed_checkpoint(load_dir, tag):
                return ds_checkpoint.load(
                    self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                )
            return sharded.load(
                self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            )

    def save_pretrained(
        self, save_directory: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
        merge_adapters: bool = False,
    ) -> list[str]:
        """The model's full weights in Hugging Face's layout (every rank calls this; rank 0 writes).

        ``dtype`` defaults to the dtype the module holds (the compute dtype); stage-3 units are
        gathered one at a time. The folder loads with ``from_pretrained``. A peft ``PeftModel``
        is saved as peft saves it (``adapter_model.safetensors`` + ``adapter_config.json``, only
        the adapters gathered), or with ``merge_adapters=True`` as full weights with the adapters
        merged in (see :mod:`hf_zero.integrations.peft`). The folder also records how the model
        was trained, for its model card (:mod:`hf_zero.model_cards`).
        """
        from hf_zero.integrations import peft as hz_peft
        from hf_zero.model_cards import record

        if merge_adapters:
            files = hz_peft.save_merged(self, save_directory, max_shard_size=max_shard_size, dtype=dtype)
        elif hz_peft.is_peft_model(self.module):
            files = hz_peft.save_adapters(self, save_directory, dtype=dtype)
        else:
            from hf_zero.checkpoint import consolidated

            files = consolidated.save_pretrained(self, save_directory, max_shard_size=max_shard_size, dtype=dtype)
        record.write_engine_record(self, save_directory, merged=merge_adapters)
        return files

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """The whole model's state dict in its compute dtype, in one file (every rank calls this; rank 0 writes).

        DeepSpeed's method writes ``pytorch_model.bin``, a pickle; hf_zero writes safetensors only,
        so the default name is ``model.safetensors`` and a ``.bin`` name is refused. Stage-3 blocks
        are gathered one at a time (no ``stage3_gather_16bit_weights_on_model_save`` needed).
        Tied weights are written once, under their first name. Returns True, as DeepSpeed does.
        """
        from hf_zero.checkpoint import consolidated

        if not str(save_filename).endswith(".safetensors"):
            raise UsageError(
                f"save_16bit_model(save_filename={save_filename!r}): hf_zero writes safetensors only (a pickled .bin "
                "can run code when loaded); pass a name ending in .safetensors, such as 'model.safetensors'"
            )
        consolidated.save_single_file(self, save_dir, save_filename, exclude_frozen=exclude_frozen_parameters)
        return True

    save_fp16_model = save_16bit_model

    def push_to_hub(
        self,
        repo_id: str,
        save_directory: str,
        *,
        revision: str | None = None,
        private: bool | None = None,
        commit_message: str | None = None,
        token: str | None = None,
        include_resume_state: bool = False,
        card_kwargs: dict | None = None,
    ) -> str | None:
        """Consolidate into ``save_directory`` and upload it (every rank calls this; rank 0 uploads).

        The model card records this engine's resolved ZeRO config and hardware (from what
        ``save_pretrained`` wrote in the folder); with ``include_resume_state`` the resume
        checkpoints saved in the same folder (``save_checkpoint(save_directory)``) go too, so a run
        can be picked up elsewhere with ``hf-zero pull`` and ``load_checkpoint``. Returns the commit
        URL on rank 0.
        """
        from hf_zero import hub

        self.save_pretrained(save_directory)
        url, failure, error = None, None, None
        if self.global_rank == 0:
            kwargs = dict(card_kwargs or {})
            from hf_zero.model_cards import record

            if not record.read_record(save_directory):  # a save that records nothing (a pipeline's): show the config
                kwargs.setdefault("zero_config", self.config.raw)
            try:
                url = hub.push_to_hub(
                    save_directory, repo_id, revision=revision, private=private, commit_message=commit_message,
                    token=token, include_resume_state=include_resume_state, card_kwargs=kwargs,
                )
            except Exception as e:  # every rank learns of it, instead of waiting for rank 0 in a barrier
                failure, error = e, str(e) if isinstance(e, hub.HubError) else f"{type(e).__name__}: {e}"
        if self.world_size > 1:
            error = hz_dist.gather_json(error, self.group)[0]
        if failure is not None:
            raise failure
        if error is not None:
            raise hub.HubError(f"rank 0 could not push: {error}")
        return url

    # --------------------------------------------------------- helpers

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        if self.zero_optimizer is None:
            return {"params": sum(p.numel() * p.element_size() for p in self.module.parameters()), "grads": 0, "optim": 0}
        return self.zero_optimizer.memory_bytes()

    def __repr__(self) -> str:
        return f"ZeroEngine(stage={self.zero_optimization_stage()}, world_size={self.world_size}, module={self.module.__class__.__name__})"

