"""ZeroEngine: DeepSpeed's engine API (forward, backward, step) over the ZeRO stage policies.

The engine wraps the user's module without renaming anything (``engine.module`` is the
user's object) and keeps DeepSpeed's accounting: ``step()`` is called after every
micro-batch and applies the optimizer only on a gradient-accumulation boundary; the loss is
divided by ``gradient_accumulation_steps`` in ``backward`` so that accumulated gradients are
the mean over the global batch, exactly as one process training on the whole batch.

This class keeps the step and the engine's lifetime; the rest are collaborators with small interfaces
(``hf_zero/engine/``): DeepSpeed's read-only surface is the base class ``DeepSpeedSurface`` (``surface.py``),
saves and loads are ``Persistence``'s (``persistence.py``), preemption is ``LongRuns``' (``long_runs.py``)
and the ZeRO optimizer is built from the config once by ``zero_setup.py``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.config import ZeroConfig
from hf_zero.distributed import dist as hz_dist
from hf_zero.engine.long_runs import LongRuns
from hf_zero.engine.persistence import Persistence
from hf_zero.engine.surface import DeepSpeedSurface
from hf_zero.engine.train_state import TrainStateSource
from hf_zero.engine.zero_setup import NoOptimizer, sharded_optimizer
from hf_zero.errors import ConfigError, NoSyncAtStage3Error, StepInNoSyncError, UsageError
from hf_zero.parallel import GridShape, ParallelGrid, grid_for
from hf_zero.parallel.tensor_parallel import view_of as tensor_view_of
from hf_zero.precision.float8 import apply_float8
from hf_zero.precision.policies import loss_scaler_for
from hf_zero.sequence.groups import view_of as sequence_view_of
from hf_zero.training.data import to_device
from hf_zero.training.module_setup import (
    broadcast_module,
    cast_frozen_params,
    check_presharded,
    move_to_device,
    no_kv_cache_in_training,
)
from hf_zero.training.recompute import checkpoint_blocks
from hf_zero.training.step import NormScope, StepPolicy, StepResult
from hf_zero.training.timers import StepTimers
from hf_zero.zero import attach

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


def explain_input_dtype(error: RuntimeError, inputs: Any, compute_dtype: torch.dtype) -> str | None:
    """A dtype mismatch in forward while floating inputs differ from the weights' dtype: say what to cast.

    The engine passes floating inputs as given, as DeepSpeed does, so a bf16 model fed fp32 inputs fails deep
    inside PyTorch; this turns that error into one sentence naming the dtypes and the fix, or returns None when
    the error is something else.
    """
    text = str(error)
    clash = any(w in text for w in ("same dtype", "did not match", "should be the same", "mixed dtype")) or (
        "expected scalar type" in text and "but found" in text)  # not "one of the following scalar types"
    if compute_dtype == torch.float32 or not clash:
        return None
    found: list[torch.dtype] = []

    def visit(obj: Any) -> None:
        if torch.is_tensor(obj):
            if obj.is_floating_point() and obj.dtype != compute_dtype:
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
    want = str(compute_dtype).removeprefix("torch.")
    return (f"the model's weights are {want} but engine(...) got {str(found[0]).removeprefix('torch.')} inputs, "
            f"which it passes as given, as DeepSpeed does ({error}); cast them first (x.to(torch.{want})), "
            "or under fp16 set \"fp16\": {\"auto_cast\": true} to have the engine cast them")


class ZeroEngine(DeepSpeedSurface, TrainStateSource, torch.nn.Module):
    """Training engine for ZeRO stages 0-3 with DeepSpeed's method names and semantics.

    The stages are policies of one ``ShardedOptimizer`` (``hf_zero/zero/optimizer.py``) over shard
    groups; one step policy (``hf_zero/training/step.py``) decides each optimizer step; checkpoints are
    ``hf_zero/checkpoint``'s, reached through :class:`Persistence`. A ``PipelineEngine`` is this engine over
    one pipeline stage.
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
        parallelism the model has already been split by ``hf_zero/parallel/tensor_parallel.py``."""
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
            optimizer = NoOptimizer()
        # A zero.Init model stays as slices at stage 3, whose layout cuts its shards from them (with or without an
        # optimizer); stages 0-2 need it whole.
        built_presharded = check_presharded(model, self.world_size, self.device, gather=stage != 3)
        move_to_device(model, self.device)
        broadcast_module(model, self.group)
        self.float8_layers: list[str] = apply_float8(model, config.fp8, stage)  # before ZeRO lays parameters out
        self.loss_scaler = loss_scaler_for(config)
        self.timers = StepTimers(config.wall_clock_breakdown, self.device)
        self.zero_optimizer = sharded_optimizer(
            model, optimizer, config, self.grid, self.device, self.timers, self.global_rank, self.inference_only,
        ) if optimizer is not None else None
        # Clip, loss scale, the non-finite rule and the global norm (over the whole grid, _norm_scope): one policy
        # for every engine (hf_zero/training/step.py), made once the shard groups exist (a pipeline leaves out its tied copies).
        self.step_policy = StepPolicy(scaler=self.loss_scaler, nonfinite=config.nonfinite_loss, device=self.device,
                                      scope=self._norm_scope())
        if self.timers.enabled:
            self.step_policy.timed = self.timers.add
        if self.zero_optimizer is not None:
            attach.link(self.zero_optimizer)  # deepspeed.utils.safe_get_full_* start from a parameter
            if self.loss_scaler is not None:  # super_offload's speculation unscales by it
                self.zero_optimizer.loss_scale = lambda s=self.loss_scaler: s.scale
            if stage == 3:  # DeepSpeed's ds_* attributes, for code that reads them
                attach.mark_stage3(model, self.zero_optimizer)
        self._destroyed = False
        cast_frozen_params(model, self.compute_dtype)
        if config.compile.enabled:  # before checkpointing, so the recomputation runs the compiled blocks too
            self.compile(config.compile.backend, config.compile.kwargs)
        if config.activation_checkpointing.get("checkpoint_blocks", False):
            no_kv_cache_in_training(self.module, "activation_checkpointing.checkpoint_blocks")
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
        # checkpoint.save_on_signal: the engine saves a resume checkpoint and exits itself once the ranks agree on a
        # signal; an owner that saves its own way (hf_zero's Trainer) sets save_on_preemption False and reads
        # preemption_signal() instead.
        self.save_on_preemption = True
        self.persistence = Persistence(self)
        self.long_runs = LongRuns(config, self.persistence, self.device, self.global_rank,
                                  trains=self.zero_optimizer is not None and not self.inference_only)

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

    # ------------------------------------------------------------ accumulation

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
                sentence = (runtime.explain(e) if runtime is not None else None) or explain_input_dtype(
                    e, (args, kwargs), self.compute_dtype)
                if sentence is None:
                    raise
                raise UsageError(sentence) from e

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

        The policy (:class:`hf_zero.training.step.StepPolicy`) takes the global norm, applies the fp16
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
            self.long_runs.close()  # the signal handlers of checkpoint.save_on_signal: the previous ones come back
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

    def _check_preemption(self) -> None:
        """On an accumulation boundary, once counted: has every rank agreed on a signal (``checkpoint.save_on_signal``)?
        Then save and exit, unless the owner saves its own way (``save_on_preemption`` False): ``LongRuns``."""
        self.long_runs.at_boundary(self.global_steps, self.checkpoint_layout, save=self.save_on_preemption)
