"""Optimizers and LR schedules named in a DeepSpeed config, with DeepSpeed's semantics.

Two DeepSpeed behaviours a migrating user relies on without knowing it:
- ``"type": "Adam"`` means *decoupled* weight decay (``adam_w_mode`` defaults to true), i.e.
  AdamW; ``adam_w_mode: false`` gives classic Adam with L2 regularisation.
- The Warmup* schedules set the learning rate at construction (to the warm-up start) and
  advance one ``last_batch_iteration`` per successful optimizer step; the numbers below are
  DeepSpeed's formulas, so an lr curve is identical after the switch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.config_schema import ConfigError


class OptimConfigError(ConfigError):
    """A bad optimizer or scheduler section of the config."""


SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD")
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

_OPT_KEYS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad", "bias_correction", "fused"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad", "bias_correction", "fused"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
}


def _check_keys(path: str, given: dict, allowed: set[str]) -> None:
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"expected one of {', '.join(sorted(allowed))}"
            raise OptimConfigError(f"{path}.{key}: unknown key; {hint}")


def _number(path: str, value: Any, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise OptimConfigError(f"{path}: got {value!r}, expected a number >= {minimum:g}")
    return float(value)


def _canonical(name: str, choices: tuple[str, ...], path: str) -> str:
    for c in choices:
        if isinstance(name, str) and c.lower() == name.lower():
            return c
    raise OptimConfigError(f"{path}: got {name!r}, expected one of {', '.join(choices)}")


def build_optimizer(opt_type: str, params: dict[str, Any], param_groups: list[dict] | Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer that DeepSpeed's ``optimizer`` section describes."""
    kind = _canonical(opt_type, SUPPORTED_OPTIMIZERS, "optimizer.type").lower()
    params = dict(params or {})
    _check_keys("optimizer.params", params, _OPT_KEYS[kind])
    groups = list(param_groups)
    if kind == "sgd":
        if "lr" not in params:
            raise OptimConfigError("optimizer.params.lr: SGD needs a learning rate; add e.g. \"lr\": 0.01")
        kw = {k: params[k] for k in ("momentum", "dampening", "weight_decay") if k in params}
        for k, v in kw.items():
            _number(f"optimizer.params.{k}", v)
        return torch.optim.SGD(groups, lr=_number("optimizer.params.lr", params["lr"]), nesterov=bool(params.get("nesterov", False)), **kw)
    lr = _number("optimizer.params.lr", params.get("lr", 1e-3))
    betas = params.get("betas", (0.9, 0.999))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise OptimConfigError(f"optimizer.params.betas: got {betas!r}, expected a pair of floats in [0, 1) like [0.9, 0.999]")
    eps = _number("optimizer.params.eps", params.get("eps", 1e-8))
    wd = _number("optimizer.params.weight_decay", params.get("weight_decay", 0.0))
    adam_w_mode = params.get("adam_w_mode", True) if kind == "adam" else True
    if not isinstance(adam_w_mode, bool):
        raise OptimConfigError(f"optimizer.params.adam_w_mode: got {adam_w_mode!r}, expected true or false")
    if params.get("bias_correction", True) is not True:
        raise OptimConfigError("optimizer.params.bias_correction: false is not supported; remove the key")
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    # foreach kernels: a handful of launches over the flat master shards on any device.
    return cls(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=wd, amsgrad=bool(params.get("amsgrad", False)), foreach=True)


# ------------------------------------------------------------------ schedules


def _per_group(optimizer: torch.optim.Optimizer, value: Any, path: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise OptimConfigError(f"{path}: got {len(value)} values, expected one per param group ({len(optimizer.param_groups)})")
        return [_number(path, v) for v in value]
    return [_number(path, value)] * len(optimizer.param_groups)


def _warmup_type(value: str) -> str:
    if value not in ("log", "linear"):
        raise OptimConfigError(f"scheduler.params.warmup_type: got {value!r}, expected 'log' or 'linear'")
    return value


def _steps(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OptimConfigError(f"{path}: got {value!r}, expected a positive integer")
    return value


class _Schedule:
    """DeepSpeed's schedule protocol: lr set at construction, one ``step()`` per optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def _warm(self) -> float:
        """Fraction of warm-up done at the current iteration (DeepSpeed's log or linear ramp)."""
        if self.warmup_type == "log":
            return math.log(self.last_batch_iteration + 1) / math.log(self.warmup_num_steps)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "scheduler.params.warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "scheduler.params.warmup_max_lr")
        self.warmup_num_steps = max(2, _steps("scheduler.params.warmup_num_steps", warmup_num_steps))
        self.warmup_type = _warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply()

    def _gamma(self) -> float:
        return self._warm() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to zero at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _steps("scheduler.params.total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warm()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Ratio of the optimizer's lr: warm up from ``warmup_min_ratio`` to 1, then cosine to ``cos_min_ratio``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _steps("scheduler.params.total_num_steps", total_num_steps)
        self.warmup_min_ratio = _number("scheduler.params.warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _number("scheduler.params.cos_min_ratio", cos_min_ratio)
        self.warmup_num_steps = max(2, _steps("scheduler.params.warmup_num_steps", warmup_num_steps))
        self.warmup_type = _warmup_type(warmup_type)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warm() * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


_SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
_SCHED_KEYS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "last_batch_iteration"},
}


def build_scheduler(sched_type: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> _Schedule:
    """The schedule that DeepSpeed's ``scheduler`` section describes, bound to ``optimizer``."""
    name = _canonical(sched_type, SUPPORTED_SCHEDULERS, "scheduler.type")
    params = dict(params or {})
    _check_keys("scheduler.params", params, _SCHED_KEYS[name])
    if name != "WarmupLR" and "total_num_steps" not in params:
        raise OptimConfigError(f"scheduler.params.total_num_steps: {name} needs the total number of optimizer steps")
    return _SCHEDULES[name](optimizer, **params)
