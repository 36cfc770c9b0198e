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
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_zero import dist as hz_dist
from hf_zero.checkpoint.ranks import CheckpointLayout
from hf_zero.checkpointing import checkpoint_blocks
from hf_zero.config import ZeroConfig
from hf_zero.data import to_device
from hf_zero.errors import UsageError
from hf_zero.module_setup import broadcast_module, cast_frozen_params, check_presharded, move_to_device
from hf_zero.precision import loss_scaler_for, reduce_dtype
from hf_zero.step import NormScope, StepPolicy
from hf_zero.tensor_parallel import TensorParallelGroups
from hf_zero.timers import StepTimers
from hf_zero.tp_split import split_of
from hf_zero.zero.offload import host_step_threads
from hf_zero.zero.partition import ShardedOptimizer

logger = logging.getLogger("hf_zero")


def _ensure_log_handler() -> None:
    """Print the periodic ``steps_per_print`` line the way DeepSpeed does, unless logging is configured."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_zero] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _shape_of(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if torch.is_tensor(x) else f"a {type(x).__name__}"


class _NoOptimizer:
    """The optimizer of a frozen stage-3 model: no parameter groups, so the shard layout holds only frozen groups."""

    def __init__(self) -> None:
        self.param_groups: list[dict] = []
        self.state: dict = {}


class ZeroEngine(torch.nn.Module):
    """Training engine for ZeRO stages 0-3 with DeepSpeed's method names and semantics.

    The stages are policies of one ``ShardedOptimizer`` (``hf_zero/zero/partition.py``) over shard
    groups; one step policy (``hf_zero/step.py``) decides each optimizer step; checkpoints are
    ``hf_zero/checkpoint``'s. A ``PipelineEngine`` is this engine over one pipeline stage.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ZeroConfig,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
        group: dist.ProcessGroup | None = None,
        tensor_parallel: TensorParallelGroups | None = None,
    ) -> None:
        """``group``: the ranks ZeRO shards over (None: the world). Under tensor parallelism
        (``tensor_parallel``, the model already split by ``hf_zero/tensor_parallel.py``) it is the
        data-parallel group of this rank's slices, and the norm and checkpoints span the whole grid."""
        super().__init__()
        _ensure_log_handler()
        self.module = model
        self.config = config
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.dp_world_size = self.world_size
        self.tensor_parallel_groups = tensor_parallel
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
        self._compiled = False

        stage = config.zero_optimization.stage
        hz_dist.register_process()  # so that, should a peer die, the survivors can name it
        # A stage-3 model with nothing to train (a reference model, a teacher) is sharded all the same:
        # its layout is built over an optimizer with no parameter groups, and it only runs forward.
        self.inference_only = optimizer is None and stage == 3 and not any(p.requires_grad for p in model.parameters())
        if self.inference_only:
            optimizer = _NoOptimizer()
        # A zero.Init model stays as slices only where stage 3 with an optimizer lays out its shards.
        built_presharded = check_presharded(model, self.world_size, self.device, gather=stage != 3 or optimizer is None)
        move_to_device(model, self.device)
        broadcast_module(model, group)
        self.loss_scaler = loss_scaler_for(config)
        self.timers = StepTimers(config.wall_clock_breakdown, self.device)
        # Clip, loss scale, the non-finite rule and the global norm (over this engine's group; a
        # pipeline widens the scope to its stages): one policy for every engine (hf_zero/step.py).
        self.step_policy = StepPolicy(
            scaler=self.loss_scaler, nonfinite=config.nonfinite_loss, device=self.device,
            scope=self._norm_scope(),
        )
        if self.timers.enabled:
            self.step_policy.timed = self.timers.add
        self.zero_optimizer = self._sharded_optimizer(optimizer) if optimizer is not None else None
        cast_frozen_params(model, self.compute_dtype)
        if config.compile.enabled:  # before checkpointing, so the recomputation runs the compiled blocks too
            self.compile(config.compile.backend, config.compile.kwargs)
        if config.activation_checkpointing.get("checkpoint_blocks", False):
            self._no_kv_cache_in_training("activation_checkpointing.checkpoint_blocks")
            # DeepSpeed's cpu_checkpointing: the block input kept for the recomputation waits in host memory
            checkpoint_blocks(self.module, offload=bool(config.activation_checkpointing.get("cpu_checkpointing", False)),
                              keep_attention=config.activation_checkpointing.get("keep_attention", "auto"))
        if built_presharded and self.device.type == "cuda":
            # The zero.Init slices were freed while the shards were laid out around them; hand those
            # blocks back so training's allocations start from unfragmented memory.
            torch.cuda.empty_cache()
        if self.inference_only and self.zero_optimizer.runtime is not None:
            self.zero_optimizer.runtime.keep_gathered_for_inference = False
        self.optimizer = self.zero_optimizer if not self.inference_only else None
        self.basic_optimizer = optimizer if not self.inference_only else None
        self.lr_scheduler = lr_scheduler

    # ------------------------------------------------------------- setup

    def _norm_scope(self) -> NormScope:
        """The ranks the global norm sums over: this engine's group, or under tensor parallelism the whole grid."""
        tp = self.tensor_parallel_groups
        if tp is None:
            return NormScope(self.group, self.world_size, replicas=self.world_size)
        return NormScope(tp.parent, tp.dp_size * tp.tp_size, replicas=tp.dp_size, tp=tp.tp_size)

    def _sharded_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """The ZeRO stage of the config over ``optimizer``, sharded over this engine's group; every knob from the config."""
        zc = self.config.zero_optimization
        off = zc.offload_optimizer
        offload_pin = bool(off.pin_memory) if off is not None and off.device == "cpu" and not self.inference_only else None
        par = zc.offload_param  # stage 3 only (the config names it as ignored at the others)
        param_offload_pin = bool(par.pin_memory) if par is not None and par.device == "cpu" and zc.stage == 3 else None
        host_threads = None
        if offload_pin is not None:
            host_threads, why = host_step_threads(None, off.cpuadam_cores_perc)
            if self.timers.enabled:
                self.timers.note("step.cpu_optimizer", f"{host_threads} threads")
                if self.global_rank == 0:
                    logger.info("offload: the host optimizer step runs on %d threads per rank (%s)", host_threads, why)
        return ShardedOptimizer(
            self.module, optimizer, stage=zc.stage, compute_dtype=self.compute_dtype,
            reduce_dtype=reduce_dtype(self.config), bucket_numel=max(1, int(zc.reduce_bucket_size)), group=self.group,
            device=self.device, persistence_threshold=int(zc.stage3_param_persistence_threshold),
            prefetch_numel=int(zc.stage3_prefetch_bucket_size), max_live_numel=int(zc.stage3_max_live_parameters),
            offload_pin=offload_pin, master_dtype=self.config.master_dtype, param_offload_pin=param_offload_pin,
            overlap_param_gather=zc.overlap_param_gather, host_threads=host_threads,
        )

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
        if self.zero_optimizer is not None:
            self.zero_optimizer.release_inference()

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged gradients before clipping, at the last applied step."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def set_clip_for_next_step(self, max_norm: float) -> None:
        """Clip the next applied step at ``max_norm`` (how Accelerate's ``clip_grad_norm_`` reaches the engine)."""
        self.step_policy.clip_next_step(max_norm)

    def current_grad_norm(self) -> torch.Tensor | None:
        """Global L2 norm of the reduced, unscaled gradients now (between the boundary backward and step)."""
        zo = self.zero_optimizer
        if zo is None or not zo.reduced or not self.is_gradient_accumulation_boundary():
            return None  # (stage 2 has reduced the micro-steps so far, but the step's gradient is not whole)
        return self.step_policy.grad_norm(zo)  # the step reuses it: one norm, one all-reduce per step

    def wait_params(self) -> None:
        """Make the parameters whole and current before reading them outside the engine's own paths.

        Only needed with ``zero_optimization.overlap_param_gather``: the step then returns with the
        parameters' all-gathers in flight, and the next forward, ``state_dict()``, the engine's saves
        and loads, ``GatheredParameters`` and the next step or backward wait for them themselves
        (``hf_zero/zero/overlap.py``). Code that reads ``module.parameters()`` directly in between (an
        EMA of the weights, ``copy.deepcopy(model)``) calls this first. With ``offload_optimizer`` it also runs
        what is left of the step's deferred CPU optimizer step, so the masters and optimizer state are current too.
        A no-op otherwise.
        """
        if self.zero_optimizer is not None:
            self.zero_optimizer.wait_params()

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ------------------------------------------------------------ step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cast = self.compute_dtype if self.compute_dtype != torch.float32 else None
        args = to_device(args, self.device, cast)
        kwargs = to_device(kwargs, self.device, cast)
        with self.autocast(), self.timers.span("forward"):
            if self.world_size == 1:
                return self.module(*args, **kwargs)
            with hz_dist.peer_failure_guard("forward"):  # stage 3 gathers parameters here
                return self.module(*args, **kwargs)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The config's ``torch_autocast`` around a forward (DeepSpeed's); a no-op context when it is off.

        The backward needs none: autograd runs each op's backward in the dtype its forward chose.
        """
        ta = self.config.torch_autocast
        if not ta.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.config.autocast_dtype)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of the micro-batch loss, scaled for accumulation (and fp16)."""
        with self.timers.span("backward"):
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
        if self.zero_optimizer is None or self.inference_only:
            raise UsageError("engine.backward() needs an optimizer; give one in the config or to initialize()")
        scaled = self.step_policy.scale_loss(loss, self.gradient_accumulation_steps() if scale_wrt_gas else 1)
        zo = self.zero_optimizer
        boundary = self.is_gradient_accumulation_boundary()
        sync = not self._no_sync and (boundary or zo.reduces_every_micro_step)
        zo.prepare_backward(sync, final=boundary)
        scaled.reshape(()).backward(retain_graph=retain_graph)
        self.zero_optimizer.finish_backward()
        # DeepSpeed returns the loss divided by the accumulation steps (without the fp16 scale)
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Called after every micro-batch; applies the optimizer on accumulation boundaries."""
        del lr_kwargs
        if self.zero_optimizer is None or self.inference_only:
            raise UsageError("engine.step() needs an optimizer; give one in the config or to initialize()")
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            with self.timers.span("step"):
                if self.world_size == 1:
                    self._take_model_step()
                else:
                    with hz_dist.peer_failure_guard(f"step {self.global_steps}"):
                        self._take_model_step()
            spp = self.config.steps_per_print
            if self.timers.enabled and spp and self.global_steps % spp == 0:
                line = self.timers.line(reset=True)  # every rank resets; rank 0 says it
                if self.global_rank == 0:
                    logger.info("step=%d, time per call: %s", self.global_steps, line)
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        self._boundary_override = None

    def _take_model_step(self) -> None:
        """The optimizer step of an accumulation boundary: the step policy decides, the engine counts.

        The policy (:class:`hf_zero.step.StepPolicy`) takes the global norm, applies the fp16
        overflow / non-finite rule, unscales and clips the gradient shards, steps the masters and
        publishes the new weights. Here the outcome is counted: an applied step moves the LR
        scheduler and ``global_steps``; a skipped one drops the gradients and counts in
        ``skipped_steps`` too. Every rank reaches the same verdict (the norm is global).
        """
        zo = self.zero_optimizer
        assert zo is not None
        if not zo.reduced:
            raise UsageError(
                "engine.step() reached an accumulation boundary but the gradients were never reduced across "
                "ranks (every backward ran inside engine.no_sync()); run the boundary's backward outside no_sync()"
            )
        result = self.step_policy.step(zo, clip=self.gradient_clipping(), step=self.global_steps,
                                       skipped=self.skipped_steps)
        zo.zero_grad()
        self.global_steps += 1
        if not result.applied:
            self.skipped_steps += 1
            logger.warning("step %d: %s", self.global_steps - 1, result.reason)
            return
        self._global_grad_norm = result.norm
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._step_applied = True
        if self.global_rank == 0 and self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0:
            lrs = ", ".join(f"{lr:.3e}" for lr in self.get_lr())
            extra = f", loss_scale={result.loss_scale:g}" if self.loss_scaler is not None else ""
            logger.info("step=%d, skipped=%d, lr=[%s]%s", self.global_steps, self.skipped_steps, lrs, extra)

    def zero_grad(self) -> None:
        """Drop the gradients (and a norm computed from them); the step does this itself."""
        self.step_policy.forget()
        if self.zero_optimizer is not None:
            self.zero_optimizer.zero_grad()

    # ------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
        exclude_frozen_parameters: bool = False, keep_last: int | None = None,
    ) -> str:
        """Write a resume checkpoint (every rank calls this); ``tag`` defaults to ``global_step<N>``.

        The checkpoint loads at any world size and ZeRO stage; its format is :mod:`hf_zero.checkpoint.format`.
        ``keep_last=N`` (default: the config's ``checkpoint.keep_last``; None keeps all) deletes
        all but the N newest checkpoints in ``save_dir`` once this one is complete and ``latest``
        points at it; the one ``latest`` names is never deleted.
        """
        from hf_zero.checkpoint.save import save

        if exclude_frozen_parameters:
            raise UsageError("save_checkpoint(exclude_frozen_parameters=True) is not supported yet; leave it False")
        if keep_last is None:
            keep_last = self.config.checkpoint_keep_last
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise UsageError(f"save_checkpoint(keep_last=...): got {keep_last!r}, expected an integer >= 1 (or None to keep all)")
        self.wait_params()
        with hz_dist.peer_failure_guard("save_checkpoint"):
            return save(self, save_dir, tag, client_state, save_latest=save_latest, keep_last=keep_last)

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
        from hf_zero.checkpoint.load import load

        if not load_module_strict:
            raise UsageError("load_checkpoint(load_module_strict=False) is not supported yet; the model must match the checkpoint")
        if custom_load_fn is not None:
            raise UsageError("load_checkpoint(custom_load_fn=...) is not supported; checkpoints are read as safetensors")
        self.wait_params()  # the load writes the masters, which in fp32 are the gathered buffers
        with hz_dist.peer_failure_guard("load_checkpoint"):
            if ds_checkpoint.is_deepspeed_checkpoint(load_dir, tag):
                return ds_checkpoint.load(
                    self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                )
            return load(
                self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            )

    def checkpoint_layout(self) -> CheckpointLayout:
        """Which ranks write a checkpoint of this engine together: its data-parallel group, each rank the whole model;
        under tensor parallelism the whole grid, each tensor-parallel rank storing its own slices."""
        tp = self.tensor_parallel_groups
        if tp is None:
            return CheckpointLayout.data_parallel(self.group)
        whole = {id(p) for p in self.module.parameters() if split_of(p) is None}
        return CheckpointLayout(tp.parent, dist.get_rank(tp.parent), tp.dp_size * tp.tp_size, tp.dp_rank, dp=tp.dp_size,
                                tp_rank=tp.tp_rank, others=whole if tp.tp_rank else set())

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
        from hf_zero.checkpoint import adapters as hz_peft
        from hf_zero.model_cards import record

        self.wait_params()
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
        self.wait_params()
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
        lay = self.checkpoint_layout()
        if lay.world > 1:
            error = hz_dist.gather_json(error, lay.group)[0]
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

