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
``zero_config`` may also come from the ``HF_ZERO_CONFIG`` environment variable, so
``accelerate launch`` needs no new config key.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer

from hf_zero.engine import UsageError, ZeroEngine
from hf_zero.sequence.setup import merge_sp_size, sp_size_of
from hf_zero.sequence.setup import wrap_loader as wrap_sequence_loader

ENV_VAR = "HF_ZERO_CONFIG"


def load_zero_config(zero_config: str | os.PathLike | dict | None) -> dict | None:
    """The config as a dict (a path is read as JSON); ``None`` falls back to ``$HF_ZERO_CONFIG``."""
    if zero_config is None:
        zero_config = os.environ.get(ENV_VAR) or None
    if zero_config is None or isinstance(zero_config, dict):
        return None if zero_config is None else _no_pipeline(dict(zero_config), "(dict)")
    path = os.fspath(zero_config)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"zero_config: {path} does not exist; pass a DeepSpeed-style JSON file or a dict")
    with open(path) as f:
        return _no_pipeline(json.load(f), path)


def _no_pipeline(config: Any, where: str) -> Any:
    """A ``pipeline`` section cannot be honoured here: Trainer and Accelerate loops call the model as a whole."""
    if isinstance(config, dict) and config.get("pipeline"):
        raise UsageError(
            f"zero_config {where} has a pipeline section, but Trainer/Accelerator train the model unsplit; "
            "run pipelines with hf_zero.initialize(model=hf_zero.pipe.split_causal_lm(...)) and engine.train_batch, "
            "or remove the section"
        )
    return config


MIN_AUTO_REDUCE_BUCKET = 25_000_000  # elements; 50 MB in bf16, twice DDP's default bucket


def fill_bucket_autos(cfg: dict, model: torch.nn.Module) -> None:
    """``"auto"`` bucket sizes from the model's hidden size, by the rule transformers uses for DeepSpeed,
    except that a gradient bucket is never under :data:`MIN_AUTO_REDUCE_BUCKET` elements.

    transformers' ``hidden_size**2`` gives a BERT-large 1M-element buckets: ~330 reduce-scatters and
    all-gathers per step, each paying launch latency and a hook's Python, which made ZeRO-2 run at
    0.46x of DDP in ``scripts/bench_finetune.py`` on 2 H200s. The floor keeps buckets in the tens of MB
    DDP uses, while large models (hidden 8192: 67M) keep transformers' value.
    """
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict):
        return
    mc = getattr(model, "config", None)
    hidden = getattr(mc, "hidden_size", None) or max(getattr(mc, "hidden_sizes", None) or [0]) or None
    rules = {
        "reduce_bucket_size": lambda h: max(h * h, MIN_AUTO_REDUCE_BUCKET),
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    zo = dict(zo)
    for key, rule in rules.items():
        if zo.get(key) == "auto":
            if hidden is None:
                raise UsageError(
                    f"zero_optimization.{key} is \"auto\" but the model has no config.hidden_size to derive it from; "
                    "set it to a number"
                )
            zo[key] = rule(int(hidden))
    cfg["zero_optimization"] = zo


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


class Accelerator(accelerate.Accelerator):
    """Accelerate's ``Accelerator`` whose ``prepare`` builds a ZeRO engine from ``zero_config``.

    Without a ``zero_config`` (argument or ``$HF_ZERO_CONFIG``) it is exactly Accelerate's.
    """

    def __init__(self, *args: Any, zero_config: str | os.PathLike | dict | None = None, **kwargs: Any) -> None:
        zero = load_zero_config(zero_config)
        # Accelerate accepts sp_size only for its DeepSpeed and multi-GPU types; hf_zero's engine runs it
        # everywhere (gloo included), so the config is attached after Accelerate's own checks.
        pc = kwargs.pop("parallelism_config", None) if zero is not None and sp_size_of(kwargs.get("parallelism_config")) > 1 else None
        super().__init__(*args, **kwargs)
        if pc is not None:
            self.state.parallelism_config = pc
        self.zero_config = zero
        self._zero_engines: list[ZeroEngine] = []

    # ---------------------------------------------------------------- prepare

    def _engine_config(self, loaders: list[torch.utils.data.DataLoader], model: torch.nn.Module) -> dict:
        assert self.zero_config is not None
        cfg = merge_sp_size(dict(self.zero_config), sp_size_of(self.parallelism_config))
        fill_bucket_autos(cfg, model)
        micro = cfg.get("train_micro_batch_size_per_gpu")
        if micro in (None, "auto"):
            sizes = [dl.batch_size for dl in loaders if getattr(dl, "batch_size", None)]
            cfg["train_micro_batch_size_per_gpu"] = int(sizes[0]) if sizes else 1
        gas = cfg.get("gradient_accumulation_steps")
        if gas in (None, "auto"):
            cfg["gradient_accumulation_steps"] = int(self.gradient_accumulation_steps)
        elif int(gas) != int(self.gradient_accumulation_steps):
            raise UsageError(
                f"zero_config.gradient_accumulation_steps is {gas} but the Accelerator was built with "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}; set one of them to match (or \"auto\")"
            )
        if cfg.get("train_batch_size") == "auto":
            del cfg["train_batch_size"]
        if cfg.get("gradient_clipping") == "auto":
            cfg["gradient_clipping"] = 0.0  # the loop clips with accelerator.clip_grad_norm_
        mp = str(self.mixed_precision)
        for key, on in (("bf16", mp == "bf16"), ("fp16", mp == "fp16")):
            section = cfg.get(key)
            if isinstance(section, dict) and section.get("enabled") == "auto":
                cfg[key] = dict(section, enabled=on)
        if cfg.get("optimizer") is not None:
            raise UsageError(
                "zero_config has an optimizer section but Accelerate prepares the optimizer you built; remove "
                "the section and pass your optimizer to prepare()"
            )
        if cfg.get("scheduler") is not None:
            raise UsageError("zero_config has a scheduler section; build the scheduler yourself and pass it to prepare()")
        cfg.pop("scheduler", None)
        return cfg

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.zero_config is None:
            return super().prepare(*args, device_placement=device_placement)
        import hf_zero

        models = [a for a in args if isinstance(a, torch.nn.Module) and not isinstance(a, ZeroEngine)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)]
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        if len(models) > 1 or len(optimizers) > 1:
            raise UsageError("hf_zero's Accelerator prepares one model and one optimizer per call; prepare them together")
        if models and not optimizers:
            raise UsageError(
                "prepare() got a model without its optimizer; with zero_config both must be prepared in the same call"
            )
        if optimizers and not models:
            raise UsageError("prepare() got an optimizer without its model; prepare them in the same call")
        replaced: dict[int, Any] = {}
        if models:
            engine, _, _, _ = hf_zero.initialize(model=models[0], optimizer=optimizers[0], config=self._engine_config(loaders, models[0]))
            self._zero_engines.append(engine)
            self._models.append(engine)
            wrapped = ZeroAcceleratedOptimizer(engine)
            self._optimizers.append(wrapped)
            replaced[id(models[0])] = engine
            replaced[id(optimizers[0])] = wrapped
        rest = [a for a in args if id(a) not in replaced]
        prepared = super().prepare(*rest) if rest else ()
        it = iter((prepared,) if len(rest) == 1 else prepared)
        out = [replaced[id(a)] if id(a) in replaced else next(it) for a in args]
        if models:  # loaders prepared with the model yield sequence shards under SP (as Accelerate's DeepSpeed path)
            out = [self.deepspeed_ulysses_dl_adapter(o, engine) if isinstance(o, torch.utils.data.DataLoader) else o for o in out]
        return out[0] if len(out) == 1 else tuple(out)

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """Accelerate's hook for ALST's loader (transformers' Trainer calls it): batches drawn by the ranks of a
        sequence-parallel group are exchanged and cut into this rank's shards (:mod:`hf_zero.sequence.batch`)."""
        engine = self._engine_of(model) or self._engine_of()
        if engine is None:
            return super().deepspeed_ulysses_dl_adapter(dl, model)
        return wrap_sequence_loader(dl, getattr(engine, "sequence_parallel_groups", None), engine.module, engine.device, gather=True)

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

        units = OneUnitAtATime(engine)
        with torch.no_grad():
            out = {name: units.full(t).detach().to("cpu", copy=True) for name, t in engine.module.state_dict(keep_vars=True).items()}
        units.release()
        return out

    def save_model(self, model: Any, save_directory: str, max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        engine = self._engine_of(model)
        if engine is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        if not safe_serialization:
            raise UsageError("save_model(safe_serialization=False): hf_zero writes safetensors only")
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
