"""``hf_zero.Accelerator``: Accelerate's ``Accelerator`` with ZeRO, by subclassing, not patching.

A plain Accelerate loop gains ZeRO by changing its import::

    from hf_zero import Accelerator
    accelerator = Accelerator(zero_config="configs/zero2.json", gradient_accumulation_steps=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

``prepare`` turns the model and its optimizer into one :class:`~hf_zero.engine.ZeroEngine`
(the model comes back as the engine, the optimizer as a wrapper whose ``step`` is the engine's);
data loaders and schedulers are prepared by Accelerate as usual. Accelerate decides where the
accumulation boundaries are (``sync_gradients``); the engine communicates only on them.

A config with ``optimizer`` / ``scheduler`` sections works as under DeepSpeed: pass
``hf_zero.DummyOptim(model.parameters(), lr=...)`` and ``hf_zero.DummyScheduler(optimizer,
total_num_steps=..., warmup_num_steps=...)`` (Accelerate's own classes, which ``accelerate.utils``
exports only when the ``deepspeed`` package is installed); the sections build both ("auto" filled from
them) and the engine steps the schedule. The combinations Accelerate refuses for DeepSpeed (a section
and an object built in code for the same thing, ...) are refused with its rule in one sentence.
``zero_config`` may also come from the ``HF_ZERO_CONFIG`` environment variable, so
``accelerate launch`` needs no new config key.

Accelerate's DeepSpeed users: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))``, or a
``distributed_type: DEEPSPEED`` Accelerate YAML started by ``hf-zero launch --config_file X.yaml``,
give the config Accelerate's ``DeepSpeedPlugin`` builds, "auto" filled by Accelerate's DeepSpeed rules
(:mod:`hf_zero.integrations.deepspeed_plugin`); ``accelerator.state.deepspeed_plugin`` answers that
plugin, so a script that asks it whether the config has an optimizer section takes the same branch as
under DeepSpeed.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # importable without the deepspeed package

from hf_zero.engine import UsageError, ZeroEngine
from hf_zero.integrations import deepspeed_plugin as ds_plugin
from hf_zero.integrations import parallelism as hz_parallelism
from hf_zero.integrations.autofill import (  # noqa: F401 - MIN_AUTO_REDUCE_BUCKET and ENV_VAR are public here too
    ENV_VAR,
    MIN_AUTO_REDUCE_BUCKET,
    fill_bucket_autos,
    fill_dummy_optimizer,
    fill_dummy_scheduler,
    fill_precision,
    load_zero_config,
    parse_once,
)
from hf_zero.parallel.tensor_parallel import degree_of
from hf_zero.sequence.setup import merge_sp_size, sp_size_of
from hf_zero.sequence.setup import wrap_loader as wrap_sequence_loader


def launched_without_gpus() -> bool:
    """Started as several processes (torchrun's ``WORLD_SIZE`` > 1) on a machine where CUDA sees no GPU.

    Accelerate then makes every process a world of one (``DistributedType.NO``) unless told to use
    the CPU: each rank would train on the whole data set and act as the main process.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    return world > 1 and not torch.cuda.is_available()


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """The optimizer ``prepare`` returns: ``step`` advances the engine, ``zero_grad`` is the engine's business."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__(engine.basic_optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise UsageError("optimizer.step(closure) is not supported with hf_zero; compute the loss before step()")
        self.engine.set_gradient_accumulation_boundary(self.gradient_state.sync_gradients)
        self.engine.step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """The engine clears (or frees) gradients itself after each applied step."""

    @property
    def step_was_skipped(self) -> bool:
        return self.gradient_state.sync_gradients and not self.engine.was_step_applied()


class ZeroEngineScheduler(AcceleratedScheduler):
    """The scheduler ``prepare`` returns for a ``DummyScheduler``: the engine built it and steps it.

    As under DeepSpeed, a schedule from the config's ``scheduler`` section advances inside the
    engine's optimizer step (and not on a skipped one), so ``scheduler.step()`` in the loop does nothing.
    """

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the engine stepped the schedule with the optimizer."""


class Accelerator(accelerate.Accelerator):
    """Accelerate's ``Accelerator`` whose ``prepare`` builds a ZeRO engine from ``zero_config``.

    Without a ``zero_config`` (argument or ``$HF_ZERO_CONFIG``) it is exactly Accelerate's. With
    one, the config is checked here, before any model exists, and a multi-process launch on a
    machine without GPUs runs as CPU processes over gloo (as ``cpu=True`` asks), so the data is
    sharded and only rank 0 is the main process.
    """

    def __init__(self, *args: Any, zero_config: str | os.PathLike | dict | None = None, **kwargs: Any) -> None:
        plugin = self._take_deepspeed_plugin(kwargs, zero_config)
        config = load_zero_config(zero_config) if plugin is None else None
        if (config is not None or plugin is not None) and launched_without_gpus():
            kwargs["cpu"] = True
        # Accelerate accepts sp_size only for its DeepSpeed and multi-GPU types; hf_zero's engine runs it
        # everywhere (gloo included), so the config is attached after Accelerate's own checks.
        # The same for dp_replicate_size / dp_shard_size: hybrid sharding is hf_zero's grid, not Accelerate's mesh.
        ours = config is not None or plugin is not None
        sp = sp_size_of(kwargs.get("parallelism_config")) if ours else 1
        take = ours and (sp > 1 or hz_parallelism.asks_for_data_parallel_layout(kwargs.get("parallelism_config")))
        pc = kwargs.pop("parallelism_config") if take else None
        super().__init__(*args, **kwargs)
        if pc is not None:
            self.state.parallelism_config = pc
            if config is not None:  # the sizes against the world, said before any model exists
                hz_parallelism.shard_size_of(pc, self.state.num_processes, sp, degree_of(config))
        self._deepspeed_plugin = plugin
        if plugin is not None:  # checked here as a zero_config is, before any model exists
            config = load_zero_config(ds_plugin.zero_config_of(plugin, str(self.state.mixed_precision)))
            self.state = ds_plugin.attach(self.state, plugin)
        self.zero_config = config
        self._zero_engines: list[ZeroEngine] = []
        self._eval_engines: list[ZeroEngine] = []  # models prepared for evaluation only (kept apart: not trained)
        self._data_parallel_view = False

    @staticmethod
    def _take_deepspeed_plugin(kwargs: dict, zero_config: Any) -> ds_plugin.ZeroDeepSpeedPlugin | None:
        """Accelerate's DeepSpeed settings, from ``deepspeed_plugin(s)=`` or ``hf-zero launch --config_file``, else None.

        Accelerate itself would import ``deepspeed`` for them; here they become the ZeRO config. They
        and a ``zero_config`` (argument or ``$HF_ZERO_CONFIG``) are two answers to one question.
        """
        given = kwargs.pop("deepspeed_plugin", None)
        several = kwargs.pop("deepspeed_plugins", None)
        if given is not None and several is not None:
            raise UsageError("Accelerator got both deepspeed_plugin and deepspeed_plugins; pass one of them")
        given = given if given is not None else several
        if given is None and not ds_plugin.launched_with_deepspeed_yaml():
            return None
        source = "deepspeed_plugin=" if given is not None else "the DEEPSPEED Accelerate YAML of hf-zero launch --config_file"
        if zero_config is not None or os.environ.get(ENV_VAR):
            other = "zero_config=" if zero_config is not None else f"${ENV_VAR}"
            raise UsageError(f"Accelerator got a ZeRO config from both {other} and {source}; keep one of them")
        return ds_plugin.adopt(given) if given is not None else ds_plugin.plugin_from_environment()

    @property
    def _config_name(self) -> str:
        """What the refusals call the config: the user's ``zero_config``, or the one Accelerate's DeepSpeed plugin built."""
        return "the DeepSpeed config" if getattr(self, "_deepspeed_plugin", None) is not None else "zero_config"

    # ------------------------------------------------------- tensor parallelism

    @property
    def tensor_parallel_size(self) -> int:
        """The config's ``tensor_parallel.autotp_size`` (1 without one): the ranks that share every batch."""
        return degree_of(getattr(self, "zero_config", None))

    @property
    def num_processes(self) -> int:
        """The data-parallel replicas: what the Trainer scales the loss and counts batches by. Under tensor
        parallelism the ranks of a group are one replica (Accelerate's own state still counts every rank)."""
        return super().num_processes // self.tensor_parallel_size

    @property
    def process_index(self) -> int:
        i = super().process_index
        return i // self.tensor_parallel_size if getattr(self, "_data_parallel_view", False) else i

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """Accelerate's, but under tensor parallelism sharded over the data-parallel ranks: the ranks of a
        tensor-parallel group draw the same batches (they compute parts of one result)."""
        self._data_parallel_view = self.tensor_parallel_size > 1
        try:
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        finally:
            self._data_parallel_view = False

    def gather(self, tensor: Any) -> Any:
        """Accelerate's, but under tensor parallelism each tensor-parallel group's (identical) values count once,
        so evaluation and ``predict`` see every sample once, as with data parallelism alone."""
        out = super().gather(tensor)
        tp = self.tensor_parallel_size
        if tp <= 1:
            return out
        from accelerate.utils import recursively_apply

        world = self.state.num_processes
        return recursively_apply(lambda t: torch.cat(list(t.reshape(world, -1, *t.shape[1:]))[::tp]).reshape(-1, *t.shape[1:])
                                 if t.dim() else t, out)

    # ---------------------------------------------------------------- prepare

    def _engine_config(self, loaders: list[torch.utils.data.DataLoader], model: torch.nn.Module,
                       optimizer: Any = None, scheduler: Any = None) -> dict:
        """The config the engine is built from: "auto" filled as Accelerate fills it for DeepSpeed."""
        assert self.zero_config is not None
        cfg = merge_sp_size(copy.deepcopy(self.zero_config), sp_size_of(self.parallelism_config))
        fill_bucket_autos(cfg, model)
        micro = cfg.get("train_micro_batch_size_per_gpu")
        if micro in (None, "auto"):
            sizes = [dl.batch_size for dl in loaders if getattr(dl, "batch_size", None)]
            cfg["train_micro_batch_size_per_gpu"] = int(sizes[0]) if sizes else 1
        gas = cfg.get("gradient_accumulation_steps")
        from_plugin = getattr(self, "_deepspeed_plugin", None) is not None
        if gas in (None, "auto"):
            cfg["gradient_accumulation_steps"] = int(self.gradient_accumulation_steps)
        elif int(gas) != int(self.gradient_accumulation_steps) and from_plugin:
            # Accelerate's DeepSpeed rule: the config's value wins, said once, at prepare
            warnings.warn(f"Gradient accumulation steps mismatch: the Accelerator has {self.gradient_accumulation_steps}, "
                          f"the DeepSpeed config has {gas}; using the config's, as Accelerate does under DeepSpeed", stacklevel=3)
            self.gradient_accumulation_steps = int(gas)
        elif int(gas) != int(self.gradient_accumulation_steps):
            raise UsageError(
                f"zero_config.gradient_accumulation_steps is {gas} but the Accelerator was built with "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}; set one of them to match (or \"auto\")"
            )
        if cfg.get("train_batch_size") == "auto":
            del cfg["train_batch_size"]
        if cfg.get("gradient_clipping", "auto") == "auto":
            # Accelerate fills DeepSpeed's "auto" with 1.0, and an absent key is DeepSpeed's default, 1.0 too; but
            # a plugin given gradient_clipping=0 (--gradient_clipping 0) leaves the key out (Accelerate writes it only
            # when truthy), and that 0 is honoured as no clipping. A zero_config's "auto" or absent key leaves
            # clipping to accelerator.clip_grad_norm_
            given = getattr(self._deepspeed_plugin, "gradient_clipping", None) if from_plugin else None
            explicit = isinstance(given, (int, float)) and not isinstance(given, bool)
            cfg["gradient_clipping"] = (float(given) if explicit else 1.0) if from_plugin else 0.0
        mp = str(self.mixed_precision)
        clash = fill_precision(cfg, mp in ("bf16", "fp8"), mp == "fp16", must_match=False)
        if clash:
            raise UsageError(f"zero_config contradicts Accelerator(mixed_precision={mp!r}): {'; '.join(clash)}")
        if mp == "fp8":
            self._fill_fp8(cfg)
        if isinstance(optimizer, DummyOptim):
            fill_dummy_optimizer(cfg, optimizer)
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            inner = getattr(scheduler, "optimizer", None)
            max_lr = inner.defaults["lr"] if getattr(inner, "defaults", None) else getattr(inner, "lr", None)
            fill_dummy_scheduler(cfg, scheduler, max_lr, self.num_processes, self.split_batches)
        return cfg

    def _fill_fp8(self, cfg: dict) -> None:
        """``mixed_precision="fp8"``: the config's ``fp8`` section from Accelerate's torchao recipe (``AORecipeKwargs``).

        Only torchao's backend composes with ZeRO's sharding here (its float8 linear is plain PyTorch over the same
        parameters); Transformer Engine and MS-AMP replace the modules and the optimizer with their own.
        """
        if getattr(self, "te_recipe_handler", None) is not None or getattr(self, "msamp_recipe_handler", None) is not None:
            which = "TERecipeKwargs" if getattr(self, "te_recipe_handler", None) is not None else "MSAMPRecipeKwargs"
            raise UsageError(f"Accelerator(mixed_precision='fp8') with {which}: hf_zero trains float8 through torchao "
                             "only; pass accelerate.utils.AORecipeKwargs() (or set fp8_backend to torchao) instead")
        section = dict(cfg.get("fp8") or {})
        if section.get("enabled") is False:
            raise UsageError("Accelerator(mixed_precision='fp8') but zero_config's fp8.enabled is false; drop one of them")
        section["enabled"] = True
        handler = getattr(self, "ao_recipe_handler", None)
        ao_config = getattr(handler, "config", None)
        if ao_config is not None:  # the recipe torchao's config describes; its own object is used at conversion
            from torchao.float8.config import ScalingGranularity

            axiswise = ao_config.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
            section.setdefault("recipe", "rowwise" if axiswise else "tensorwise")
            if handler.enable_fsdp_float8_all_gather is not None:
                section.setdefault("fp8_all_gather", bool(handler.enable_fsdp_float8_all_gather))
        cfg["fp8"] = section

    def _float8_objects(self, cfg: Any) -> None:
        """Hand the parsed config torchao's own ``Float8LinearConfig`` and module filter from ``AORecipeKwargs``."""
        handler = getattr(self, "ao_recipe_handler", None)
        if cfg.fp8.enabled and handler is not None:
            cfg.fp8.torchao_config = getattr(handler, "config", None)
            cfg.fp8.module_filter = getattr(handler, "module_filter_func", None)

    def _check_optimizer_sections(self, optimizer: Any, scheduler: Any, real_scheduler: Any) -> None:
        """Accelerate's rules for DeepSpeed's optimizer and scheduler sections, one sentence each."""
        cfg = self.zero_config or {}
        has_opt, has_sched = cfg.get("optimizer") is not None, cfg.get("scheduler") is not None
        if has_opt and optimizer is not None and not isinstance(optimizer, DummyOptim):
            raise UsageError(
                f"{self._config_name} has an optimizer section and prepare() got an optimizer built in code; keep one: "
                "remove the section, or pass hf_zero.DummyOptim(model.parameters()) (from hf_zero import DummyOptim) so "
                "that the section builds it"
            )
        if isinstance(optimizer, DummyOptim) and not has_opt:
            raise UsageError(
                f"prepare() got a DummyOptim but {self._config_name} has no optimizer section to build it from; add the "
                "section or pass a real optimizer"
            )
        if has_sched and real_scheduler is not None:
            raise UsageError(
                f"{self._config_name} has a scheduler section and prepare() got a scheduler built in code; keep one: "
                "remove the section, or pass hf_zero.DummyScheduler(optimizer) (from hf_zero import DummyScheduler) so "
                "that the section builds it"
            )
        if isinstance(scheduler, DummyScheduler) and not has_sched and scheduler.lr_scheduler_callable is None:
            raise UsageError(
                f"prepare() got a DummyScheduler without lr_scheduler_callable but {self._config_name} has no scheduler "
                "section; add the section or pass lr_scheduler_callable"
            )
        if isinstance(optimizer, DummyOptim) and real_scheduler is not None:
            raise UsageError(
                "prepare() got a scheduler built in code with a DummyOptim; a scheduler needs the optimizer the config "
                "builds, so pass hf_zero.DummyScheduler (with the section or lr_scheduler_callable) instead"
            )

    def _held(self, obj: Any) -> Any:
        """What this accelerator already made from ``obj`` (the engine, its optimizer or scheduler), else None.

        A Trainer prepares again what it prepared before (its second ``train()`` hands over the
        optimizer after ``free_memory()`` emptied the lists); that must neither wrap it twice nor
        lose track of the engine, else evaluation would ``.to()`` a model whose shards the engine owns.
        """
        for engine in self._zero_engines:
            mine = isinstance(obj, (ZeroAcceleratedOptimizer, ZeroEngineScheduler)) and getattr(obj, "engine", None) is engine
            if obj is engine or obj is engine.module or mine:
                if not any(m is engine for m in self._models):
                    self._models.append(engine)
                pool = self._optimizers if isinstance(obj, ZeroAcceleratedOptimizer) else self._schedulers
                if mine and not any(o is obj for o in pool):
                    pool.append(obj)
                return obj if mine else engine
        return None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.zero_config is None:
            if any(isinstance(a, (DummyOptim, DummyScheduler)) for a in args):
                raise UsageError(
                    "prepare() got a DummyOptim or DummyScheduler but this Accelerator has no ZeRO config to build them "
                    "from; pass hf_zero.Accelerator(zero_config=...) or start the script with `hf-zero launch --config_file "
                    "X.yaml` (a distributed_type: DEEPSPEED Accelerate YAML), or pass a real optimizer and scheduler"
                )
            return super().prepare(*args, device_placement=device_placement)
        replaced = {id(a): held for a in args if (held := self._held(a)) is not None}
        fresh = [a for a in args if id(a) not in replaced]
        models = [a for a in fresh if isinstance(a, torch.nn.Module)]
        optimizers = [a for a in fresh if isinstance(a, (torch.optim.Optimizer, DummyOptim)) and not isinstance(a, AcceleratedOptimizer)]
        dummies = [a for a in fresh if isinstance(a, DummyScheduler)]
        real = [a for a in fresh if isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        loaders = [a for a in fresh if isinstance(a, torch.utils.data.DataLoader)]
        if len(models) > 1 or len(optimizers) > 1 or len(dummies) > 1:
            raise UsageError("hf_zero's Accelerator prepares one model and one optimizer per call; prepare them together")
        if models and not optimizers:
            raise UsageError(
                "prepare() got a model without its optimizer; with zero_config both must be prepared in the same call"
            )
        if (optimizers or dummies) and not models:
            raise UsageError("prepare() got an optimizer or DummyScheduler without its model; prepare them in the same call")
        if models:
            self._check_optimizer_sections(optimizers[0], dummies[0] if dummies else None, real[0] if real else None)
            replaced.update(self._build_engine(models[0], optimizers[0], dummies[0] if dummies else None, loaders))
        rest = [a for a in args if id(a) not in replaced]
        prepared = super().prepare(*rest) if rest else ()
        it = iter((prepared,) if len(rest) == 1 else prepared)
        out = [replaced[id(a)] if id(a) in replaced else next(it) for a in args]
        if models:  # loaders prepared with the model yield sequence shards under SP (as Accelerate's DeepSpeed path)
            engine = self._zero_engines[-1]
            out = [self.deepspeed_ulysses_dl_adapter(o, engine) if isinstance(o, torch.utils.data.DataLoader) else o for o in out]
        return out[0] if len(out) == 1 else tuple(out)

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """Accelerate's hook for ALST's loader (transformers' Trainer calls it): batches drawn by the ranks of a
        sequence-parallel group are exchanged and cut into this rank's shards (:mod:`hf_zero.sequence.batch`)."""
        engine = self._engine_of(model) or self._engine_of()
        if engine is None:
            return super().deepspeed_ulysses_dl_adapter(dl, model)
        return wrap_sequence_loader(dl, getattr(engine, "sequence_parallel_groups", None), engine.module, engine.device, gather=True)

    def _build_engine(self, model: torch.nn.Module, optimizer: Any, dummy_sched: Any, loaders: list) -> dict[int, Any]:
        """One ZeRO engine from the model and its optimizer (or the config's sections); what replaces what."""
        import hf_zero

        resolved = self._engine_config(loaders, model, optimizer, dummy_sched)
        cfg = hz_parallelism.apply_to(parse_once(resolved), self.parallelism_config, self.state.num_processes)
        self._float8_objects(cfg)
        plugin = getattr(self, "_deepspeed_plugin", None)
        if plugin is not None:  # as Accelerate's prepare leaves it: "auto" resolved in the plugin's own config
            plugin.deepspeed_config.update(copy.deepcopy(resolved))
            self.deepspeed_config = plugin.deepspeed_config
        kwargs: dict[str, Any] = {"model": model, "config": cfg}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
        else:
            kwargs["optimizer"] = optimizer
        if dummy_sched is not None and dummy_sched.lr_scheduler_callable is not None and cfg.scheduler is None:
            kwargs["lr_scheduler"] = dummy_sched.lr_scheduler_callable
        engine, _, _, sched = hf_zero.initialize(**kwargs)
        self._zero_engines.append(engine)
        self._models.append(engine)
        wrapped = ZeroAcceleratedOptimizer(engine)
        self._optimizers.append(wrapped)
        replaced = {id(model): engine, id(optimizer): wrapped}
        if dummy_sched is not None:
            wrapped_sched = ZeroEngineScheduler(sched, wrapped, split_batches=self.split_batches)
            wrapped_sched.engine = engine
            self._schedulers.append(wrapped_sched)
            replaced[id(dummy_sched)] = wrapped_sched
        return replaced

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        """A model an engine already holds comes back as it is: never moved (``.to()`` of stage-3 shards) or wrapped.

        A model prepared for evaluation only (TRL's DPO reference model, a teacher) is, at stage 3, a
        ZeRO-3 engine without optimizer, sharded like the trained model (DeepSpeed's integrations
        initialize it the same way); at stages 0-2 Accelerate places a whole copy on each rank.
        """
        if self.zero_config is not None and self._held(model) is not None:
            return model
        for engine in getattr(self, "_eval_engines", []):
            if model is engine or model is engine.module:
                return engine
        stage = int((self.zero_config or {}).get("zero_optimization", {}).get("stage", 0) or 0)
        if evaluation_mode and stage == 3:
            return self._build_eval_engine(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _build_eval_engine(self, model: torch.nn.Module) -> ZeroEngine:
        """A sharded, optimizer-free engine for a model that only runs forward (the engine freezes it)."""
        import hf_zero

        cfg = self._engine_config([], model)
        for key in ("optimizer", "scheduler"):
            cfg.pop(key, None)
        parsed = hz_parallelism.apply_to(parse_once(cfg), self.parallelism_config, self.state.num_processes)
        engine = hf_zero.initialize(model=model, config=parsed)[0]
        engine.eval()
        self._eval_engines.append(engine)
        return engine

    # ---------------------------------------------------------------- training

    def _engine_of(self, model: Any = None) -> ZeroEngine | None:
        if isinstance(model, ZeroEngine):
            return model
        return self._zero_engines[0] if self._zero_engines and model is None else None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self._engine_of()
        if engine is None:
            return super().backward(loss, **kwargs)
        # As Accelerate does: the loss is averaged over the accumulation steps here.
        loss = loss / self.gradient_accumulation_steps
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """Record the clip for the engine's step and return the global norm of the reduced gradients."""
        engine = self._engine_of()
        if engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if norm_type != 2:
            raise UsageError(f"clip_grad_norm_(norm_type={norm_type}): hf_zero clips by the global L2 norm only")
        engine.set_clip_for_next_step(float(max_norm))
        return engine.current_grad_norm()

    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        if isinstance(model, ZeroEngine):
            yield  # the engine decides when to reduce (stages 0-1 on boundaries, 2-3 every micro-step)
            return
        with super().no_sync(model):
            yield

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if isinstance(model, ZeroEngine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    # ---------------------------------------------------------------- saving

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full weights on every rank (stage-3 units gathered one at a time)."""
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap=unwrap)
        from hf_zero.checkpoint.consolidated import OneUnitAtATime

        units = OneUnitAtATime(engine.train_state())
        with torch.no_grad():
            out = {name: units.full(t).detach().to("cpu", copy=True) for name, t in engine.module.state_dict(keep_vars=True).items()}
        units.release()
        return out

    def save_model(self, model: Any, save_directory: str, max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        engine = self._engine_of(model)
        if engine is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        if not safe_serialization:  # Accelerate's pickles (pytorch_model.bin or its shards), the weights alone
            from hf_zero.checkpoint.consolidated import rank0_state_dict, save_pickled_shards

            engine.wait_params()
            state = rank0_state_dict(engine.train_state())  # whole on rank 0's host only, as Accelerate's ZeRO-3 path
            if state is not None:
                save_pickled_shards(state, save_directory, max_shard_size)
            self.wait_for_everyone()
            return
        engine.save_pretrained(save_directory, max_shard_size=max_shard_size)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Engine checkpoint (weights, optimizer, RNG, counters) plus the prepared schedulers' state."""
        engine = self._engine_of()
        if engine is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if output_dir is None:
            raise UsageError("save_state() needs output_dir with hf_zero (automatic checkpoint naming is not supported)")
        client = {"schedulers": [s.scheduler.state_dict() for s in self._schedulers], "step": int(self.step)}
        engine.save_checkpoint(output_dir, tag="hf_zero", client_state=client)
        return output_dir

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        engine = self._engine_of()
        if engine is None:
            return super().load_state(input_dir, **kwargs)
        if input_dir is None:
            raise UsageError("load_state() needs input_dir with hf_zero")
        _, client = engine.load_checkpoint(input_dir, tag="hf_zero")
        for s, st in zip(self._schedulers, client.get("schedulers", [])):
            s.scheduler.load_state_dict(st)
        self.step = int(client.get("step", 0))
