"""ZeroConfig: DeepSpeed's config JSON as typed dataclasses, validated before any work starts.

A run that will fail should fail here, on every rank alike, before a process group or a
model exists. So every problem is one ``ConfigError`` sentence with the JSON path, what was
given and what is allowed (``zero_optimization.stage: got 4, expected one of 0, 1, 2, 3``);
unknown keys get a "did you mean"; DeepSpeed keys that hf_zero accepts but does not act on are
named once in a warning; DeepSpeed features it does not have (offload, Apex AMP, ...) are
errors, because training silently without them would not be the run the user configured.
Which key falls in which group is tabulated in ``config_schema.py``.

``"auto"`` (written by Hugging Face's DeepSpeed configs) means "not given" at this layer: the
batch keys stay ``None`` and are derived by :meth:`ZeroConfig.resolve_batch_sizes`, other keys
take their default, and every such JSON path is recorded in ``auto_keys`` so the Trainer and
Accelerate integrations know what to fill in.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_zero.config_schema import (
    ACTIVATION_CHECKPOINTING_KEYS,
    AUTO,
    BF16_ALIAS,
    BF16_INERT,
    BF16_KEYS,
    BF16_UNSUPPORTED,
    CHECKPOINT_INERT,
    CHECKPOINT_KEYS,
    COMMUNICATION_DTYPES,
    COMPILE_INERT,
    COMPILE_KEYS,
    COMPILE_KWARGS,
    COMPILE_MODES,
    COMPILE_UNSUPPORTED,
    DEEPSPEED_ONLY_OPTIMIZERS,
    DEEPSPEED_ONLY_SCHEDULERS,
    FP16_INERT,
    FP16_KEYS,
    FP16_UNSUPPORTED,
    GATHER_16BIT_ALIAS,
    NONFINITE_LOSS,
    OPTIMIZER_INERT,
    OPTIMIZER_KEYS,
    PIPELINE_AUTO,
    PIPELINE_INERT,
    PIPELINE_KEYS,
    PIPELINE_SCHEDULES,
    SCHEDULER_KEYS,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    SWITCH,
    SWITCHES_ACCEPTING_AUTO,
    TOP_AUTO,
    TOP_INERT,
    TOP_KEYS,
    TOP_UNSUPPORTED,
    ZERO_AUTO,
    ZERO_INERT,
    ZERO_KEYS,
    ZERO_UNSUPPORTED,
    Bool,
    ConfigError,
    Int,
    Number,
    OneOf,
    asks_for,
    check_quiet_type,
    json_kind,
    show,
)
from hf_zero.sequence.config import SequenceParallelConfig
from hf_zero.sequence.config import parse as parse_sequence_parallel

__all__ = [
    "AUTO", "BF16Config", "ConfigError", "FP16Config", "OptimizerConfig", "SchedulerConfig", "ZeroConfig",
    "ZeroOptimizationConfig",
]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class OptimizerConfig:
    """``optimizer``: the type in canonical spelling ("Adam", "AdamW", "SGD"); params as given, minus "auto"."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    """``scheduler``: one of DeepSpeed's Warmup* schedules; ``optim.py`` checks the params."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class FP16Config:
    """``fp16``: DeepSpeed's names and defaults, so a loss-scale history carries over unchanged."""

    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False  # accepted and ignored: named in the warning when true


@dataclass
class BF16Config:
    """``bf16`` (or DeepSpeed's older ``bfloat16``)."""

    enabled: bool = False


@dataclass
class ZeroOptimizationConfig:
    """``zero_optimization``: the knobs hf_zero uses; the rest of DeepSpeed's are in config_schema."""

    stage: int = 0
    overlap_comm: bool | None = None  # None: DeepSpeed's default, True for stage 3 (load() resolves it)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False  # alias: stage3_gather_fp16_weights_on_model_save


@dataclass
class PipelineConfig:
    """``pipeline``: read when the model is a ``PipelineModule`` (``stages`` None: whatever the module says)."""

    stages: int | None = None
    activation_checkpoint_interval: int = 0
    schedule: str = "1f1b"  # hf_zero's key: "1f1b" or "gpipe"


@dataclass
class CompileConfig:
    """``compile``: ``torch.compile`` each block at ``initialize`` (see :mod:`hf_zero.compile`)."""

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict = field(default_factory=dict)


@dataclass
class ZeroConfig:
    """A parsed, validated DeepSpeed config; build it with :meth:`load`."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    communication_data_type: str | None = None  # "fp32" | "fp16" | "bf16"; None: the engine's default
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    steps_per_print: int | None = 10  # null: never print, DeepSpeed's own default
    seed: int | None = None  # hf_zero extension: the seed of the distributed sampler's shuffle
    activation_checkpointing: dict = field(default_factory=dict)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    nonfinite_loss: str = "skip"  # hf_zero extension: "skip" | "stop" | "off" (config_schema.NONFINITE_LOSS)
    checkpoint_keep_last: int | None = None  # hf_zero extension: checkpoint.keep_last; None keeps every checkpoint
    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    raw: dict = field(default_factory=dict)  # the user's dict as given (a deep copy)
    auto_keys: set[str] = field(default_factory=set)  # JSON paths whose value was "auto"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward run in: bf16, fp16, or fp32 when neither is enabled."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @classmethod
    def load(cls, config: str | os.PathLike | Mapping | ZeroConfig | None) -> ZeroConfig:
        """Parse a dict or a JSON file (an already-built ZeroConfig is returned as is).

        Raises :class:`ConfigError` at the first problem; warns once about ignored keys.
        """
        if isinstance(config, ZeroConfig):
            return config
        if config is None:
            raise ConfigError("config: none was given, and a config is required; pass config= a dict or a path to a DeepSpeed JSON file")
        source = "config"
        if isinstance(config, (str, os.PathLike)):
            source = f"config: {os.fspath(config)!r}"
            config = _read_json(os.fspath(config))
        elif isinstance(config, Mapping):
            config = dict(config)
        else:
            raise ConfigError(f"config: got a {type(config).__name__}, expected a JSON object (a dict) or the path of a DeepSpeed JSON file")
        if not isinstance(config, dict):
            raise ConfigError(f"{source} holds a JSON {json_kind(config)}, expected a JSON object (a dict of DeepSpeed keys)")
        return _Parser().parse(config)

    def resolve_batch_sizes(self, world_size: int) -> None:
        """Complete the batch triple as DeepSpeed does: train_batch_size = micro x accumulation x world size.

        Any two determine the third; train_batch_size alone or the micro-batch alone imply one
        accumulation step. The derived values are written into this config.
        """
        Int(1)(world_size, "world_size")
        tbs, mbs, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        ws = world_size
        if tbs is not None and mbs is not None and gas is not None:
            if tbs != mbs * gas * ws:
                raise ConfigError(
                    f"train_batch_size: got {tbs}, but train_micro_batch_size_per_gpu {mbs} x gradient_accumulation_steps "
                    f"{gas} x world size {ws} = {mbs * gas * ws}; make them agree or drop one and it will be derived"
                )
        elif tbs is not None and mbs is not None:
            if tbs % (mbs * ws):
                raise ConfigError(
                    f"train_batch_size: got {tbs}, which is not a multiple of train_micro_batch_size_per_gpu {mbs} x "
                    f"world size {ws} = {mbs * ws}, so gradient_accumulation_steps cannot be derived; choose sizes that divide"
                )
            gas = tbs // (mbs * ws)
        elif tbs is not None:
            split = f"gradient_accumulation_steps {gas} x world size {ws} = {gas * ws}" if gas else f"world size {ws}"
            gas = gas or 1
            if tbs % (gas * ws):
                raise ConfigError(
                    f"train_batch_size: got {tbs}, which is not a multiple of {split}, so "
                    "train_micro_batch_size_per_gpu cannot be derived; choose sizes that divide"
                )
            mbs = tbs // (gas * ws)
        elif mbs is not None:
            gas = gas or 1
            tbs = mbs * gas * ws
        else:
            autos = [k for k in BATCH_KEYS if k in self.auto_keys]
            why = f' (they are "auto": {", ".join(autos)}; the Trainer fills those, initialize() needs numbers)' if autos else ""
            if gas is not None:
                raise ConfigError(
                    f"gradient_accumulation_steps: got {gas} alone, which does not fix the batch{why}; also give "
                    "train_micro_batch_size_per_gpu or train_batch_size"
                )
            raise ConfigError(
                f"train_batch_size: no batch size given{why}; set train_batch_size or train_micro_batch_size_per_gpu"
            )
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tbs, mbs, gas


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """JSON allows a key twice and keeps the last; DeepSpeed refuses, since one of the two was a mistake."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{key}: appears twice in one JSON object; keep one")
        out[key] = value
    return out


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config: the file {path!r} does not exist; pass a dict or the path of a DeepSpeed JSON file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config: {path!r} is not UTF-8 text; a DeepSpeed config is a JSON file") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {path!r} ({e.strerror or e}); check the path and its permissions") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config: {path!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ConfigError as e:
        raise ConfigError(f"config: in {path!r}, {e}") from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Parser:
    """One walk over the user's dict: typed reads that know their JSON path, plus what was "auto" or ignored."""

    def __init__(self) -> None:
        self.auto_keys: set[str] = set()
        self.ignored: list[str] = []

    def parse(self, data: dict) -> ZeroConfig:
        if BF16_ALIAS in data and "bf16" in data:
            raise ConfigError("bfloat16: given together with bf16, its newer name; keep only bf16")
        self.sort_keys(data, "", (*TOP_KEYS, BF16_ALIAS), TOP_INERT, TOP_UNSUPPORTED)
        get = self.reader(data, "", auto=TOP_AUTO)
        cfg = ZeroConfig(raw=copy.deepcopy(data))
        for name in BATCH_KEYS:
            setattr(cfg, name, get(name, Int(1), None))
        cfg.gradient_clipping = get("gradient_clipping", Number(), 0.0)
        cfg.communication_data_type = get("communication_data_type", OneOf(COMMUNICATION_DTYPES), None, nullable=True)
        cfg.prescale_gradients = get("prescale_gradients", Bool(), False)
        cfg.gradient_predivide_factor = get("gradient_predivide_factor", Number(0.0, strict=True), 1.0)
        if cfg.prescale_gradients:  # gradients are averaged once, in the reduce dtype; the factors change nothing
            self.ignored.append("prescale_gradients")
        if cfg.gradient_predivide_factor != 1.0:
            self.ignored.append("gradient_predivide_factor")
        cfg.steps_per_print = get("steps_per_print", Int(1), 10, nullable=True)
        cfg.seed = get("seed", Int(0), None, nullable=True)
        checkpointing = self.section(data, "activation_checkpointing", '{"partition_activations": false}')
        self.sort_keys(checkpointing, "activation_checkpointing", ACTIVATION_CHECKPOINTING_KEYS)
        cfg.activation_checkpointing = copy.deepcopy(checkpointing)
        if not isinstance(checkpointing.get("checkpoint_blocks", False), bool):
            raise ConfigError(
                f"activation_checkpointing.checkpoint_blocks: got {checkpointing['checkpoint_blocks']!r}, expected true or false"
            )
        cfg.compile = self.compile(data)
        cfg.nonfinite_loss = get("nonfinite_loss", OneOf(NONFINITE_LOSS), "skip")
        ckpt = self.section(data, "checkpoint", '{"keep_last": 3}')
        self.sort_keys(ckpt, "checkpoint", CHECKPOINT_KEYS, CHECKPOINT_INERT)
        cfg.checkpoint_keep_last = self.reader(ckpt, "checkpoint")("keep_last", Int(1), None, nullable=True)
        cfg.optimizer = self.named(data, "optimizer", OptimizerConfig, SUPPORTED_OPTIMIZERS, DEEPSPEED_ONLY_OPTIMIZERS)
        cfg.scheduler = self.named(data, "scheduler", SchedulerConfig, SUPPORTED_SCHEDULERS, DEEPSPEED_ONLY_SCHEDULERS)
        cfg.fp16 = self.fp16(data)
        bf16_name = BF16_ALIAS if BF16_ALIAS in data else "bf16"
        bf16 = self.section(data, bf16_name, '{"enabled": true}')
        self.sort_keys(bf16, bf16_name, BF16_KEYS, BF16_INERT, BF16_UNSUPPORTED)
        cfg.bf16 = BF16Config(enabled=self.reader(bf16, bf16_name, auto={"enabled"})("enabled", Bool(), False))
        if cfg.fp16.enabled and cfg.bf16.enabled:
            raise ConfigError(f"fp16.enabled: got True while {bf16_name}.enabled is also True; enable at most one of fp16 and bf16")
        cfg.zero_optimization = self.zero(data)
        cfg.pipeline = self.pipeline(data)
        cfg.sequence_parallel = parse_sequence_parallel(data)
        for note in cfg.sequence_parallel.warnings:
            warnings.warn(note, UserWarning, stacklevel=3)
        if not isinstance(checkpointing.get("cpu_checkpointing", False), bool):
            raise ConfigError(
                f"activation_checkpointing.cpu_checkpointing: got {checkpointing['cpu_checkpointing']!r}, expected true or false"
            )
        cfg.auto_keys = self.auto_keys
        if self.ignored:
            names = ", ".join(dict.fromkeys(self.ignored))
            warnings.warn(f"hf_zero accepts but ignores these DeepSpeed keys: {names}", UserWarning, stacklevel=3)
        return cfg

    # ------------------------------------------------------------ building blocks

    def sort_keys(self, section: dict, path: str, known: Iterable[str], inert: Mapping | None = None,
                  unsupported: Mapping[str, tuple[Any, str]] | None = None) -> None:
        """Put every key of one section in its group: acted on, ignored, refused, or unknown (an error)."""
        known, inert, unsupported = tuple(known), inert or {}, unsupported or {}
        for key, value in section.items():
            full = _join(path, key)
            quiet = unsupported[key][0] if key in unsupported else inert.get(key, "")
            if key in unsupported or key in inert:
                check_quiet_type(value, quiet, full)
                if quiet is SWITCH and isinstance(value, dict) and value.get("enabled") == AUTO:
                    if key not in SWITCHES_ACCEPTING_AUTO:
                        raise ConfigError(f"{full}.enabled: got 'auto', expected True or False")
                    self.auto_keys.add(f"{full}.enabled")
            if key in unsupported:
                if asks_for(value, quiet):
                    where, given = (f"{full}.enabled", True) if quiet is SWITCH else (full, value)
                    raise ConfigError(f"{where}: got {show(given)}, but {unsupported[key][1]}")
            elif key in inert:
                if asks_for(value, quiet):
                    self.ignored.append(full)
            elif key not in known:
                close = difflib.get_close_matches(key, [*known, *inert, *unsupported], n=1)
                hint = f"did you mean {close[0]!r}?" if close else "expected one of " + ", ".join(known)
                raise ConfigError(f"{full}: unknown key; {hint}")

    def reader(self, section: dict, path: str, auto: Iterable[str] = ()) -> Any:
        """A typed getter for one section; ``auto`` names the keys that may say "auto"."""
        auto = frozenset(auto)

        def get(key: str, check: Any, default: Any, nullable: bool = False) -> Any:
            if key not in section:
                return default
            value, full = section[key], _join(path, key)
            if value is None and nullable:
                return None
            if isinstance(value, str) and value == AUTO:
                if key not in auto:
                    raise ConfigError(
                        f"{full}: got 'auto', expected {check.what} (\"auto\" is only allowed where the Trainer fills the value in)"
                    )
                self.auto_keys.add(full)
                return default
            return check(value, full)

        return get

    def compile(self, data: dict) -> CompileConfig:
        """``compile``: enabled, a ``torch._dynamo`` backend name, and torch.compile's own keyword arguments."""
        section = self.section(data, "compile", '{"enabled": true, "backend": "inductor"}')
        self.sort_keys(section, "compile", COMPILE_KEYS, COMPILE_INERT, COMPILE_UNSUPPORTED)
        get = self.reader(section, "compile")
        out = CompileConfig(enabled=get("enabled", Bool(), False))
        if "backend" in section:
            backend = section["backend"]
            import torch._dynamo

            known = tuple(torch._dynamo.list_backends(exclude_tags=()))
            if not isinstance(backend, str) or backend not in known:
                raise ConfigError(f"compile.backend: got {show(backend)}, expected one of {', '.join(known)}")
            out.backend = backend
        kwargs = section.get("kwargs") or {}
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

    @staticmethod
    def section(data: dict, key: str, example: str) -> dict:
        """A sub-object of the config; absent or null is an empty one."""
        value = data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {show(value)}, expected an object like {example}")
        return value

    # ------------------------------------------------------------ sections

    def named(self, data: dict, key: str, cls: type, supported: tuple, deepspeed_only: tuple) -> Any:
        """``optimizer`` / ``scheduler``: a supported ``type`` and a ``params`` object (its "auto" values left out)."""
        if data.get(key) is None:
            return None
        section = self.section(data, key, f'{{"type": "{supported[0]}", "params": {{...}}}}')
        self.sort_keys(section, key, OPTIMIZER_KEYS if key == "optimizer" else SCHEDULER_KEYS,
                       OPTIMIZER_INERT if key == "optimizer" else None)
        if "type" not in section:
            raise ConfigError(f"{key}.type: missing; expected one of {', '.join(supported)}")
        given = section["type"]
        canonical = {name.lower(): name for name in supported}
        if not isinstance(given, str) or given.lower() not in canonical:
            allowed = ", ".join(supported)
            if isinstance(given, str) and given.lower() in {name.lower() for name in deepspeed_only}:
                raise ConfigError(f"{key}.type: got {given!r}, which hf_zero does not support yet; expected one of {allowed}")
            close = difflib.get_close_matches(given.lower(), canonical, n=1) if isinstance(given, str) else []
            hint = f" (did you mean {canonical[close[0]]!r}?)" if close else ""
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

    def fp16(self, data: dict) -> FP16Config:
        section = self.section(data, "fp16", '{"enabled": true}')
        self.sort_keys(section, "fp16", FP16_KEYS, FP16_INERT, FP16_UNSUPPORTED)
        get = self.reader(section, "fp16", auto={"enabled"})
        return FP16Config(
            enabled=get("enabled", Bool(), False),
            loss_scale=get("loss_scale", Number(), 0.0),
            initial_scale_power=get("initial_scale_power", Int(0), 16),
            loss_scale_window=get("loss_scale_window", Int(1), 1000),
            hysteresis=get("hysteresis", Int(1), 2),
            consecutive_hysteresis=get("consecutive_hysteresis", Bool(), False),
            min_loss_scale=get("min_loss_scale", Number(0.0, strict=True), 1.0),
            auto_cast=section.get("auto_cast", False),  # type checked by sort_keys
        )

    def pipeline(self, data: dict) -> PipelineConfig:
        section = self.section(data, "pipeline", '{"schedule": "1f1b"}')
        self.sort_keys(section, "pipeline", PIPELINE_KEYS, PIPELINE_INERT)
        get = self.reader(section, "pipeline", auto=PIPELINE_AUTO)
        return PipelineConfig(
            stages=get("stages", Int(1), None),
            activation_checkpoint_interval=get("activation_checkpoint_interval", Int(0), 0),
            schedule=get("schedule", OneOf(PIPELINE_SCHEDULES), "1f1b"),
        )

    def zero(self, data: dict) -> ZeroOptimizationConfig:
        path = "zero_optimization"
        section = self.section(data, path, '{"stage": 2}')
        self.sort_keys(section, path, (*ZERO_KEYS, GATHER_16BIT_ALIAS), ZERO_INERT, ZERO_UNSUPPORTED)
        for key in ("offload_optimizer", "offload_param"):
            offload = self.section(section, key, '{"device": "none"}')
            device = offload.get("device", "none")
            if device is not None and not (isinstance(device, str) and device.lower() == "none"):
                raise ConfigError(
                    f'{path}.{key}.device: got {show(device)}, but offload is not supported yet; use "none" or remove {key}'
                )
        get = self.reader(section, path, auto=ZERO_AUTO)
        gather = GATHER_16BIT_ALIAS if GATHER_16BIT_ALIAS in section else "stage3_gather_16bit_weights_on_model_save"
        if GATHER_16BIT_ALIAS in section and "stage3_gather_16bit_weights_on_model_save" in section:
            raise ConfigError(f"{path}.{GATHER_16BIT_ALIAS}: given together with its newer name "
                              "stage3_gather_16bit_weights_on_model_save; keep only the newer one")
        stage = get("stage", OneOf((0, 1, 2, 3)), 0)
        return ZeroOptimizationConfig(
            stage=stage,
            overlap_comm=get("overlap_comm", Bool(), stage == 3),
            contiguous_gradients=get("contiguous_gradients", Bool(), True),
            reduce_scatter=get("reduce_scatter", Bool(), True),
            reduce_bucket_size=get("reduce_bucket_size", Int(1), 500_000_000),
            allgather_partitions=get("allgather_partitions", Bool(), True),
            allgather_bucket_size=get("allgather_bucket_size", Int(1), 500_000_000),
            stage3_prefetch_bucket_size=get("stage3_prefetch_bucket_size", Int(0), 50_000_000),
            stage3_param_persistence_threshold=get("stage3_param_persistence_threshold", Int(0), 100_000),
            stage3_max_live_parameters=get("stage3_max_live_parameters", Int(0), 1_000_000_000),
            stage3_max_reuse_distance=get("stage3_max_reuse_distance", Int(0), 1_000_000_000),
            stage3_gather_16bit_weights_on_model_save=get(gather, Bool(), False),
        )
