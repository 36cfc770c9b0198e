"""ZeroConfig: DeepSpeed's config JSON as typed dataclasses, validated before any work starts.

Every error is one sentence naming the JSON path, what was given and what is allowed
(``zero_optimization.stage: got 4, expected one of 0, 1, 2, 3``); unknown keys get a "did you
mean"; DeepSpeed keys that are accepted but not acted on are named once in a warning, and
DeepSpeed features hf_zero does not have (offload, AMP) are errors rather than silent no-ops.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from hf_zero.config_schema import (
    AUTO_OK,
    INERT,
    TOP_LEVEL,
    ZERO_KEYS,
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    unknown_key,
)

AUTO = "auto"

__all__ = [
    "AUTO",
    "BF16Config",
    "ConfigError",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroOptimizationConfig",
]


@dataclass
class OptimizerConfig:
    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class ZeroOptimizationConfig:
    stage: int = 0
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False


@dataclass
class ZeroConfig:
    """A parsed, validated DeepSpeed config."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    communication_data_type: str | None = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    steps_per_print: int = 10
    seed: int | None = None
    activation_checkpointing: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    auto_keys: set[str] = field(default_factory=set)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    # ------------------------------------------------------------- loading

    @classmethod
    def load(cls, config: str | os.PathLike | dict | ZeroConfig | None) -> ZeroConfig:
        """Parse a dict or a JSON file; raise :class:`ConfigError` on the first problem."""
        if isinstance(config, ZeroConfig):
            return config
        if config is None:
            raise ConfigError("config: none was given; pass config= a dict or a path to a DeepSpeed JSON file")
        if isinstance(config, (str, os.PathLike)):
            config = _read_json(os.fspath(config))
        if not isinstance(config, dict):
            raise ConfigError(f"config: got a {type(config).__name__}, expected a JSON object (a dict of DeepSpeed keys)")
        return _Parser(config).parse()

    def resolve_batch_sizes(self, world_size: int) -> None:
        """Fill the batch triple from any two of its members (train = micro x accumulation x world)."""
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
                    f"world size {ws} = {mbs * ws}; choose sizes that divide"
                )
            gas = tbs // (mbs * ws)
        elif tbs is not None:
            gas = gas or 1
            if tbs % (gas * ws):
                raise ConfigError(
                    f"train_batch_size: got {tbs}, which is not a multiple of gradient_accumulation_steps {gas} x "
                    f"world size {ws} = {gas * ws}; choose sizes that divide"
                )
            mbs = tbs // (gas * ws)
        elif mbs is not None:
            gas = gas or 1
            tbs = mbs * gas * ws
        elif gas is not None:
            raise ConfigError(
                "train_batch_size: gradient_accumulation_steps alone does not fix the batch; also give "
                "train_micro_batch_size_per_gpu or train_batch_size"
            )
        else:
            raise ConfigError(
                "train_batch_size: no batch size given; set train_batch_size or train_micro_batch_size_per_gpu"
            )
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tbs, mbs, gas


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config: the file {path!r} does not exist; pass a dict or the path of a DeepSpeed JSON file") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {path!r} ({e.strerror}); check the path and its permissions") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config: {path!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


class _Parser:
    """Walks the user's dict once, building dataclasses and collecting inert keys."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw
        self.inert: list[str] = []
        self.auto: set[str] = set()

    def value(self, path: str, v: Any, default: Any) -> Any:
        """``"auto"`` means "not given" here; the Trainer integration fills it before loading."""
        if v == AUTO:
            if path not in AUTO_OK:
                raise ConfigError(f"{path}: got 'auto', which is only allowed where transformers fills it in; give a value")
            self.auto.add(path)
            return default
        return v

    def parse(self) -> ZeroConfig:
        raw = self.raw
        cfg = ZeroConfig(raw=copy.deepcopy(raw))
        raw = dict(raw)
        if "bfloat16" in raw:  # DeepSpeed's older spelling
            if "bf16" in raw:
                raise ConfigError("bfloat16: both 'bf16' and its old name 'bfloat16' are set; keep only 'bf16'")
            raw["bf16"] = raw.pop("bfloat16")
        for key in raw:
            if key not in TOP_LEVEL:
                raise ConfigError(unknown_key(key, TOP_LEVEL))
            if key in INERT:
                self.inert.append(key)
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if name in raw:
                v = self.value(name, raw[name], None)
                setattr(cfg, name, None if v is None else check_int(name, v, minimum=1))
        if "gradient_clipping" in raw:
            cfg.gradient_clipping = check_number("gradient_clipping", self.value("gradient_clipping", raw["gradient_clipping"], 0.0))
        if "steps_per_print" in raw:
            cfg.steps_per_print = check_int("steps_per_print", raw["steps_per_print"], minimum=1)
        if "seed" in raw:
            cfg.seed = check_int("seed", raw["seed"], minimum=0)
        if "prescale_gradients" in raw:
            cfg.prescale_gradients = check_bool("prescale_gradients", raw["prescale_gradients"])
            if cfg.prescale_gradients:
                self.inert.append("prescale_gradients")
        if "gradient_predivide_factor" in raw:
            cfg.gradient_predivide_factor = check_number("gradient_predivide_factor", raw["gradient_predivide_factor"], positive=True)
        if raw.get("communication_data_type") is not None:
            cfg.communication_data_type = check_choice("communication_data_type", raw["communication_data_type"], ("fp32", "fp16", "bf16"))
        if "sparse_gradients" in raw and check_bool("sparse_gradients", raw["sparse_gradients"]):
            raise ConfigError("sparse_gradients: got true, which hf_zero does not support; remove it or set false")
        amp = raw.get("amp")
        if amp is not None:
            if not isinstance(amp, dict):
                raise ConfigError(f"amp: got {amp!r}, expected an object")
            if amp.get("enabled"):
                raise ConfigError("amp.enabled: got true; NVIDIA Apex AMP is not supported, use \"bf16\" or \"fp16\" instead")
        if "activation_checkpointing" in raw:
            if not isinstance(raw["activation_checkpointing"], dict):
                raise ConfigError(f"activation_checkpointing: got {raw['activation_checkpointing']!r}, expected an object")
            cfg.activation_checkpointing = dict(raw["activation_checkpointing"])
        cfg.optimizer = self.section("optimizer", raw.get("optimizer"), OptimizerConfig)
        cfg.scheduler = self.section("scheduler", raw.get("scheduler"), SchedulerConfig)
        cfg.fp16 = self.precision("fp16", raw.get("fp16"), FP16Config)
        cfg.bf16 = self.precision("bf16", raw.get("bf16"), BF16Config)
        if cfg.fp16.enabled and cfg.bf16.enabled:
            raise ConfigError("fp16.enabled: got true while bf16.enabled is also true; enable at most one of them")
        if cfg.fp16.auto_cast:
            self.inert.append("fp16.auto_cast")
        cfg.zero_optimization = self.zero(raw.get("zero_optimization"))
        cfg.auto_keys = self.auto
        if self.inert:
            warnings.warn(
                "hf_zero accepts but ignores these DeepSpeed keys: " + ", ".join(sorted(set(self.inert))),
                UserWarning,
                stacklevel=3,
            )
        return cfg

    def section(self, name: str, sec: Any, cls: type) -> Any:
        if sec is None:
            return None
        if not isinstance(sec, dict):
            raise ConfigError(f"{name}: got {sec!r}, expected an object with \"type\" and \"params\"")
        for key in sec:
            if key not in ("type", "params"):
                raise ConfigError(unknown_key(key, ("type", "params"), prefix=f"{name}."))
        typ = sec.get("type")
        if not isinstance(typ, str):
            raise ConfigError(f"{name}.type: got {typ!r}, expected a name such as {'AdamW' if name == 'optimizer' else 'WarmupLR'}")
        from hf_zero.optim import SUPPORTED_OPTIMIZERS, SUPPORTED_SCHEDULERS

        choices = SUPPORTED_OPTIMIZERS if name == "optimizer" else SUPPORTED_SCHEDULERS
        canon = next((c for c in choices if c.lower() == typ.lower()), None)
        if canon is None:
            raise ConfigError(f"{name}.type: got {typ!r}, which hf_zero does not support yet; expected one of {', '.join(choices)}")
        params = sec.get("params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"{name}.params: got {params!r}, expected an object")
        kept = {}
        for k, v in params.items():
            if v == AUTO:
                self.auto.add(f"{name}.params.{k}")
            else:
                kept[k] = v
        return cls(type=canon, params=kept)

    def precision(self, name: str, sec: Any, cls: type) -> Any:
        if sec is None:
            return cls()
        if not isinstance(sec, dict):
            raise ConfigError(f"{name}: got {sec!r}, expected an object like {{\"enabled\": true}}")
        allowed = [f.name for f in fields(cls)]
        out = cls()
        for key, v in sec.items():
            path = f"{name}.{key}"
            if key not in allowed:
                raise ConfigError(unknown_key(key, allowed, prefix=f"{name}."))
            default = getattr(out, key)
            v = self.value(path, v, default)
            if isinstance(default, bool):
                v = check_bool(path, v)
            elif key in ("initial_scale_power",):
                v = check_int(path, v, minimum=0)
            elif key in ("loss_scale_window", "hysteresis"):
                v = check_int(path, v, minimum=1)
            elif key == "min_loss_scale":
                v = check_number(path, v, positive=True)
            elif key == "loss_scale":
                v = check_number(path, v)
            setattr(out, key, v)
        return out

    def zero(self, sec: Any) -> ZeroOptimizationConfig:
        out = ZeroOptimizationConfig()
        if sec is None:
            return out
        if not isinstance(sec, dict):
            raise ConfigError(f"zero_optimization: got {sec!r}, expected an object like {{\"stage\": 2}}")
        sec = dict(sec)
        if "stage3_gather_fp16_weights_on_model_save" in sec:
            sec["stage3_gather_16bit_weights_on_model_save"] = sec.pop("stage3_gather_fp16_weights_on_model_save")
        for key, v in sec.items():
            path = f"zero_optimization.{key}"
            if key not in ZERO_KEYS:
                raise ConfigError(unknown_key(key, ZERO_KEYS, prefix="zero_optimization."))
            if key in ("offload_optimizer", "offload_param"):
                dev = v.get("device", "none") if isinstance(v, dict) else v
                if dev not in (None, "none"):
                    raise ConfigError(f"{path}.device: got {dev!r}; offloading to CPU or NVMe is not supported yet, remove {key} or set device \"none\"")
                continue
            if ZERO_KEYS[key] == "inert":
                self.inert.append(path)
                continue
            default = getattr(out, key)
            v = self.value(path, v, default)
            if key == "stage":
                v = check_choice(path, v, (0, 1, 2, 3))
            elif key == "overlap_comm" or isinstance(default, bool):
                v = check_bool(path, v)
            else:
                v = check_int(path, v, minimum=0 if key == "stage3_param_persistence_threshold" else 1)
            setattr(out, key, v)
        return out
