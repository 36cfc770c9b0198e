"""Optimizers and LR schedules named in a DeepSpeed config, with DeepSpeed's numbers.

Behaviours a migrating user relies on without knowing it, reproduced here on purpose:

- ``"type": "Adam"`` means *decoupled* weight decay: DeepSpeed's ``adam_w_mode`` defaults to
  true, so it is AdamW. ``adam_w_mode: false`` gives classic Adam with L2 regularisation; type
  ``"AdamW"`` is AdamW whatever ``adam_w_mode`` says. Weight decay defaults to 0 (DeepSpeed's
  FusedAdam), except with ``torch_adam: true``, where DeepSpeed hands the params to
  ``torch.optim.AdamW`` and so inherits torch's default of 0.01.
- The Warmup* schedules set the lr when they are built (``warmup_min_lr``, or 0 for
  WarmupCosineLR), and each ``step()`` advances ``last_batch_iteration`` by one; DeepSpeed's
  engine calls it once after every optimizer step that was not skipped. The first two
  optimizer steps therefore both run at the warm-up floor, exactly as under DeepSpeed.

The schedules subclass torch's ``LRScheduler`` so that ``transformers`` and ``accelerate``
accept them, but keep DeepSpeed's step protocol, its arithmetic (operation for operation, so the
floats are identical) and its checkpoint format ``{"last_batch_iteration": n}``.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from hf_zero.config.schema import SUPPORTED_OPTIMIZERS, SUPPORTED_SCHEDULERS
from hf_zero.errors import OptimizerConfigError

__all__ = ["SUPPORTED_OPTIMIZERS", "SUPPORTED_SCHEDULERS", "OptimizerConfigError", "WarmupCosineLR", "WarmupDecayLR",
           "WarmupLR", "build_optimizer", "build_scheduler"]


# ------------------------------------------------------------------ checks (one sentence each)


def _canonical(path: str, given: Any, choices: Sequence[str]) -> str:
    """``given`` spelled as in ``choices``, matched case-insensitively (DeepSpeed lower-cases Adam/AdamW)."""
    if isinstance(given, str):
        for choice in choices:
            if choice.lower() == given.lower():
                return choice
    close = difflib.get_close_matches(str(given), list(choices), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise OptimizerConfigError(f"{path}: got {given!r}, expected one of {', '.join(choices)}{hint}")


def _as_dict(path: str, params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise OptimizerConfigError(f"{path}: got {params!r}, expected an object of named parameters")
    return dict(params)


def _check_keys(path: str, given: dict[str, Any], allowed: Iterable[str], owner: str) -> None:
    allowed = sorted(allowed)
    for key in given:
        if key in allowed:
            continue
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"expected one of {', '.join(allowed)}"
        raise OptimizerConfigError(f"{path}.{key}: unknown parameter for {owner}; {hint}")


def _number(path: str, value: Any, low: float = 0.0, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptimizerConfigError(f"{path}: got {value!r}, expected a number")
    if value < low or (high is not None and value > high):
        bound = f"between {low:g} and {high:g}" if high is not None else f">= {low:g}"
        raise OptimizerConfigError(f"{path}: got {value!r}, expected a number {bound}")
    return float(value)


def _integer(path: str, value: Any, low: int) -> int:
    """Integers only, as DeepSpeed's schedules insist (``isinstance(n, int)``); bools are not integers here."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        want = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise OptimizerConfigError(f"{path}: got {value!r}, expected {want}")
    return value


def _flag(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptimizerConfigError(f"{path}: got {value!r}, expected true or false")
    return value


# ------------------------------------------------------------------ optimizers

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad", "bias_correction",
              "set_grad_none")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def _betas(value: Any) -> tuple[float, float]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in value
    )
    if not ok:
        raise OptimizerConfigError(
            f"optimizer.params.betas: got {value!r}, expected a pair of floats in [0, 1) like [0.9, 0.999]"
        )
    return float(value[0]), float(value[1])


def _materialise(param_groups: Any) -> list[Any]:
    """A list of tensors or of group dicts whose ``params`` are lists, so they can be inspected then used."""
    if isinstance(param_groups, torch.Tensor):
        raise OptimizerConfigError("optimizer: got a single tensor as parameters, expected an iterable of tensors or of param-group dicts")
    groups = []
    for group in param_groups:
        if isinstance(group, dict):
            ps = group.get("params", [])
            group = dict(group, params=[ps] if isinstance(ps, torch.Tensor) else list(ps))
        groups.append(group)
    tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
    if not tensors:
        raise OptimizerConfigError("optimizer: got no parameters to optimize; pass the model's trainable parameters")
    return groups


def _adam_kernel(groups: list[Any]) -> dict[str, Any]:
    """``fused=True`` when every tensor is floating point on CUDA; else torch's default choice.

    Torch's default is already the foreach kernels for CUDA tensors and the per-tensor loop on
    CPU (where foreach would only emulate it). Either way the state keeps torch's keys
    (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints do not depend on the choice.
    """
    tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
    if all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point() for t in tensors):
        return {"fused": True}
    return {}


def build_optimizer(
    opt_type: str, params: dict[str, Any] | None, param_groups: list[dict] | Iterable[torch.Tensor]
) -> torch.optim.Optimizer:
    """The torch optimizer that DeepSpeed's ``optimizer`` section (``type``, ``params``) describes.

    ``param_groups`` may hold plain tensors (the engine's flat fp32 masters, views of one buffer,
    ``requires_grad`` false): torch optimizers only need leaves with ``.grad`` set.
    """
    kind = _canonical("optimizer.type", opt_type, SUPPORTED_OPTIMIZERS)
    p = _as_dict("optimizer.params", params)
    if "max_grad_norm" in p:
        raise OptimizerConfigError(
            "optimizer.params.max_grad_norm: not an optimizer parameter; set the top-level \"gradient_clipping\" instead"
        )
    path = "optimizer.params"
    _check_keys(path, p, _SGD_KEYS if kind == "SGD" else _ADAM_KEYS, kind)
    groups = _materialise(param_groups)
    if kind == "SGD":
        # DeepSpeed hands SGD to torch.optim.SGD untouched, so torch's defaults apply (lr 1e-3).
        momentum = _number(f"{path}.momentum", p.get("momentum", 0.0))
        dampening = _number(f"{path}.dampening", p.get("dampening", 0.0))
        nesterov = _flag(f"{path}.nesterov", p.get("nesterov", False))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise OptimizerConfigError(
                f"{path}.nesterov: true needs momentum > 0 and dampening 0, got momentum {momentum:g} and dampening {dampening:g}"
            )
        return torch.optim.SGD(
            groups, lr=_number(f"{path}.lr", p.get("lr", 1e-3)), momentum=momentum, dampening=dampening,
            weight_decay=_number(f"{path}.weight_decay", p.get("weight_decay", 0.0)), nesterov=nesterov,
            maximize=_flag(f"{path}.maximize", p.get("maximize", False)),
        )

    torch_adam = _flag(f"{path}.torch_adam", p.get("torch_adam", False))
    # DeepSpeed: type AdamW forces decoupled decay; type Adam follows adam_w_mode (default true).
    decoupled = _flag(f"{path}.adam_w_mode", p.get("adam_w_mode", True)) or kind == "AdamW"
    default_wd = 0.01 if torch_adam and decoupled else 0.0
    if not _flag(f"{path}.bias_correction", p.get("bias_correction", True)):
        raise OptimizerConfigError(f"{path}.bias_correction: got false, which hf_zero does not support; remove it")
    _flag(f"{path}.set_grad_none", p.get("set_grad_none", True))  # accepted: the engine owns the gradients
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(
        groups,
        lr=_number(f"{path}.lr", p.get("lr", 1e-3)),
        betas=_betas(p.get("betas", (0.9, 0.999))),
        eps=_number(f"{path}.eps", p.get("eps", 1e-8)),
        weight_decay=_number(f"{path}.weight_decay", p.get("weight_decay", default_wd)),
        amsgrad=_flag(f"{path}.amsgrad", p.get("amsgrad", False)),
        **_adam_kernel(groups),
    )
    # Parameters built under zero.Init are on meta, where torch refuses fused=True; the engine
    # switches the fused kernel on once the groups point at the masters on the GPU.
    opt.hf_zero_fuse_on_device = True  # type: ignore[attr-defined]
    return opt


# ------------------------------------------------------------------ schedules


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself, also when handed a wrapper that keeps it as ``.optimizer`` (as DeepSpeed allows)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"a schedule needs a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _per_group(path: str, value: Any, n_groups: int) -> list[float]:
    """One value per param group: a scalar is repeated, a list must have one entry per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise OptimizerConfigError(f"{path}: got {len(value)} values, expected one per param group ({n_groups})")
        return [_number(path, v) for v in value]
    return [_number(path, value)] * n_groups


def _lr_value(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class _DeepSpeedSchedule(LRScheduler):
    """DeepSpeed's schedule protocol on torch's base class.

    torch counts ``last_epoch`` from 0 right after construction (its constructor calls ``step()``
    once); DeepSpeed counts ``last_batch_iteration`` from -1 and does not step when built. Here
    ``last_batch_iteration`` is the one counter and ``last_epoch`` is derived from it, so both
    views stay true. Subclasses set what ``get_lr`` needs, then call this ``__init__``.
    """

    last_batch_iteration: int

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        self._resume_from = _integer("scheduler.params.last_batch_iteration", last_batch_iteration, -1)
        super().__init__(optimizer)  # records initial_lr, then calls self.step() once: see step()

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        return self.last_batch_iteration + 1

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.last_batch_iteration = value - 1

    def _warmup_fraction(self) -> float:
        """How far the warm-up has come at ``last_batch_iteration`` (< warmup_num_steps), from 0 towards 1."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._record_lrs()

    def _record_lrs(self) -> None:
        self._last_lr = [_lr_value(g["lr"]) for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one iteration (or jump to ``last_batch_iteration``) and set the optimizer's lr."""
        self._step_count = getattr(self, "_step_count", 0) + 1
        if "_resume_from" in self.__dict__:
            # The call torch's constructor makes. DeepSpeed sets the lr only for a fresh schedule;
            # one built at a later iteration leaves the (restored) optimizer lr alone.
            self.last_batch_iteration = self.__dict__.pop("_resume_from")
            if self.last_batch_iteration == -1:
                self._apply()
            else:
                self._record_lrs()
            return
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's format: the iteration is the whole state; the rest comes from the config."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved iteration and set the lr it implies, so ``get_last_lr()`` is right at once."""
        it = state_dict.get("last_batch_iteration") if isinstance(state_dict, dict) else None
        if isinstance(it, bool) or not isinstance(it, int) or it < -1:
            raise ValueError(
                f"scheduler state: got {state_dict!r}, expected {{'last_batch_iteration': int}} as written by state_dict()"
            )
        self.last_batch_iteration = it
        self._step_count = it + 2  # one for construction, one per step taken
        self._apply()


def _warmup_type(value: Any) -> str:
    if value not in ("log", "linear"):
        raise OptimizerConfigError(f"scheduler.params.warmup_type: got {value!r}, expected 'log' or 'linear'")
    return value


def _warmup_steps(value: Any) -> int:
    # DeepSpeed raises the count to 2 so that the log ramp's 1/log(n) is defined.
    return max(2, _integer("scheduler.params.warmup_num_steps", value, 1))


def _total_steps(value: Any, warmup_num_steps: int) -> int:
    total = _integer("scheduler.params.total_num_steps", value, 1)
    if total < warmup_num_steps:  # DeepSpeed warns too, and runs
        warnings.warn(f"scheduler.params.total_num_steps ({total}) is less than warmup_num_steps ({warmup_num_steps})",
                      UserWarning, stacklevel=3)
    return total


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (log or linear ramp), then constant.

    ``warmup_max_lr`` left out means each group's current lr, as in DeepSpeed (so an ``"auto"``
    that the config dropped resolves to the optimizer's lr). Min/max may be per-group lists.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        optimizer = _torch_optimizer(optimizer)
        n = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [_lr_value(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group("scheduler.params.warmup_min_lr", warmup_min_lr, n)
        self.max_lrs = _per_group("scheduler.params.warmup_max_lr", warmup_max_lr, n)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self) -> float:
        """Where between min (0) and max (1) the lr sits at ``last_batch_iteration``."""
        return self._warmup_fraction() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's ramp, then a straight line from ``warmup_max_lr`` down to 0 at ``total_num_steps``.

    Note DeepSpeed's asymmetry, kept: here a missing ``warmup_max_lr`` means 0.001, not the optimizer's lr.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0, warmup_max_lr: float | list[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _total_steps(total_num_steps, _warmup_steps(warmup_num_steps))
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """A multiplier on each group's lr: ramp from ``warmup_min_ratio`` to 1, then cosine down to ``cos_min_ratio``.

    The cosine starts falling on the first post-warm-up iteration and stays at ``cos_min_ratio``
    from ``total_num_steps - 1`` on. The lr is 0 right after construction, as in DeepSpeed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        optimizer = _torch_optimizer(optimizer)
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.total_num_steps = _total_steps(total_num_steps, self.warmup_num_steps)
        self.warmup_min_ratio = _number("scheduler.params.warmup_min_ratio", warmup_min_ratio, 0.0, 1.0)
        self.cos_min_ratio = _number("scheduler.params.cos_min_ratio", cos_min_ratio, 0.0, 1.0)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [_lr_value(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def get_lr_ratio(self) -> float:
        """The multiplier at ``last_batch_iteration``."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


_SCHEDULES: dict[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
}
_SCHEDULE_KEYS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}


def build_scheduler(sched_type: str, params: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The schedule DeepSpeed's ``scheduler`` section describes, bound to ``optimizer`` (which it sets the lr of now)."""
    name = _canonical("scheduler.type", sched_type, SUPPORTED_SCHEDULERS)
    p = _as_dict("scheduler.params", params)
    _check_keys("scheduler.params", p, _SCHEDULE_KEYS[name], name)
    if "total_num_steps" in _SCHEDULE_KEYS[name] and "total_num_steps" not in p:
        raise OptimizerConfigError(
            f"scheduler.params.total_num_steps: missing; {name} needs the total number of optimizer steps"
        )
    return _SCHEDULES[name](optimizer, **p)
