"""The step policy: what an optimizer step does with the reduced gradients, for every engine.

``ZeroEngine.step()`` on an accumulation boundary and the ``OptimizerStep`` of a pipeline's
schedule end the same way, so they share this one policy:

1. **the global norm**: every shard group's sum of squares (and, under fp16, its inf/nan flag),
   summed over the ranks that together hold the model's gradients (:class:`NormScope`: the
   data-parallel group for a plain engine, the whole world for a pipeline, each unpartitioned
   group counted once, a weight tied across stages counted at its first stage);
2. **the non-finite rule**: under fp16 an overflow skips the step and lowers the loss scale
   (:class:`hf_zero.precision.policies.LossScaler`); in bf16/fp32 a non-finite norm skips the step or
   stops the run, as the config's ``"nonfinite_loss"`` says (``"off"`` drops the check);
3. **clip and unscale** in one multiply of the gradient shards, then the optimizer steps the
   masters and the groups publish the new weights (:meth:`ShardedOptimizer.step_and_publish`).

The policy also scales the loss before backward (accumulation and the fp16 scale). The engine
keeps what is its own: the counters, the LR scheduler, the log line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_zero.errors import NonFiniteLossError
from hf_zero.precision.policies import LossScaler
from hf_zero.zero import collectives as C
from hf_zero.zero.group import ShardGroup
from hf_zero.zero.optimizer import ShardedOptimizer


@dataclass(frozen=True)
class NormScope:
    """The ranks whose gradient shards make up the model's gradient, as the global norm sums them.

    ``group`` (of ``world`` ranks) is summed over; ``replicas`` of its ranks hold each
    unpartitioned group's (identical) gradient, which therefore counts once; the groups whose ids
    are in ``exclude`` are counted by another rank (a tied weight's later stages). Under tensor
    parallelism the scope is the whole grid: groups of slices (``tp_split``) differ from rank to rank
    of a tensor-parallel group, groups of whole parameters are the same on its ``tp`` ranks and count
    ``1/tp`` each. Under hybrid sharding ``shard_replicas`` ranks (one per shard group) hold each partitioned
    group's shard alike, so the partitioned sum is divided by it: each shard counts once, not once per replica.
    """

    group: dist.ProcessGroup | None
    world: int
    replicas: int
    exclude: frozenset[int] = field(default_factory=frozenset)
    tp: int = 1  # tensor parallelism: a group of whole parameters (not ``tp_split``) is held alike by ``tp`` ranks
    shard_replicas: int = 1  # hybrid sharding: a partitioned group's shard is held alike by ``dp_replicate`` ranks


def grad_stats(
    groups: list[ShardGroup], scope: NormScope, device: torch.device, need_flag: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global L2 norm of the (possibly loss-scaled) reduced gradients and an inf/nan count (0 without ``need_flag``).

    One all-reduce of three numbers over the scope, skipped when every rank already holds the
    whole gradient (stage 0 without a pipeline); no host sync.
    """
    zero = torch.zeros((), device=device)
    counted = [g for g in groups if id(g) not in scope.exclude]

    def sq(g: ShardGroup) -> torch.Tensor:
        s = g.grad_sq_sum()
        return s / scope.tp if scope.tp > 1 and not g.tp_split else s

    # An unpartitioned group over a sub-group of the ranks (expert parallelism's experts, hf_zero/zero/group.py
    # SubGroup) is alike only on its own ranks, the other sub-groups holding other parameters: it counts once per
    # sub-group, so each rank adds its share and the world's sum counts it once, with the partitioned groups.
    part = [sq(g) for g in counted if g.partitioned]
    part += [sq(g) / (g.world_size * g.place.replicas) for g in counted if not g.partitioned and g.place.own_subgroup]
    repl = [sq(g) for g in counted if not g.partitioned and not g.place.own_subgroup]
    rows = [torch.stack(part).sum() if part else zero, torch.stack(repl).sum() if repl else zero]
    if need_flag:
        bad = [g.nonfinite() for g in groups]
        rows.append(torch.stack(bad).sum() if bad else zero)
    stats = torch.stack(rows)
    if scope.world > 1 and (part or scope.world > scope.replicas):
        C.all_reduce_(stats, scope.group, scope.world)
        if scope.replicas > 1:
            stats[1] = stats[1] / scope.replicas
        if scope.shard_replicas > 1:
            stats[0] = stats[0] / scope.shard_replicas
    return (stats[0] + stats[1]).sqrt(), stats[2] if need_flag else zero


@dataclass
class StepResult:
    """What one optimizer step came to: applied (with its unscaled pre-clip norm) or skipped (and why)."""

    applied: bool
    norm: torch.Tensor | None = None
    loss_scale: float = 1.0
    reason: str = ""


class StepPolicy:
    """Clip, loss scale, the non-finite rule and the global norm; see the module docstring.

    ``nonfinite`` is the config's (already checked) ``"skip"``, ``"stop"`` or ``"off"``.
    """

    def __init__(self, *, scaler: LossScaler | None, nonfinite: str, scope: NormScope, device: torch.device) -> None:
        self.scaler, self.nonfinite, self.scope, self.device = scaler, nonfinite, scope, device
        self._clip_next: float | None = None
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None  # computed early by grad_norm, reused by step
        self.timed: Callable[[str, float], None] | None = None  # wall_clock_breakdown's sink for the offloaded step's parts

    def scale_loss(self, loss: torch.Tensor, divide_by: int = 1) -> torch.Tensor:
        """The fp32 loss to backpropagate: divided over ``divide_by`` micro-batches, times the fp16 scale."""
        scaled = loss.float()
        if divide_by > 1:
            scaled = scaled / divide_by
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        return scaled

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the next step at ``max_norm`` instead of the ``clip`` it is given (the config's ``gradient_clipping``)."""
        self._clip_next = max_norm

    def _compute(self, optimizer: ShardedOptimizer) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_stats(optimizer.groups, self.scope, self.device, need_flag=self.scaler is not None)

    def grad_norm(self, optimizer: ShardedOptimizer) -> torch.Tensor:
        """The unscaled global norm of the reduced gradients now; the step reuses it (one all-reduce per step)."""
        if self._stats is None:
            self._stats = self._compute(optimizer)
        return self._stats[0] / (self.scaler.scale if self.scaler is not None else 1.0)

    def forget(self) -> None:
        """The gradients changed (zeroed): a norm computed earlier no longer holds."""
        self._stats = None

    def step(self, optimizer: ShardedOptimizer, *, clip: float, step: int, skipped: int) -> StepResult:
        """Decide and, unless skipped, apply the step: unscale and clip, step the masters, publish the weights.

        ``clip`` is the max global norm (0: no clipping) unless :meth:`clip_next_step` said
        otherwise; ``step`` and ``skipped`` (the engine's counters) only word the messages. A
        skipped step leaves weights and optimizer state untouched; the caller drops the gradients.
        """
        clip = self._clip_next if self._clip_next is not None else clip
        self._clip_next = None
        stats, self._stats = self._stats, None
        scaler = self.scaler
        if stats is None and scaler is None and clip <= 0 and self.nonfinite == "off":
            # Nothing reads the norm: skip its pass over every gradient shard (as plain torch
            # does without clipping); get_global_grad_norm() is then None for this step.
            optimizer.step_and_publish(self.timed)
            return StepResult(applied=True)
        norm, bad = stats if stats is not None else self._compute(optimizer)
        scale = scaler.scale if scaler is not None else 1.0
        if scaler is not None and bool(bad > 0):  # fp16 needs this one host sync per step
            optimizer.discard_speculation()  # super_offload stepped during backward, assuming no overflow
            scaler.update(True)  # raises once the scale is already at min_loss_scale
            return StepResult(False, reason=f"fp16 gradient overflow, step skipped; loss scale now {scaler.scale:g}")
        if scaler is None and self.nonfinite != "off" and not bool(torch.isfinite(norm)):
            # bf16/fp32: one host sync per optimizer step (fp16 already has one, above). The global
            # norm is the same number on every rank, so every rank reaches the same verdict.
            optimizer.discard_speculation()
            if self.nonfinite == "stop":
                raise NonFiniteLossError(
                    f"step {step}: the loss or gradients are not finite (global gradient norm {float(norm)}); "
                    'stopping before the optimizer touched anything, as "nonfinite_loss" is "stop" (set it to '
                    '"skip" to skip such steps instead)'
                )
            return StepResult(False, reason=(
                f"the loss or gradients are not finite (global gradient norm {float(norm)}); step skipped, weights "
                f"and optimizer state unchanged ({skipped + 1} skipped so far; \"nonfinite_loss\": \"stop\" stops instead)"
            ))
        norm = norm / scale
        coef: torch.Tensor | float = 1.0 / scale
        if 0 < clip < float("inf"):  # inf (transformers asking for the norm alone) clips nothing: no pass over the gradients
            coef = (clip / (norm + 1e-6)).clamp(max=1.0) / scale
        optimizer.scale_grads(coef)
        optimizer.step_and_publish(self.timed)
        if scaler is not None:
            scaler.update(False)
        return StepResult(True, norm=norm, loss_scale=scale)
