"""DeepSpeed's learning-rate schedules (the ones a config's ``scheduler.type`` names), with DeepSpeed's numbers.

Behaviours a migrating user relies on without knowing it, reproduced here on purpose:

- The Warmup* schedules set the lr when they are built (``warmup_min_lr``, or 0 for
  WarmupCosineLR), and each ``step()`` advances ``last_batch_iteration`` by one; DeepSpeed's
  engine calls it once after every optimizer step that was not skipped. The first two
  optimizer steps therefore both run at the warm-up floor, exactly as under DeepSpeed.
- OneCycle and LRRangeTest set the lr to their floor when built, as DeepSpeed's do; OneCycle with
  ``cycle_momentum`` (the default) also writes the optimizer's ``betas`` as ``(momentum, 0.99)``:
  DeepSpeed replaces the second beta by 0.99 whenever it cycles momentum, and so does this.

The schedules subclass torch's ``LRScheduler`` so that ``transformers`` and ``accelerate``
accept them, but keep DeepSpeed's step protocol, its arithmetic (operation for operation, so the
floats are identical) and its checkpoint format ``{"last_batch_iteration": n}``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from hf_zero.config.schema import SUPPORTED_SCHEDULERS
from hf_zero.errors import OptimizerConfigError
from hf_zero.optim.optimizers import _as_dict, _canonical, _check_keys, _integer, _number

__all__ = ["SUPPORTED_SCHEDULERS", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_scheduler"]


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
    """'log' or 'linear'; anything else warns and means 'log', as DeepSpeed falls back (it does not refuse)."""
    if value not in ("log", "linear"):
        warnings.warn(f"scheduler.params.warmup_type: got {value!r}, expected 'log' or 'linear'; using 'log' "
                      "(the warm-up DeepSpeed falls back to as well)", UserWarning, stacklevel=3)
        return "log"
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


class LRRangeTest(_DeepSpeedSchedule):
    """The learning-rate range test: from ``lr_range_test_min_lr`` up, by ``lr_range_test_step_rate`` every
    ``lr_range_test_step_size`` iterations (continuously, or in stairs with ``lr_range_test_staircase``).

    It finds the largest lr a model trains at without diverging, to bound a OneCycle schedule.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        optimizer = _torch_optimizer(optimizer)
        self.min_lr = _per_group("scheduler.params.lr_range_test_min_lr", lr_range_test_min_lr,
                                 len(optimizer.param_groups))
        self.step_size = _integer("scheduler.params.lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = _number("scheduler.params.lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def _interval(self) -> float:
        if self.staircase:
            return math.floor(float(self.last_batch_iteration + 1) / self.step_size)
        return float(self.last_batch_iteration + 1) / self.step_size

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class OneCycle(_DeepSpeedSchedule):
    """The 1cycle policy: the lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size``
    iterations and falls back over ``cycle_second_step_size`` (default: the same), then decays by
    ``decay_lr_rate`` every ``decay_step_size`` iterations (no decay when either is 0); momentum (Adam's
    first beta) moves the opposite way between ``cycle_max_mom`` and ``cycle_min_mom`` when
    ``cycle_momentum`` is on and the optimizer has betas. A stair count holds lr and momentum flat over
    that many equal stairs of its half of the cycle (0: they move every iteration).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float | list[float],
                 cycle_max_lr: float | list[float], decay_lr_rate: float = 0.0, cycle_first_step_size: float = 2000,
                 cycle_second_step_size: float | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: float = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        optimizer = _torch_optimizer(optimizer)
        n = len(optimizer.param_groups)
        first = _number("scheduler.params.cycle_first_step_size", cycle_first_step_size)
        if first <= 0:
            raise OptimizerConfigError(f"scheduler.params.cycle_first_step_size: got {cycle_first_step_size!r}, "
                                       "expected a positive number of iterations")
        second = first if cycle_second_step_size is None else _number("scheduler.params.cycle_second_step_size",
                                                                       cycle_second_step_size)
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _integer("scheduler.params.cycle_first_stair_count", cycle_first_stair_count, 0)
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None else _integer(
            "scheduler.params.cycle_second_stair_count", cycle_second_stair_count, 0)
        self.decay_step_size = _number("scheduler.params.decay_step_size", decay_step_size)
        self.min_lrs = _per_group("scheduler.params.cycle_min_lr", cycle_min_lr, n)
        self.max_lrs = _per_group("scheduler.params.cycle_max_lr", cycle_max_lr, n)
        self.decay_lr_rate = _number("scheduler.params.decay_lr_rate", decay_lr_rate)
        self.decay_mom_rate = _number("scheduler.params.decay_mom_rate", decay_mom_rate)
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(f"OneCycle: cycle_momentum is off, {type(optimizer).__name__} has no betas to cycle",
                          UserWarning, stacklevel=2)
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in _per_group("scheduler.params.cycle_min_mom", cycle_min_mom, n)]
            self.max_moms = [(m, 0.99) for m in _per_group("scheduler.params.cycle_max_mom", cycle_max_mom, n)]
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self) -> float:
        """Where between the bottom (0) and the top (1) of the cycle iteration ``last_batch_iteration + 1`` is."""
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer offset, so that a stair edge is not lost to the float scale's roundoff
            within = it % self.total_size
            if within <= self.first_step_size:
                position = within * stairs / self.first_step_size
            else:
                position = (self.total_size - within) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` each group gets at ``last_batch_iteration`` (None with ``cycle_momentum`` off)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            # when built, DeepSpeed starts momentum at cycle_min_mom (not at the cycle's formula, which is the max)
            moms = self.min_moms if self.last_batch_iteration == -1 else self.get_mom()
            for group, mom in zip(self.optimizer.param_groups, moms):
                group["betas"] = mom


_SCHEDULES: dict[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
_SCHEDULE_KEYS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"),
}
_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
             "OneCycle": ("cycle_min_lr", "cycle_max_lr")}


def build_scheduler(sched_type: str, params: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The schedule DeepSpeed's ``scheduler`` section describes, bound to ``optimizer`` (which it sets the lr of now)."""
    name = _canonical("scheduler.type", sched_type, SUPPORTED_SCHEDULERS)
    p = _as_dict("scheduler.params", params)
    _check_keys("scheduler.params", p, _SCHEDULE_KEYS[name], name)
    for key in _REQUIRED.get(name, ()):
        if key not in p:
            what = "the total number of optimizer steps" if key == "total_num_steps" else "the lr at the bottom and top of its cycle"
            raise OptimizerConfigError(f"scheduler.params.{key}: missing; {name} needs {what}")
    return _SCHEDULES[name](optimizer, **p)
