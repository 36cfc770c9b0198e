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
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_zero import dist as hz_dist
from hf_zero import preemption as hz_preemption
from hf_zero.checkpoint.ranks import CheckpointLayout
from hf_zero.checkpoint.state import Progress, TrainState
from hf_zero.config import ZeroConfig
from hf_zero.data import to_device
from hf_zero.errors import CheckpointError, ConfigError, NoSyncAtStage3Error, StepInNoSyncError, UsageError
from hf_zero.module_setup import broadcast_module, cast_frozen_params, check_presharded, move_to_device
from hf_zero.parallel import GridShape, ParallelGrid, grid_for
from hf_zero.precision import loss_scaler_for, reduce_dtype
from hf_zero.recompute import checkpoint_blocks
from hf_zero.sequence.groups import view_of as sequence_view_of
from hf_zero.step import NormScope, StepPolicy, StepResult
from hf_zero.tensor_parallel import TensorParallelGroups
from hf_zero.tensor_parallel import view_of as tensor_view_of
from hf_zero.timers import StepTimers
from hf_zero.tp_split import split_of
from hf_zero.zero import attach
from hf_zero.zero import collectives as C
from hf_zero.zero.group import Placement
from hf_zero.zero.host_step import host_step_threads
from hf_zero.zero.nvme_io import NvmeSpec
from hf_zero.zero.offload import OffloadPolicy
from hf_zero.zero.optimizer import ShardedOptimizer, ZeroPolicy

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

    The stages are policies of one ``ShardedOptimizer`` (``hf_zero/zero/optimizer.py``) over shard
    groups; one step policy (``hf_zero/step.py``) decides each optimizer step; checkpoints are
    ``hf_zero/checkpoint``'s. A ``PipelineEngine`` is this engine over one pipeline stage.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ZeroConfig,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
        grid: ParallelGrid | None = None,
    ) -> None:
        """``grid``: the run's parallel grid (``hf_zero/parallel/grid.py``; None: plain data parallelism over the
        world). ZeRO shards over its ZeRO group, the norm and checkpoints span the whole grid; under tensor
        parallelism the model has already been split by ``hf_zero/tensor_parallel.py``."""
        super().__init__()
        _ensure_log_handler()
        self.module = model
        self.config = config
        hz_dist.init_distributed()
        self.grid = grid if grid is not None else grid_for(GridShape.fill(dist.get_world_size()), hz_dist.get_device().type)
        # The ZeRO group: the ranks holding the same parameters (what is broadcast at the start, what a zero.Init
        # model was sliced over). Under hybrid sharding ZeRO partitions over the grid's shard group only and
        # replicates across its replicate group (_sharded_optimizer's Placement).
        self.group = self.grid.zero_group
        self.world_size = self.grid.zero_size
        self._sp_view = sequence_view_of(self.grid)
        self._tp_view = tensor_view_of(self.grid)
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
        if self.grid.hybrid and stage == 0:
            raise ConfigError(f"the grid replicates across dp_replicate {self.grid.replicate_size} (hybrid sharding) "
                              "and ZeRO stage 0 shards nothing; set zero_optimization.stage to 1, 2 or 3")
        hz_dist.register_process()  # so that, should a peer die, the survivors can name it
        # A stage-3 engine without an optimizer (a reference model, a teacher, DeepSpeed's ZeRO-Inference on a model
        # from_pretrained left trainable) is sharded all the same, as DeepSpeed partitions it: its layout is built
        # over an optimizer with no parameter groups, and it only runs forward. Its parameters are frozen, since
        # nothing can train them (backward and step need an optimizer), so autograd keeps no gathered weight alive.
        self.inference_only = optimizer is None and stage == 3
        if self.inference_only:
            model.requires_grad_(False)
            optimizer = _NoOptimizer()
        # A zero.Init model stays as slices at stage 3, whose layout cuts its shards from them (with or without an
        # optimizer); stages 0-2 need it whole.
        built_presharded = check_presharded(model, self.world_size, self.device, gather=stage != 3)
        move_to_device(model, self.device)
        broadcast_module(model, self.group)
        # Float8 linears (hf_zero/float8.py) replace the model's before ZeRO lays the parameters out: the same
        # Parameter objects, so the user's optimizer still holds them; at stage 3 the tensorwise recipe's weights are
        # then gathered as float8 by their shard groups (hf_zero/zero/float8_gather.py).
        self.float8_layers: list[str] = []
        if config.fp8.enabled:
            from hf_zero.float8 import convert_to_float8, mark_float8_all_gather

            self.float8_layers = convert_to_float8(model, config.fp8)
            mark_float8_all_gather(model, config.fp8, stage)
        self.loss_scaler = loss_scaler_for(config)
        self.timers = StepTimers(config.wall_clock_breakdown, self.device)
        self.zero_optimizer = self._sharded_optimizer(optimizer) if optimizer is not None else None
        # Clip, loss scale, the non-finite rule and the global norm (over the whole grid, _norm_scope): one policy
        # for every engine (hf_zero/step.py), made once the shard groups exist (a pipeline leaves out its tied copies).
        self.step_policy = StepPolicy(
            scaler=self.loss_scaler, nonfinite=config.nonfinite_loss, device=self.device,
            scope=self._norm_scope(),
        )
        if self.timers.enabled:
            self.step_policy.timed = self.timers.add
        if self.zero_optimizer is not None and self.loss_scaler is not None:
            scaler = self.loss_scaler
            self.zero_optimizer.loss_scale = lambda: scaler.scale  # super_offload's speculative step unscales by it
        if self.zero_optimizer is not None:
            attach.link(self.zero_optimizer)  # deepspeed.utils.safe_get_full_* start from a parameter
        if stage == 3 and self.zero_optimizer is not None:
            attach.mark_stage3(model, self.zero_optimizer)  # DeepSpeed's ds_* attributes, for code that reads them
        self._destroyed = False
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
        self.basic_optimizer = optimizer if not self.inference_only else None
        # What initialize returns and DeepSpeed's engine.optimizer is: as in DeepSpeed (_do_optimizer_sanity_check),
        # the client's (or the config's) optimizer itself where nothing wraps it, stage 0 without fp16/bf16; the
        # ZeRO wrapper otherwise. Either way the engine steps through zero_optimizer.
        unwrapped = stage == 0 and self.compute_dtype == torch.float32
        self.optimizer = self.basic_optimizer if unwrapped else self.zero_optimizer if not self.inference_only else None
        if self.optimizer is self.zero_optimizer and self.optimizer is not None:
            step = weakref.WeakMethod(self._optimizer_step)  # DeepSpeed's optimizer.step() is the engine's step
            self.zero_optimizer.step_fn = lambda: step()()  # type: ignore[misc]
        self.lr_scheduler = lr_scheduler
        self.training_dataloader: Any = None  # initialize's loader, when it made one (its sampler is the data position)
        self._init_long_runs()

    def _init_long_runs(self) -> None:
        """Preemption (``checkpoint.save_on_signal``, hf_zero/preemption.py) and background saves (``async_save``).

        ``save_on_preemption``: the engine saves a resume checkpoint and exits itself once the ranks agree
        on a signal; an owner that saves its own way (hf_zero's Trainer) sets it False and reads
        :meth:`preemption_signal` instead.
        """
        self.save_on_preemption = True
        self._last_save_dir: str | None = None
        self._background: Any = None  # hf_zero.checkpoint.background.BackgroundWriter, made at the first async save
        self._preemption: hz_preemption.Agreement | None = None
        self._preemption_group: Any = ()
        signals = hz_preemption.signal_numbers(self.config.checkpoint_save_on_signal or ())
        if signals and self.zero_optimizer is not None and not self.inference_only:
            self._preemption = hz_preemption.Agreement(signals, self.config.checkpoint_grace_seconds)

    # ------------------------------------------------------------- setup

    def _norm_scope(self) -> NormScope:
        """The ranks the global norm sums over: the whole grid. The ZeRO group's ranks hold each unpartitioned
        group's gradient alike (it counts once); a tensor-parallel group's ranks hold whole parameters alike."""
        g = self.grid
        return NormScope(None, g.size(), replicas=g.zero_size, tp=g.size("tp"), exclude=self._norm_excluded(),
                         shard_replicas=g.replicate_size)

    def _norm_excluded(self) -> frozenset[int]:
        """Shard groups another rank counts in the norm (a pipeline's tied weights at their later stages)."""
        return frozenset()

    # The grid's views, as DeepSpeed-shaped scripts and hf_zero's integrations read them.

    @property
    def dp_world_size(self) -> int:
        """The data-parallel degree: what batch sizes and samplers count (the grid's ``dp_replicate x dp_shard``)."""
        return self.grid.dp_size if self.grid is not None else 1

    @property
    def sequence_parallel_groups(self) -> Any:
        """The grid's ``sp`` axis (``hf_zero/sequence/groups.py``), None without sequence parallelism."""
        return self._sp_view

    @property
    def tensor_parallel_groups(self) -> TensorParallelGroups | None:
        """The grid's ``tp`` axis (``hf_zero/tensor_parallel.py``), None without tensor parallelism."""
        return self._tp_view

    def _sharded_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """The ZeRO stage of the config over ``optimizer``, sharded over this engine's group: the config read once
        into the optimizer's three frozen inputs (where and in which dtypes, the stage's knobs, what is offloaded)."""
        zc = self.config.zero_optimization
        g = self.grid
        place = Placement.over(g.shard_group, self.device, self.compute_dtype, reduce_dtype(self.config),
                               self.config.master_dtype, replicate=g.replicate_group if g.hybrid else None)
        zero = ZeroPolicy(
            stage=zc.stage, bucket_numel=max(1, int(zc.reduce_bucket_size)),
            persistence_threshold=int(zc.stage3_param_persistence_threshold),
            prefetch_numel=int(zc.stage3_prefetch_bucket_size), max_live_numel=int(zc.stage3_max_live_parameters),
            max_reuse_numel=int(zc.stage3_max_reuse_distance),
            overlap_param_gather=zc.overlap_param_gather, ignore_unused_parameters=zc.ignore_unused_parameters,
        )
        off, par = zc.offload_optimizer, zc.offload_param  # offload_param: stage 3 only (the config says it is ignored elsewhere)
        offload_optimizer = off is not None and off.device in ("cpu", "nvme") and not self.inference_only
        host_threads = None
        if offload_optimizer:
            host_threads, why = host_step_threads(None, off.cores_share())
            if self.timers.enabled:
                self.timers.note("step.cpu_optimizer", f"{host_threads} threads")
                if self.global_rank == 0:
                    logger.info("offload: the host optimizer step runs on %d threads per rank (%s)", host_threads, why)
        aio = self.config.aio

        def nvme(sec: Any, key: str) -> NvmeSpec | None:  # "device": "nvme" (the config refused it without a path)
            if sec is None or sec.device != "nvme":
                return None
            return NvmeSpec(path=str(sec.nvme_path), where=f"zero_optimization.{key}", buffer_count=int(sec.buffer_count),
                            pin_memory=bool(sec.pin_memory), max_in_cpu=int(getattr(sec, "max_in_cpu", 0)),
                            buffer_size=int(getattr(sec, "buffer_size", 0)), block_size=int(aio.block_size),
                            queue_depth=int(aio.queue_depth), threads=int(aio.intra_op_parallelism),
                            single_submit=bool(aio.single_submit))

        params_on = par is not None and par.device in ("cpu", "nvme") and zc.stage == 3
        offload = OffloadPolicy(
            optimizer=offload_optimizer, pin_memory=bool(off.pin_memory) if off is not None else True,
            host_threads=host_threads,
            params=params_on,
            params_pin_memory=bool(par.pin_memory) if par is not None else True,
            optimizer_nvme=nvme(off, "offload_optimizer") if offload_optimizer else None,
            params_nvme=nvme(par, "offload_param") if params_on and offload_optimizer else None,
            speculate=offload_optimizer and bool(off.super_offload) and off.device == "cpu",
        )
        return ShardedOptimizer(self.module, optimizer, place=place, zero=zero, offload=offload)

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
            raise NoSyncAtStage3Error(
                "engine.no_sync(): no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                "stage 3, which reduce-scatters gradients on every micro-step; use stage 0-2 or drop no_sync()"
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
        """The model-parallel (tensor-parallel) degree: the grid's ``tp`` axis, 1 without tensor parallelism."""
        return self.grid.size("tp") if self.grid is not None else 1

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

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine lacks is the wrapped module's, as on DeepSpeed's engine.

        Scripts written for DeepSpeed read their model's own attributes through the engine
        (``engine.config`` of a transformers model, ``engine.id``, a custom ``engine.generate``); the engine's
        own attributes, parameters and submodules come first (``torch.nn.Module``'s lookup).
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and not name.startswith("__"):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    # ------------------------------------------------------------ step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._destroyed:
            raise UsageError("engine.destroy() was called on this engine; build a new one with hf_zero.initialize() to run the model")
        # As DeepSpeed's engine, floating inputs go in as given (a bf16 weight times an fp32 input is fp32 by
        # PyTorch's promotion); only fp16.auto_cast casts them, to fp16. The Trainer casts its batches itself.
        fp16 = self.config.fp16
        cast = torch.float16 if fp16.enabled and fp16.auto_cast else None
        args = to_device(args, self.device, cast)
        kwargs = to_device(kwargs, self.device, cast)
        runtime = self.zero_optimizer.runtime if self.zero_optimizer is not None else None
        with self.autocast(), self.timers.span("forward"):
            # Stage 3: the first forwards find parameters read outside their unit's forward (hf_zero/zero/external.py);
            # a later such read, on a path they did not take, fails in PyTorch, as does a dtype clash of the inputs
            # (passed as given): say what it was and what to do.
            try:
                with runtime.watch() if runtime is not None else contextlib.nullcontext():
                    return self._call_module(args, kwargs)
            except RuntimeError as e:
                sentence = (runtime.explain(e) if runtime is not None else None) or self._explain_input_dtype(
                    e, (args, kwargs))
                if sentence is None:
                    raise
                raise UsageError(sentence) from e

    def _explain_input_dtype(self, error: RuntimeError, inputs: Any) -> str | None:
        """A dtype mismatch in forward while floating inputs differ from the weights' dtype: say what to cast."""
        text = str(error)
        clash = any(w in text for w in ("same dtype", "did not match", "should be the same", "mixed dtype")) or (
            "expected scalar type" in text and "but found" in text)  # not "one of the following scalar types"
        if self.compute_dtype == torch.float32 or not clash:
            return None
        found: list[torch.dtype] = []

        def visit(obj: Any) -> None:
            if torch.is_tensor(obj):
                if obj.is_floating_point() and obj.dtype != self.compute_dtype:
                    found.append(obj.dtype)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    visit(v)
            elif isinstance(obj, dict):
                for v in obj.values():
                    visit(v)

        visit(inputs)
        if not found:
            return None
        want = str(self.compute_dtype).removeprefix("torch.")
        return (f"the model's weights are {want} but engine(...) got {str(found[0]).removeprefix('torch.')} inputs, "
                f"which it passes as given, as DeepSpeed does ({error}); cast them first (x.to(torch.{want})), "
                "or under fp16 set \"fp16\": {\"auto_cast\": true} to have the engine cast them")

    def _call_module(self, args: tuple, kwargs: dict) -> Any:
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
        if self.zero_optimizer is None or self.inference_only:  # first: such an engine's outputs never need grad
            raise UsageError("engine.backward() needs an optimizer; give one in the config or to initialize()")
        if not loss.requires_grad:
            raise UsageError(
                "engine.backward(loss) got a loss that does not require grad; compute it from the output "
                "of engine(...) outside torch.no_grad()"
            )
        if self.zero_optimizer.runtime is not None and self.zero_optimizer.runtime.held_whole:
            raise UsageError("engine.backward() inside unwrap_model_for_generation(engine), which holds the ZeRO-3 "
                             "parameters whole for generation only; call it after the with-block")
        scaled = self.step_policy.scale_loss(loss, self.gradient_accumulation_steps() if scale_wrt_gas else 1)
        zo = self.zero_optimizer
        boundary = self.is_gradient_accumulation_boundary()
        sync = not self._no_sync and (boundary or zo.reduces_every_micro_step)
        zo.prepare_backward(sync, final=boundary)
        scaled.reshape(()).backward(retain_graph=retain_graph)
        self.zero_optimizer.finish_backward()
        # DeepSpeed returns the loss divided by the accumulation steps (without the fp16 scale)
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def _backward_epilogue(self) -> None:
        """What ``engine.backward`` does after autograd, for a backward the engine did not run.

        DeepSpeed's documented way to train several models on one loss ("Jointly training models with shared
        loss" in its training guide): ``loss.backward()`` through the engines' modules (``engine.module(...)``),
        then each engine's ``_backward_epilogue()``, then each ``step()``. Here it reduces this micro-step's
        gradients as ``engine.backward`` would (at the boundary, or every micro-step at stages 2-3; nothing inside
        ``no_sync()``). As in DeepSpeed, the loss is not divided by the accumulation steps. Under fp16 the loss
        was never multiplied by the loss scale that the step divides by, so it is refused there.
        """
        if self.zero_optimizer is None or self.inference_only:
            raise UsageError("engine._backward_epilogue() needs an optimizer; give one in the config or to initialize()")
        if self.loss_scaler is not None:
            raise UsageError("engine._backward_epilogue() after a plain loss.backward() under fp16: the loss was never "
                             "multiplied by the loss scale, so the step would divide unscaled gradients by it; call "
                             "engine.backward(loss) on each engine's own loss instead")
        zo = self.zero_optimizer
        boundary = self.is_gradient_accumulation_boundary()
        zo.prepare_backward(not self._no_sync and (boundary or zo.reduces_every_micro_step), final=boundary)
        if self.world_size == 1:
            zo.finish_backward()
        else:
            with hz_dist.peer_failure_guard(f"backward of step {self.global_steps}"):
                zo.finish_backward()

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Called after every micro-batch; applies the optimizer on accumulation boundaries."""
        del lr_kwargs
        if self.zero_optimizer is None or self.inference_only:
            raise UsageError("engine.step() needs an optimizer; give one in the config or to initialize()")
        if self._no_sync:  # DeepSpeed's rule and sentence: no_sync covers backward passes only
            raise StepInNoSyncError("It is illegal to call Engine.step() inside no_sync context manager: call "
                                    "engine.backward() inside engine.no_sync() and engine.step() after it")
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
        if boundary:
            self._check_preemption()

    def _take_model_step(self) -> None:
        """The optimizer step of an accumulation boundary: the step policy decides, the engine counts.

        The policy (:class:`hf_zero.step.StepPolicy`) takes the global norm, applies the fp16
        overflow / non-finite rule, unscales and clips the gradient shards, steps the masters and
        publishes the new weights. Here the outcome is counted: an applied step moves the LR
        scheduler and ``global_steps``; a skipped one drops the gradients and counts in
        ``skipped_steps`` too. Every rank reaches the same verdict (the norm is global).
        """
        result = self._optimizer_step()
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

    def _optimizer_step(self) -> StepResult:
        """What DeepSpeed's ZeRO ``optimizer.step()`` does: the step policy's step on the reduced gradients, which
        are dropped after; the engine's counters and LR scheduler are :meth:`_take_model_step`'s."""
        zo = self.zero_optimizer
        assert zo is not None
        if not zo.reduced and zo.unreduced_backward:
            raise UsageError(
                "the optimizer step found gradients never reduced across ranks (every backward since the last step "
                "ran inside engine.no_sync(), or before the accumulation boundary); run the boundary's backward "
                "outside no_sync()"
            )
        if not zo.reduced:
            raise UsageError(
                "the optimizer step found no gradients: no backward ran since the last step or zero_grad(), which "
                "drop them; run engine.backward(loss) first, and zero_grad() only after the step (after a plain "
                "loss.backward(), call engine._backward_epilogue() to reduce them)"
            )
        zo.check_unused_parameters()  # zero_optimization.ignore_unused_parameters false: before any rank steps
        result = self.step_policy.step(zo, clip=self.gradient_clipping(), step=self.global_steps,
                                       skipped=self.skipped_steps)
        zo.zero_grad()
        if result.applied and result.norm is not None:
            zo._global_grad_norm = result.norm  # a 0-d tensor, as the engine's own: no host sync here
        return result

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()``: release what the engine holds; a second call does nothing.

        The engine's hooks come off the module and its parameters; gradients, fp32 masters, optimizer
        state and gathered buffers are released, also where the caller still holds the engine or the
        optimizer ``initialize`` returned (whose param groups are emptied); the engine drops its
        process groups. The module stays usable without the engine: at stages 0-2 its parameters are
        whole, at stage 3 they are ``zero.Init``'s per-rank slices (``GatheredParameters`` gathers them,
        ``initialize`` shards them again), as DeepSpeed leaves them partitioned. At stage 3 every rank
        calls it (each group is gathered once to cut the slices; see ``hf_zero/zero/attach.py``). A background
        checkpoint write is waited for first, and ``checkpoint.save_on_signal``'s handlers are put back.
        """
        if self._destroyed:
            return
        try:
            self.wait_for_checkpoint()  # a background write in flight finishes first (its error is raised)
        finally:
            if self._preemption is not None:
                self._preemption.close()  # the signal handlers of checkpoint.save_on_signal: the previous ones come back
                self._preemption = None
        zo = self.zero_optimizer
        if zo is not None:
            zo.step_fn = None  # optimizer.step() on the optimizer initialize returned now says the engine is gone
            if self.world_size == 1:
                attach.detach(self.module, zo)
            else:
                with hz_dist.peer_failure_guard("destroy"):
                    attach.detach(self.module, zo)
        self.zero_optimizer = self.optimizer = self.basic_optimizer = None
        self.step_policy.forget()
        self._global_grad_norm = None
        self.group = self.grid = self._sp_view = self._tp_view = None
        self._destroyed = True

    def zero_grad(self) -> None:
        """Drop the gradients (and a norm computed from them); the step does this itself."""
        self.step_policy.forget()
        if self.zero_optimizer is not None:
            self.zero_optimizer.zero_grad()

    # ------------------------------------------------------ preemption

    def _check_preemption(self) -> None:
        """On an accumulation boundary, once counted: has every rank agreed on a signal? Then save and exit."""
        p = self._preemption
        if p is None or p.decided is not None:
            return
        if self._preemption_group == ():
            self._preemption_group = self.checkpoint_layout().group  # the ranks that save (and so stop) together
        with hz_dist.peer_failure_guard(f"the preemption check of step {self.global_steps}"):
            signum = p.poll(self._preemption_group, self.device)
        if signum is not None and self.save_on_preemption:
            self._save_and_exit(signum)

    def preemption_signal(self) -> int | None:
        """The signal every rank agreed to stop on (``checkpoint.save_on_signal``), or None.

        Set by the accumulation-boundary ``step()`` at which the ranks decided, the same step on every
        rank. With ``save_on_preemption`` left True the engine has already saved and exited by then;
        an owner that saves its own way (hf_zero's Trainer) reads it after each step.
        """
        return self._preemption.decided if self._preemption is not None else None

    def _save_and_exit(self, signum: int) -> None:
        """Save a resume checkpoint into ``checkpoint.save_dir`` (or the last save's folder) and exit with 128 + signum."""
        assert self._preemption is not None
        hz_preemption.acting()
        status, name = hz_preemption.exit_status(signum), hz_preemption.signal_name(signum)
        try:
            self.wait_for_checkpoint()
        except CheckpointError as e:  # that save is lost; the one below is what the restart needs
            logger.error("%s", e)
        save_dir = self.config.checkpoint_save_dir or self._last_save_dir
        if save_dir is None:
            if self.global_rank == 0:
                logger.warning("%s: no folder to save a resume checkpoint into (set checkpoint.save_dir, or call "
                               "save_checkpoint once); exiting with status %d without saving", name, status)
        else:
            path = self._save(save_dir, keep_last=self.config.checkpoint_keep_last, background=False)
            if self.global_rank == 0:
                logger.warning("%s: every rank stopped after step %d and saved the resume checkpoint %s; exiting with "
                               "status %d", name, self.global_steps, path, status)
        raise SystemExit(status)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for the checkpoint being written in the background (``checkpoint.async_save``).

        Returns its path, or None when none was in flight; its error, if the write failed on any rank,
        is raised here on every rank (every rank calls this at the same point). ``save_checkpoint``,
        ``load_checkpoint``, ``destroy()`` and a preemption wait on their own; the process's end waits
        for it too.
        """
        return self._background.wait() if self._background is not None else None

    # ------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
        exclude_frozen_parameters: bool = False, keep_last: int | None = None,
    ) -> str:
        """Write a resume checkpoint (every rank calls this); ``tag`` defaults to ``global_step<N>``.

        The checkpoint loads at any world size and ZeRO stage; its format is :mod:`hf_zero.checkpoint.format`.
        ``keep_last=N`` (default: the config's ``checkpoint.keep_last``; None keeps all) deletes
        all but the N newest checkpoints in ``save_dir`` once this one is complete and ``latest``
        points at it; the one ``latest`` names is never deleted. With ``checkpoint.async_save`` it
        returns once this rank's share is in host memory, and the returned path exists once every
        rank's background write is done (:meth:`wait_for_checkpoint`). ``exclude_frozen_parameters=True``
        leaves the values of the parameters nothing trains out (a PEFT model's base weights); loading
        it keeps the values the model has for them.
        """
        if not save_dir:
            raise UsageError(f"save_checkpoint(save_dir={save_dir!r}): name the folder to save the checkpoint in")
        if keep_last is None:
            keep_last = self.config.checkpoint_keep_last
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise UsageError(f"save_checkpoint(keep_last=...): got {keep_last!r}, expected an integer >= 1 (or None to keep all)")
        return self._save(save_dir, tag, client_state, save_latest, keep_last, background=self.config.checkpoint_async_save,
                          exclude_frozen=bool(exclude_frozen_parameters))

    def _save(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
              keep_last: int | None = None, background: bool = False, exclude_frozen: bool = False) -> str:
        """``save_checkpoint`` once its arguments are checked; ``background``: return once the share is in host memory."""
        from hf_zero.checkpoint.background import BackgroundWriter
        from hf_zero.checkpoint.save import save

        self.wait_for_checkpoint()  # at most one save in flight; its host buffers are the ones reused
        self.wait_params()
        writer = None
        if background:
            if self._background is None:
                self._background = BackgroundWriter(pin=self.device.type == "cuda")
            writer = self._background
        with hz_dist.peer_failure_guard("save_checkpoint"), self.resident_state():
            path = save(self.train_state(), save_dir, tag, client_state, save_latest=save_latest, keep_last=keep_last,
                        background=writer, exclude_frozen=exclude_frozen)
        self._last_save_dir = save_dir
        return path

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
        (``checkpoint/deepspeed.py``). Returns ``(path, client_state)`` as DeepSpeed does; with no
        ``tag`` and no ``latest`` file in ``load_dir`` (nothing saved there yet) it warns and returns
        ``(None, None)`` without touching anything, as DeepSpeed does, so "resume if there is a
        checkpoint" start-up code runs unchanged.
        """
        from hf_zero.checkpoint import deepspeed as ds_checkpoint
        from hf_zero.checkpoint.format import read_latest
        from hf_zero.checkpoint.load import load

        if tag is None and not self._has_latest(load_dir):
            logger.warning(
                "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file exists "
                "or pass an explicit checkpoint tag when loading a checkpoint.", os.path.join(load_dir, "latest"))
            return None, None

        if not load_module_strict:
            raise UsageError("load_checkpoint(load_module_strict=False) is not supported yet; the model must match the checkpoint")
        if custom_load_fn is not None:
            raise UsageError("load_checkpoint(custom_load_fn=...) is not supported; checkpoints are read as safetensors")
        self.wait_for_checkpoint()  # (async_save) the checkpoint being written may be the one asked for
        self.wait_params()  # the load writes the masters, which in fp32 are the gathered buffers
        with hz_dist.peer_failure_guard("load_checkpoint"), self.resident_state():
            theirs = ds_checkpoint.is_deepspeed_checkpoint(load_dir, tag)
            reader = ds_checkpoint.load if theirs else load
            if load_optimizer_states and not load_module_only and not theirs:
                logger.debug("rank %d loads its optimizer state from %s", self.global_rank,
                             self._get_optimizer_ckpt_name(load_dir, tag if tag is not None else read_latest(load_dir)))
            path, client, progress = reader(
                self.train_state(), load_dir, tag, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            )
        self.restore_progress(progress)
        return path, client

    def resident_state(self) -> contextlib.AbstractContextManager[None]:
        """The optimizer's masters, state and offloaded shards in host memory for the block: what a save or a load
        that reads them outside ``save_checkpoint`` / ``load_checkpoint`` (which use it) needs under NVMe offload,
        where they wait in files between steps (``hf_zero/zero/nvme.py``). Collective; nothing to do otherwise."""
        zo = self.zero_optimizer
        return zo.resident() if zo is not None else contextlib.nullcontext()

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: str | int, expp_rank: int | None = None) -> str:
        """The file holding a rank's optimizer state in checkpoint ``tag`` of ``checkpoints_path`` (DeepSpeed's name).

        hf_zero keeps optimizer state beside the masters, by parameter name and element range, in each saving
        rank's ``rankNNNNN-000.safetensors`` (a share over 2 GiB goes on in ``-001``, ...; see
        ``hf_zero/checkpoint/format.py``). For this rank: the file it reads its optimizer state from, as
        :func:`hf_zero.checkpoint.load.optimizer_state_file` finds it in the checkpoint (in the layout of the save
        its own file, at stage 0 the first rank's); where the checkpoint is not there yet or holds none for this
        rank, and for ``expp_rank`` (DeepSpeed's argument: the expert-parallel rank of its MoE optimizer files;
        hf_zero has no expert parallelism, so it names a rank), the file that rank writes. ``load_checkpoint``
        asks for it only when it loads optimizer states, and logs it at debug level.
        """
        from hf_zero.checkpoint.format import META, rank_file_name
        from hf_zero.checkpoint.load import optimizer_state_file

        path = os.path.join(checkpoints_path, str(tag))
        found = None
        if expp_rank is None and self.zero_optimizer is not None and os.path.isfile(os.path.join(path, META)):
            found = optimizer_state_file(path, self.zero_optimizer)
        return found or os.path.join(path, rank_file_name(self.global_rank if expp_rank is None else int(expp_rank), 0))

    def _has_latest(self, load_dir: str) -> bool:
        """Whether ``load_dir`` names a checkpoint to load without a tag: its ``latest`` file (or the folder is a
        DeepSpeed checkpoint itself), the same answer on every rank (a rank that sees none while another does,
        a folder on a disk not shared by all, is refused on every rank rather than left waiting in the load)."""
        from hf_zero.checkpoint import deepspeed as ds_checkpoint

        lay = self.checkpoint_layout()
        mine = os.path.isfile(os.path.join(load_dir, "latest")) or ds_checkpoint.is_deepspeed_checkpoint(load_dir, None)
        every = [v[0] for v in hz_dist.gather_ints([int(mine)], lay.group)] if lay.world > 1 else [int(mine)]
        if any(every) and not all(every):
            raise CheckpointError(
                f"load_checkpoint({load_dir!r}): rank {every.index(1)} finds a 'latest' file there but rank "
                f"{every.index(0)} does not; put the checkpoint where every rank reads it"
            )
        return mine

    def train_state(self) -> TrainState:
        """What checkpoints, consolidated weights and the model card read of this engine, as of now.

        The objects are the engine's own (a load restores into them in place); the counters are a copy,
        which a load hands back as a :class:`Progress` for :meth:`restore_progress` (``hf_zero/checkpoint/state.py``).
        """
        if self._destroyed:
            raise UsageError("engine.destroy() was called on this engine; save before destroying it")
        return TrainState(
            layout=self.checkpoint_layout(), module=self.module, optimizer=self.zero_optimizer,
            lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler, config=self.config,
            progress=Progress(self.global_steps, self.micro_steps, self.global_samples, self.skipped_steps),
            gradient_accumulation_steps=self.gradient_accumulation_steps(), train_batch_size=self.train_batch_size(),
            micro_batch_size=self.train_micro_batch_size_per_gpu(), gradient_clipping=self.gradient_clipping(),
            zero_stage=self.zero_optimization_stage(), device=self.device, compute_dtype=self.compute_dtype,
            group=self.group, world_size=self.world_size,
            sampler=getattr(self.training_dataloader, "sampler", None), tensor_parallel=self.tensor_parallel_groups,
        )

    def restore_progress(self, progress: Progress | None) -> None:
        """Take the counters a checkpoint load read (None: a load of the module only, which leaves them)."""
        if progress is not None:
            self.global_steps, self.micro_steps = progress.global_steps, progress.micro_steps
            self.global_samples, self.skipped_steps = progress.global_samples, progress.skipped_steps

    def checkpoint_layout(self) -> CheckpointLayout:
        """Which ranks write a checkpoint of this engine together: the whole grid. The ZeRO group's ranks store their
        shards (its first, what is replicated; under hybrid sharding the first replica's ranks only); a tensor-parallel rank its own slices and, at ``tp`` rank 0, the
        whole parameters; a pipeline stage its layers, a tied weight at its first stage only."""
        g = self.grid
        others = set(self._stored_elsewhere())
        if g.rank("tp"):
            others |= {id(p) for p in self.module.parameters() if split_of(p) is None}
        pp = g.size("pp")
        return CheckpointLayout(None, g.global_rank, g.size(), g.zero_rank, pipe_stage=g.pipe_stage if pp > 1 else None,
                                num_stages=pp if pp > 1 else None, dp=g.zero_size, others=others, tp_rank=g.rank("tp"),
                                replica=g.replicate_rank)

    def _stored_elsewhere(self) -> set[int]:
        """Parameters (by id) another rank of the grid stores in checkpoints (a pipeline's tied weights at later stages)."""
        return set()

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
        state = self.train_state()
        if merge_adapters:
            files = hz_peft.save_merged(state, save_directory, max_shard_size=max_shard_size, dtype=dtype)
        elif hz_peft.is_peft_model(self.module):
            files = hz_peft.save_adapters(state, save_directory, dtype=dtype)
        else:
            from hf_zero.checkpoint import consolidated

            files = consolidated.save_pretrained(state, save_directory, max_shard_size=max_shard_size, dtype=dtype)
        record.write_engine_record(state, save_directory, merged=merge_adapters)
        return files

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """The whole model's state dict in its compute dtype, in one file (every rank calls this; rank 0 writes).

        The default name is ``model.safetensors``: a safetensors file, tied weights written once under
        their first name, streamed so rank 0 never holds the whole model. A name a DeepSpeed script
        passes, such as ``pytorch_model.bin`` (DeepSpeed's default), gets what DeepSpeed writes there:
        ``torch.save`` of the state dict, tied weights under each name (``torch.load(weights_only=True)``
        and ``from_pretrained`` read it). Stage-3 blocks are gathered one at a time (no
        ``stage3_gather_16bit_weights_on_model_save`` needed). Returns True, as DeepSpeed does.
        """
        from hf_zero.checkpoint import consolidated

        self.wait_params()
        consolidated.save_single_file(self.train_state(), save_dir, save_filename, exclude_frozen=exclude_frozen_parameters)
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

