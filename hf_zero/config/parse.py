"""One walk over a DeepSpeed config dict: typed reads that know their JSON path, and the key rules.

For every JSON object the walk visits, :meth:`Parser.object` first folds DeepSpeed's other
spellings of a key into the name hf_zero uses (refusing two spellings of one key, as DeepSpeed
does), then sorts each key by ``schema``'s tables: acted on (read later with a typed
check), inert (named in one warning if it asks for anything), refused (one sentence naming the
missing feature), or unknown. An unknown key inside a section DeepSpeed 0.19.8 closes (its
pydantic model forbids extra keys: ``bf16``, ``fp16``, ``zero_optimization`` and its offload
sections, ``compile``, the monitors, ...) stops the run, as it stops DeepSpeed, with "did you
mean" where a known key is close (see :func:`hf_zero.config.unknown_keys.suggest`). Elsewhere
DeepSpeed ignores keys it does not read and real configs carry keys of their own tools, so an
unknown key stops the run only when it is a near-certain misspelling of a known one (see
:func:`hf_zero.config.unknown_keys.near_miss`), and is otherwise
named in a warning as ignored. Keys DeepSpeed 0.19.8 refuses that older DeepSpeed accepted (the
sections' ``legacy`` tables, and a fractional ``fp16.min_loss_scale``) are accepted where hf_zero
can run them, and named in a third warning that says DeepSpeed 0.19.8 refuses them. Each warning
names a key once per process: the Trainer parses the config when ``TrainingArguments`` is built
and the engine parses it again.

The parser returns the fields of :class:`hf_zero.config.ZeroConfig` as a dict, so that this
module needs nothing from ``config.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

from hf_zero.config.refusals import refuse_missing_features
from hf_zero.config.schema import (
    ACTIVATION_CHECKPOINTING,
    AIO,
    AUTO,
    BF16,
    CATCHABLE_SIGNALS,
    CHECKPOINT,
    CLOSED_WHOLE,
    COMMUNICATION_DTYPES,
    COMPILE,
    COMPILE_KWARGS,
    COMPILE_MODES,
    DEEPSPEED_ONLY_OPTIMIZERS,
    DEEPSPEED_ONLY_SCHEDULERS,
    EXPERT_PARALLEL,
    EXPERT_PRESETS,
    FLOAT8_RECIPES,
    FP8,
    FP16,
    NONFINITE_LOSS,
    OFFLOAD_DEVICES,
    OFFLOAD_OPTIMIZER,
    OFFLOAD_PARAM,
    OPTIMIZER,
    PIPELINE,
    PIPELINE_SCHEDULES,
    SCHEDULER,
    SECTIONS,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    SWITCH,
    SWITCHES_ACCEPTING_AUTO,
    TAG_VALIDATION,
    TENSOR_PARALLEL,
    TENSOR_PARALLEL_GROUPS,
    TOP,
    TORCH_AUTOCAST,
    TORCH_AUTOCAST_DTYPES,
    ZENFLOW,
    ZERO,
    ConfigError,
    Section,
)
from hf_zero.config.sections import (
    AioConfig,
    BF16Config,
    CompileConfig,
    ExpertParallelConfig,
    Float8Config,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TorchAutocastConfig,
    ZenFlowConfig,
    ZeroOptimizationConfig,
)
from hf_zero.config.unknown_keys import OWN_CLOSED, near_miss, read_elsewhere, suggest, unknown_in_closed
from hf_zero.config.values import (
    Bool,
    Int,
    Number,
    OneOf,
    OpenRatio,
    SignalNames,
    Text,
    asks_for,
    check_quiet_type,
    show,
)

# OWN_CLOSED, near_miss, suggest and refuse_missing_features stay importable from here, where tests and callers
# first found them
__all__ = ["ABSENT", "BATCH_KEYS", "OWN_CLOSED", "Parser", "near_miss", "refuse_missing_features", "suggest"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
ABSENT = object()  # "not given": the field keeps its dataclass default

# (kind, JSON path) already named in a warning by this process: each key is named once.
_WARNED: set[tuple[str, str]] = set()

_OFFLOAD_CHECKS = {
    "device": OneOf(OFFLOAD_DEVICES), "nvme_path": Text("a path"), "buffer_count": Int(0), "buffer_size": Int(0),
    "max_in_cpu": Int(0), "pin_memory": Bool(), "pipeline_read": Bool(), "pipeline_write": Bool(),
    "fast_init": Bool(), "ratio": Number(0.0, maximum=1.0), "super_offload": Bool(),
    "cpuadam_cores_perc": Number(0.0, maximum=1.0),
}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_CANONICAL = {id(section): path for path, section in SECTIONS.items()}  # each walked section's path, as DeepSpeed spells it


class _Object:
    """One JSON object of the config, its keys under hf_zero's names, each remembering the user's spelling."""

    def __init__(self, parser: Parser, values: dict, spelled: dict[str, str], path: str, section: Section) -> None:
        self.parser, self.values, self.spelled, self.path, self.section = parser, values, spelled, path, section

    def where(self, key: str) -> str:
        """The JSON path of ``key`` as the user wrote it."""
        return _join(self.path, self.spelled.get(key, key))

    def get(self, key: str, check: Any, default: Any, nullable: bool = False) -> Any:
        """The checked value of ``key``; ``default`` when absent, null (if ``nullable``) or "auto" (if allowed)."""
        if key not in self.values:
            return default
        value, full = self.values[key], self.where(key)
        if value is None and nullable:
            return None
        if isinstance(value, str) and value == AUTO:
            if key not in self.section.auto:
                raise ConfigError(
                    f"{full}: got 'auto', expected {check.what} (\"auto\" is only allowed where the Trainer fills the value in)"
                )
            self.parser.auto_keys.add(full)
            return default
        return check(value, full)

    def raw(self, key: str, example: str) -> dict:
        """A sub-object; absent or null is an empty one."""
        value = self.values.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{self.where(key)}: got {show(value)}, expected an object like {example}")
        return value


class Parser:
    """Builds the fields of a ZeroConfig from the user's dict; collects "auto" paths and the keys to warn about."""

    def __init__(self) -> None:
        self.auto_keys: set[str] = set()
        self.ignored: list[str] = []  # inert DeepSpeed keys that ask for something
        self.unknown: list[str] = []  # keys DeepSpeed does not know either
        self.legacy: list[str] = []  # keys DeepSpeed 0.19.8 refuses, older DeepSpeed accepted, and hf_zero runs

    def parse(self, data: dict) -> dict[str, Any]:
        """The ZeroConfig fields the config sets (those it leaves out keep the dataclass defaults)."""
        top = self.object(data, "", TOP)
        # ABSENT (absent, or "auto") leaves the field to ZeroConfig's default, the one copy of it
        fields: dict[str, Any] = {name: top.get(name, Int(1), ABSENT) for name in BATCH_KEYS}
        fields["gradient_clipping"] = top.get("gradient_clipping", Number(), ABSENT)
        fields["communication_data_type"] = top.get("communication_data_type", OneOf(COMMUNICATION_DTYPES), ABSENT,
                                                    nullable=True)
        top.get("gradient_predivide_factor", Number(0.0, strict=True), ABSENT)  # inert, but a value must make sense
        # inf (DeepSpeed takes it: no step count is a multiple of it) is what Accelerate's DeepSpeedPlugin writes for "never"
        spp = top.values.get("steps_per_print")
        fields["steps_per_print"] = None if spp == math.inf else top.get("steps_per_print", Int(1), ABSENT, nullable=True)
        fields["wall_clock_breakdown"] = top.get("wall_clock_breakdown", Bool(), ABSENT)
        fields["seed"] = top.get("seed", Int(0), ABSENT, nullable=True)
        fields["sequence_parallel_size"] = top.get("sequence_parallel_size", Int(1), ABSENT)
        fields["activation_checkpointing"] = self.activation_checkpointing(top)
        fields["compile"] = self.compile(top)
        aio = self.object(top.raw("aio", '{"block_size": 1048576, "queue_depth": 8}'), "aio", AIO)
        fields["aio"] = AioConfig(
            block_size=aio.get("block_size", Int(1), AioConfig.block_size),
            queue_depth=aio.get("queue_depth", Int(1), AioConfig.queue_depth),
            intra_op_parallelism=aio.get("intra_op_parallelism", Int(1), AioConfig.intra_op_parallelism),
            single_submit=aio.get("single_submit", Bool(), AioConfig.single_submit),
        )
        fields["nonfinite_loss"] = top.get("nonfinite_loss", OneOf(NONFINITE_LOSS), ABSENT)
        checkpoint = self.object(top.raw("checkpoint", '{"keep_last": 3}'), "checkpoint", CHECKPOINT)
        fields["checkpoint_keep_last"] = checkpoint.get("keep_last", Int(1), ABSENT, nullable=True)
        fields["checkpoint_tag_validation"] = checkpoint.get("tag_validation", OneOf(TAG_VALIDATION), ABSENT)
        fields["checkpoint_save_on_signal"] = checkpoint.get("save_on_signal", SignalNames(CATCHABLE_SIGNALS), ABSENT,
                                                             nullable=True)
        fields["checkpoint_save_dir"] = checkpoint.get("save_dir", Text("a folder path (a non-empty string)"), ABSENT,
                                                       nullable=True)
        if fields["checkpoint_save_dir"] == "":
            raise ConfigError(f"{checkpoint.where('save_dir')}: got '', expected a folder path (a non-empty string)")
        fields["checkpoint_grace_seconds"] = checkpoint.get("grace_seconds", Number(0.0, strict=True), ABSENT, nullable=True)
        fields["checkpoint_async_save"] = checkpoint.get("async_save", Bool(), ABSENT)
        fields["optimizer"] = self.named(top, "optimizer", OptimizerConfig, SUPPORTED_OPTIMIZERS, DEEPSPEED_ONLY_OPTIMIZERS)
        fields["scheduler"] = self.named(top, "scheduler", SchedulerConfig, SUPPORTED_SCHEDULERS, DEEPSPEED_ONLY_SCHEDULERS)
        fields["fp16"] = self.fp16(top)
        bf16 = self.object(top.raw("bf16", '{"enabled": true}'), top.where("bf16"), BF16)
        fields["bf16"] = BF16Config(
            enabled=bf16.get("enabled", Bool(), BF16Config.enabled),
            master_weights_and_grads=bf16.get("bf16_master_weights_and_grads", Bool(), False),
            optimizer_states=bf16.get("bf16_optimizer_states", Bool(), False),
        )
        fields["torch_autocast"] = self.torch_autocast(top)
        fields["fp8"] = self.fp8(top)
        if fields["fp8"].enabled and fields["fp16"].enabled:
            raise ConfigError("fp8.enabled: got True while fp16.enabled is also True; float8 training keeps its "
                              'parameters in bf16 (torchao\'s recipes are tuned for it): use "bf16": {"enabled": true}')
        if fields["fp16"].enabled and fields["bf16"].enabled:
            raise ConfigError(f"fp16.enabled: got True while {bf16.path}.enabled is also True; "
                              "enable at most one of fp16 and bf16")
        fields["zero_optimization"] = self.zero(top)
        fields["pipeline"] = self.pipeline(top)
        fields["tensor_parallel_size"] = self.tensor_parallel(top)
        fields["expert_parallel"] = self.expert_parallel(top)
        fields["auto_keys"] = self.auto_keys
        return {name: value for name, value in fields.items() if value is not ABSENT}

    # ------------------------------------------------------------ keys

    def object(self, data: dict, path: str, section: Section) -> _Object:
        """Fold aliases into hf_zero's names, then put every key in its group (see the module doc)."""
        values: dict = {}
        spelled: dict[str, str] = {}
        for key, value in data.items():
            name = section.aliases.get(key, key)
            if name in values:
                first, second = (key, spelled[name]) if key in section.aliases else (spelled[name], key)
                if first in section.older:
                    raise ConfigError(f"{_join(path, first)}: given together with {second}, its newer name; "
                                      "keep only the newer one")
                raise ConfigError(f"{_join(path, first)}: given together with {second}, another name of the same "
                                  "DeepSpeed setting; keep one")
            values[name], spelled[name] = value, key
        obj = _Object(self, values, spelled, path, section)
        for name, value in values.items():
            self.sort(obj, name, value)
        return obj

    def sort(self, obj: _Object, name: str, value: Any) -> None:
        """One key: checked and (if it asks for something) warned about, refused, or unknown."""
        section, full = obj.section, obj.where(name)
        if name in section.unsupported or name in section.inert:
            self.closed_whole(value, _join(_CANONICAL[id(section)], name), full)
            if name in section.legacy:
                self.legacy.append(f"{full} ({section.legacy[name]})")
            if isinstance(value, str) and value == AUTO and name in section.auto:
                self.auto_keys.add(full)
                return
            quiet = section.unsupported[name][0] if name in section.unsupported else section.inert[name]
            check_quiet_type(value, quiet, full)
            if quiet is SWITCH and isinstance(value, dict) and value.get("enabled") == AUTO:
                if name not in SWITCHES_ACCEPTING_AUTO:
                    raise ConfigError(f"{full}.enabled: got 'auto', expected True or False")
                self.auto_keys.add(f"{full}.enabled")
            if asks_for(value, quiet):
                if name in section.unsupported:
                    where, given = (f"{full}.enabled", True) if quiet is SWITCH else (full, value)
                    raise ConfigError(f"{where}: got {show(given)}, but {section.unsupported[name][1]}")
                self.ignored.append(full)
        elif name in section.legacy and name in section.keys:  # a key hf_zero acts on that DeepSpeed 0.19.8 refuses (MiCS's mics_shard_size)
            self.legacy.append(f"{full} ({section.legacy[name]})")
        elif name not in section.keys:
            dropped = isinstance(value, str) and value == AUTO  # DeepSpeed drops "auto" values before validating
            if section.closed and not dropped:
                raise ConfigError(unknown_in_closed(full, obj.spelled[name], obj.path, section.names()))
            close = near_miss(obj.spelled[name], section.names())
            if close is not None:
                raise ConfigError(f"{full}: unknown key; did you mean {close!r}?")
            self.unknown.append(full + read_elsewhere(obj.spelled[name]))

    def closed_whole(self, value: Any, path: str, full: str) -> None:
        """Unknown keys inside a section hf_zero takes whole, where DeepSpeed closes it (``CLOSED_WHOLE``), and below.

        ``path`` is the section's path in DeepSpeed's spelling, ``full`` as the user wrote it.
        """
        if not isinstance(value, dict):
            return
        names = CLOSED_WHOLE.get(path)
        for key, sub in value.items():
            if names is not None and key not in names:
                if isinstance(sub, str) and sub == AUTO:  # dropped by DeepSpeed before validating
                    self.unknown.append(_join(full, key))
                    continue
                raise ConfigError(unknown_in_closed(_join(full, key), key, full, names))
            self.closed_whole(sub, _join(path, key), _join(full, key))

    def warn(self) -> None:
        """The three warnings, each naming only keys this process has not named before."""
        for kind, names, text in (
            ("inert", self.ignored, "hf_zero accepts but ignores these DeepSpeed keys"),
            ("unknown", self.unknown, "hf_zero ignores these keys, which are not DeepSpeed config keys"),
            ("legacy", self.legacy, "hf_zero accepts these keys, which older DeepSpeed accepted but DeepSpeed 0.19.8 "
                                    "refuses"),
        ):
            new = [name for name in dict.fromkeys(names) if (kind, name) not in _WARNED]
            if new:
                _WARNED.update((kind, name) for name in new)
                warnings.warn(f"{text}: {', '.join(new)}", UserWarning, stacklevel=3)

    # ------------------------------------------------------------ sections

    def activation_checkpointing(self, top: _Object) -> dict:
        section = top.raw("activation_checkpointing", '{"partition_activations": false}')
        self.object(section, "activation_checkpointing", ACTIVATION_CHECKPOINTING)
        for key in ("checkpoint_blocks", "cpu_checkpointing"):
            if not isinstance(section.get(key, False), bool):
                raise ConfigError(f"activation_checkpointing.{key}: got {show(section[key])}, expected true or false")
        keep = section.get("keep_attention", "auto")
        if not isinstance(keep, bool) and keep != "auto":
            raise ConfigError(f'activation_checkpointing.keep_attention: got {show(keep)}, expected true, false or "auto"')
        return copy.deepcopy(section)

    def compile(self, top: _Object) -> CompileConfig:
        """``compile``: enabled, a ``torch._dynamo`` backend name, and torch.compile's own keyword arguments."""
        obj = self.object(top.raw("compile", '{"enabled": true, "backend": "inductor"}'), "compile", COMPILE)
        out = CompileConfig(enabled=obj.get("enabled", Bool(), False))
        if "backend" in obj.values:
            backend = obj.values["backend"]
            import torch._dynamo

            known = tuple(torch._dynamo.list_backends(exclude_tags=()))
            if not isinstance(backend, str) or backend not in known:
                raise ConfigError(f"compile.backend: got {show(backend)}, expected one of {', '.join(known)}")
            out.backend = backend
        kwargs = obj.values.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ConfigError(f"compile.kwargs: got {show(kwargs)}, expected an object like {{\"mode\": \"max-autotune\"}}")
        for key, value in kwargs.items():
            full = f"compile.kwargs.{key}"
            if key not in COMPILE_KWARGS:
                raise ConfigError(f"{full}: not an argument of torch.compile here; expected one of {', '.join(COMPILE_KWARGS)}")
            if key == "mode":
                value = OneOf(COMPILE_MODES)(value, full)
            elif key in ("fullgraph", "dynamic"):
                if value is not None and not isinstance(value, bool):
                    raise ConfigError(f"{full}: got {show(value)}, expected true, false or null")
            elif not isinstance(value, dict):
                raise ConfigError(f"{full}: got {show(value)}, expected an object of inductor options")
            out.kwargs[key] = value
        if "mode" in out.kwargs and "options" in out.kwargs:
            raise ConfigError("compile.kwargs: torch.compile takes mode or options, not both; keep one")
        return out

    def named(self, top: _Object, key: str, cls: type, supported: tuple, deepspeed_only: tuple) -> Any:
        """``optimizer`` / ``scheduler``: a supported ``type`` and a ``params`` object (its "auto" values left out)."""
        if top.values.get(key) is None:
            return None
        section = top.raw(key, f'{{"type": "{supported[0]}", "params": {{...}}}}')
        self.object(section, key, OPTIMIZER if key == "optimizer" else SCHEDULER)
        if "type" not in section:
            raise ConfigError(f"{key}.type: missing; expected one of {', '.join(supported)}")
        given = section["type"]
        canonical = {name.lower(): name for name in supported}
        if not isinstance(given, str) or given.lower() not in canonical:
            allowed = ", ".join(supported)
            if isinstance(given, str) and given.lower() in {name.lower() for name in deepspeed_only}:
                raise ConfigError(f"{key}.type: got {given!r}, which hf_zero does not support yet; expected one of {allowed}")
            close = near_miss(given, supported) if isinstance(given, str) else None
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(f"{key}.type: got {show(given)}, expected one of {allowed}{hint}")
        params = section.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            example = '{"lr": 0.001}' if key == "optimizer" else '{"warmup_num_steps": 100}'
            raise ConfigError(f"{key}.params: got {show(params)}, expected an object like {example}")
        kept = {}
        for name, value in params.items():
            if isinstance(value, str) and value == AUTO:
                self.auto_keys.add(f"{key}.params.{name}")
            else:
                kept[name] = copy.deepcopy(value)
        return cls(type=canonical[given.lower()], params=kept)

    def torch_autocast(self, top: _Object) -> TorchAutocastConfig:
        """``torch_autocast``: enabled and a dtype in any of DeepSpeed's spellings ("torch.bfloat16", "bf16", "half", ...)."""
        obj = self.object(top.raw("torch_autocast", '{"enabled": true, "dtype": "bfloat16"}'), "torch_autocast",
                          TORCH_AUTOCAST)
        out = TorchAutocastConfig(enabled=obj.get("enabled", Bool(), False))
        given = obj.values.get("dtype")
        if given is not None:
            spellings = {"bf16": ("torch.bfloat16", "bf16", "bfloat16"),
                         "fp16": ("torch.float16", "fp16", "float16", "half")}
            name = next((k for k, names in spellings.items() if given in names), None)
            if name is None:
                every = ", ".join(repr(n) for k in TORCH_AUTOCAST_DTYPES for n in spellings[k])
                raise ConfigError(f"torch_autocast.dtype: got {show(given)}, expected a 16-bit dtype: one of {every}")
            out.dtype = name
        return out

    def fp8(self, top: _Object) -> Float8Config:
        """``fp8``: hf_zero's float8 section; torchao itself is looked for when the engine converts the model."""
        obj = self.object(top.raw("fp8", '{"enabled": true, "recipe": "tensorwise"}'), "fp8", FP8)
        out = Float8Config(
            enabled=obj.get("enabled", Bool(), False),
            recipe=obj.get("recipe", OneOf(FLOAT8_RECIPES), Float8Config.recipe),
            fp8_all_gather=obj.get("fp8_all_gather", Bool(), Float8Config.fp8_all_gather),
            emulate=obj.get("emulate", Bool(), False),
        )
        skip = obj.values.get("skip")
        if skip is not None:
            if not isinstance(skip, list) or not all(isinstance(x, str) and x for x in skip):
                raise ConfigError(f"fp8.skip: got {show(skip)}, expected a list of module-name patterns like [\"lm_head\"]")
            import re

            for pattern in skip:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ConfigError(f"fp8.skip: {pattern!r} is not a regular expression ({e}); escape it or fix it") from e
            out.skip = tuple(skip)
        return out

    def fp16(self, top: _Object) -> FP16Config:
        """``fp16``. As DeepSpeed, ``loss_scale_window`` and ``min_loss_scale`` must be positive only where dynamic
        scaling reads them (fp16 on, ``loss_scale`` 0); a fractional ``min_loss_scale``, which DeepSpeed read before
        0.17.1 and 0.19.8 refuses (an integer field), is accepted and named (Chinese-LLaMA-Alpaca's 1e-10)."""
        obj = self.object(top.raw("fp16", '{"enabled": true}'), "fp16", FP16)
        d = FP16Config()
        enabled = obj.get("enabled", Bool(), d.enabled)
        loss_scale = obj.get("loss_scale", Number(), d.loss_scale)
        dynamic = enabled and loss_scale == 0
        min_loss_scale = obj.get("min_loss_scale", Number(0.0, strict=True) if dynamic else Number(None),
                                 d.min_loss_scale)
        if not float(min_loss_scale).is_integer():
            self.legacy.append(f"{obj.where('min_loss_scale')} ({min_loss_scale:g}: an integer since DeepSpeed 0.17.1)")
        return FP16Config(
            enabled=enabled,
            loss_scale=loss_scale,
            initial_scale_power=obj.get("initial_scale_power", Int(0), d.initial_scale_power),
            loss_scale_window=obj.get("loss_scale_window", Int(1) if dynamic else Int(None), d.loss_scale_window),
            hysteresis=obj.get("hysteresis", Int(1), d.hysteresis),
            consecutive_hysteresis=obj.get("consecutive_hysteresis", Bool(), d.consecutive_hysteresis),
            min_loss_scale=min_loss_scale,
            auto_cast=obj.get("auto_cast", Bool(), d.auto_cast),
        )

    def pipeline(self, top: _Object) -> PipelineConfig:
        obj = self.object(top.raw("pipeline", '{"schedule": "1f1b"}'), "pipeline", PIPELINE)
        d = PipelineConfig()
        return PipelineConfig(
            stages=obj.get("stages", Int(1), d.stages),
            activation_checkpoint_interval=obj.get("activation_checkpoint_interval", Int(0), d.activation_checkpoint_interval),
            schedule=obj.get("schedule", OneOf(PIPELINE_SCHEDULES), d.schedule),
        )

    def tensor_parallel(self, top: _Object) -> int:
        """``tensor_parallel.autotp_size`` (0 and 1: off), with ``tensor_parallel.tp.tp_size`` allowed to repeat it."""
        obj = self.object(top.raw("tensor_parallel", '{"autotp_size": 2}'), "tensor_parallel", TENSOR_PARALLEL)
        size = obj.get("autotp_size", Int(0), 0)
        inner = self.object(obj.raw("tensor_parallel", '{"tp_size": 2}'), obj.where("tensor_parallel"),
                            TENSOR_PARALLEL_GROUPS)
        tp_size = inner.get("tp_size", Int(1), 1)
        if tp_size not in (1, size):
            raise ConfigError(f"{inner.where('tp_size')}: got {tp_size}, but tensor_parallel.autotp_size is {size}; "
                              "give the same degree in both, or remove tp_size")
        return max(size, 1)

    def expert_parallel(self, top: _Object) -> ExpertParallelConfig:
        """DeepSpeed's AutoEP section: ``enabled``, ``autoep_size``, ``preset_model``, ``use_grouped_mm``, ``top_k``;
        ``expert_tensor_parallel_size`` only at 1. What needs the world size or the model is checked by
        ``hf_zero/expert/setup.py`` when both are known."""
        obj = self.object(top.raw("expert_parallel", '{"enabled": true, "autoep_size": 2}'), "expert_parallel",
                          EXPERT_PARALLEL)
        d = ExpertParallelConfig()
        etp = obj.get("expert_tensor_parallel_size", Int(1), 1)
        if etp != 1:
            raise ConfigError(f"{obj.where('expert_tensor_parallel_size')}: got {etp}, but splitting each expert over "
                              "a tensor-parallel group is not supported yet; set it to 1 or remove it")
        top_k = obj.get("top_k", Int(1), d.top_k) if obj.values.get("top_k") != AUTO else None
        return ExpertParallelConfig(
            enabled=obj.get("enabled", Bool(), d.enabled),
            size=obj.get("autoep_size", Int(1), d.size),
            preset_model=obj.get("preset_model", OneOf(tuple(EXPERT_PRESETS)), d.preset_model, nullable=True),
            use_grouped_mm=obj.get("use_grouped_mm", Bool(), d.use_grouped_mm),
            top_k=top_k,
        )

    def zero(self, top: _Object) -> ZeroOptimizationConfig:
        given = top.values.get("zero_optimization")
        if isinstance(given, bool):  # DeepSpeed's oldest form: true is stage 1
            return ZeroOptimizationConfig(stage=int(given))
        obj = self.object(top.raw("zero_optimization", '{"stage": 2}'), "zero_optimization", ZERO)
        d = ZeroOptimizationConfig()
        return ZeroOptimizationConfig(
            stage=obj.get("stage", OneOf((0, 1, 2, 3)), d.stage),
            reduce_bucket_size=obj.get("reduce_bucket_size", Int(1), d.reduce_bucket_size),
            stage3_prefetch_bucket_size=obj.get("stage3_prefetch_bucket_size", Int(0), d.stage3_prefetch_bucket_size),
            stage3_param_persistence_threshold=obj.get("stage3_param_persistence_threshold", Int(0),
                                                       d.stage3_param_persistence_threshold),
            stage3_max_live_parameters=obj.get("stage3_max_live_parameters", Int(0), d.stage3_max_live_parameters),
            stage3_max_reuse_distance=obj.get("stage3_max_reuse_distance", Int(0), d.stage3_max_reuse_distance),
            offload_optimizer=self.offload_optimizer(obj),
            offload_param=self.offload(obj, "offload_param", OffloadParamConfig),
            overlap_param_gather=obj.get("overlap_param_gather", Bool(), d.overlap_param_gather),
            mics_shard_size=obj.get("mics_shard_size", Int(None), d.mics_shard_size),
            ignore_unused_parameters=obj.get("ignore_unused_parameters", Bool(), d.ignore_unused_parameters),
            sub_group_size=obj.get("sub_group_size", Int(0), d.sub_group_size),
            zenflow=self.zenflow(obj),
        )

    def zenflow(self, zero: _Object) -> ZenFlowConfig | None:
        """``zenflow``: every key of DeepSpeed 0.19.8's ``ZenFlowConfig``, its defaults and the checks its model and its
        ``configure_zenflow`` make (the ones that need the epoch's length wait for it: hf_zero/zero/zenflow.py); None
        when absent or null, as DeepSpeed leaves ZenFlow off then."""
        if zero.values.get("zenflow") is None:
            return None
        obj = self.object(zero.raw("zenflow", '{"topk_ratio": 0.1, "update_interval": 4}'), zero.where("zenflow"),
                          ZENFLOW)
        d = ZenFlowConfig()

        def interval(key: str, minimum: int) -> int | str:
            # "auto" is a value of its own here (DeepSpeed's default), not a placeholder the Trainer fills
            value = obj.values.get(key, d.select_interval if key == "select_interval" else d.update_interval)
            if isinstance(value, str) and value == "auto":
                return "auto"
            if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer() \
                    or value < minimum:
                count = "a whole number of steps" if minimum == 0 else "a whole number of steps, at least 1"
                raise ConfigError(f"{obj.where(key)}: got {show(value)}, expected \"auto\" or {count}")
            return int(value)

        out = ZenFlowConfig(
            topk_ratio=obj.get("topk_ratio", OpenRatio(), d.topk_ratio),
            select_strategy=obj.get("select_strategy", OneOf(("auto", "step", "epoch")), d.select_strategy),
            select_interval=interval("select_interval", 0),
            update_interval=interval("update_interval", 1),
            overlap_step=obj.get("overlap_step", Bool(), d.overlap_step),
            offload=obj.get("offload", Bool(), d.offload),
            auto_ratio=obj.get("auto_ratio", Number(0.0, maximum=1.0), d.auto_ratio),
            full_warm_up_rounds=obj.get("full_warm_up_rounds", Int(0), d.full_warm_up_rounds),
            pt_reserved_cores_perc=obj.get("pt_reserved_cores_perc", Number(0.0, maximum=1.0), d.pt_reserved_cores_perc),
            steps_per_epoch=obj.get("steps_per_epoch", Int(1), d.steps_per_epoch, nullable=True),
        )
        # DeepSpeed 0.19.8's configure_zenflow: "auto" selection is once an epoch, and a reselection needs a flush first
        if out.select_strategy == "auto" and out.select_interval != "auto":
            raise ConfigError(f"{obj.where('select_interval')}: got {show(out.select_interval)} with select_strategy "
                              "\"auto\", which chooses the columns again once an epoch; set select_strategy to \"step\" "
                              "or \"epoch\" to give an interval, or remove select_interval")
        if out.select_strategy != "auto" and out.select_interval == "auto":
            raise ConfigError(f"{obj.where('select_interval')}: got \"auto\" with select_strategy "
                              f"{show(out.select_strategy)}, which needs a number (of steps or epochs); give one, or set "
                              "select_strategy to \"auto\"")
        if (out.select_strategy == "step" and isinstance(out.update_interval, int) and out.select_interval != 0
                and out.select_interval < out.update_interval):  # type: ignore[operator]
            raise ConfigError(f"{obj.where('select_interval')}: got {out.select_interval}, less than update_interval "
                              f"{out.update_interval}; the columns can be chosen again only after the others' update, so "
                              "give a select_interval of at least update_interval (0: choose them once)")
        return out

    def offload_optimizer(self, zero: _Object) -> OffloadOptimizerConfig | None:
        """``offload_optimizer``, or DeepSpeed's deprecated ``cpu_offload`` converted as DeepSpeed 0.19.8 converts it.

        DeepSpeed still reads ``"cpu_offload": true`` (the ZeRO-Offload tutorial's spelling, in older configs) as
        ``"offload_optimizer": {"device": "cpu"}`` with a deprecation warning, ``false`` as no offload, and refuses
        it beside ``offload_optimizer``; hf_zero does the same (``false``, which asks for nothing, without a warning).
        """
        if "cpu_offload" not in zero.values:
            return self.offload(zero, "offload_optimizer", OffloadOptimizerConfig)
        on = zero.get("cpu_offload", Bool(), False, nullable=True)
        if "offload_optimizer" in zero.values:
            raise ConfigError(f"{zero.where('cpu_offload')}: given together with offload_optimizer, which replaces it; "
                              "keep only offload_optimizer")
        if on and ("deprecated", zero.where("cpu_offload")) not in _WARNED:
            _WARNED.add(("deprecated", zero.where("cpu_offload")))
            warnings.warn(f"{zero.where('cpu_offload')}: true is DeepSpeed's deprecated spelling, read as DeepSpeed reads "
                          'it; write "offload_optimizer": {"device": "cpu"} instead', UserWarning, stacklevel=4)
        return OffloadOptimizerConfig(device="cpu") if on else None

    def offload(self, zero: _Object, key: str, cls: type) -> Any:
        """An offload section in full, DeepSpeed's defaults for what it leaves out; None when absent."""
        if zero.values.get(key) is None:
            return None
        section = OFFLOAD_OPTIMIZER if key == "offload_optimizer" else OFFLOAD_PARAM
        obj = self.object(zero.raw(key, '{"device": "cpu", "pin_memory": true}'), zero.where(key), section)
        defaults, out = cls(), {}
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            value = obj.get(f.name, _OFFLOAD_CHECKS[f.name], default, nullable=f.name in ("device", "nvme_path"))
            out[f.name] = default if value is None else value
        return cls(**out)
