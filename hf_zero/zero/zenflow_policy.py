"""ZenFlow's definition (DeepSpeed 0.19.8's ``zero_optimization.zenflow``): what the mode computes and its settings.

Why: an offloaded step waits for the host to run Adam over every element of the rank's shard, 28-42 bytes of host
memory traffic per element, every step. ZenFlow spends that only every ``update_interval`` steps: each step it picks
the few *important* columns of every weight matrix and steps them at once with Adam on the device, and leaves the
others to the host, which steps them with their summed gradient every few steps. The price is staleness: between host
updates the unimportant columns keep their weights while their gradients pile up. It is an opt-in mode; the exact
offloaded step is :class:`hf_zero.zero.host_step.HostStep`.

What it computes, for optimizer step ``m`` (0-based, counting the steps taken; a skipped step is not one), with
``W = full_warm_up_rounds``, ``k = update_interval`` and ``S`` the reselection interval in steps (0: never again):

- ``m < W``: the ordinary offloaded step of every element.
- **selection** at ``m == W`` and, when ``S > 0``, at every later ``m`` with ``m % S == 0``: of each 2-D parameter
  (``rows x cols``, a ``Linear`` weight's columns being its input features) the ``max(1, int(cols * topk_ratio))``
  columns with the largest sum over rows of ``|g_m|`` (this step's averaged, unscaled and clipped gradient); every
  element of every other parameter (biases, norms). The ranks agree on it (the column sums are all-reduced), so it
  does not depend on the world size. The important elements' Adam moments start from zero at each selection (their
  step count goes on), as DeepSpeed's ``clear_selected_mv`` does.
- **fast step**, every ``m >= W``: the important elements stepped with Adam (the optimizer's class and
  hyperparameters of their param group, this step's lr) on ``g_m``, on the device; moments of their own.
- **accumulation**: ``g_m`` of every element is added to a host sum; the host update steps the *whole* shard with the
  mean of the sums (the important elements' moments on the host move too, as DeepSpeed's CPU step moves them; their
  weights keep the fast values), at ``m`` with ``(m + 1 - W) % k == 0``, and at ``(m + 1) % S == 0`` so that a
  reselection starts from an empty sum. The host Adam's bias correction counts optimizer steps (``m + 1``), not host
  updates: DeepSpeed passes ``step_id = micro_step + 1``.
- **overlap_step**: the host update runs on a background thread while the next ``k`` steps train, into a copy of
  the masters; its weights are published at the next update (one interval late), or at the next reselection.

The staleness this guarantees: a gradient computed at step ``j`` is in the important columns' weights from step
``j + 1`` on, and in every other weight from step ``j + k`` on at the latest (``j + 2k`` with ``overlap_step``);
``tests/test_zenflow.py`` measures it. The masters in host memory always hold the weights the model computes with
(the fast values written back every step), so checkpoints, consolidation and DeepSpeed's accessors read the model as
it is; the mode's own state (the sums, the selection, the fast moments, the update in flight) rides in the optimizer's
state under ``zenflow.*`` keys while a save or load runs (:meth:`ZenFlow.resident`), per element, so a run resumes
exactly at any world size.

Differences from DeepSpeed 0.19.8, on purpose: ``gradient_accumulation_steps`` keeps its meaning (micro-batches per
step; DeepSpeed overwrites it with ``update_interval``); the fast step sees the step's gradient, the host step the mean
of the sums (DeepSpeed divides the loss by ``update_interval``, which only Adam's ``eps`` sees); clipping and the fp16
scale apply to every step's gradient (DeepSpeed clips only the host's sum); the masters, moments and fast values stay
fp32 in bf16 training (DeepSpeed steps the important columns in the 16-bit weights and, at each reselection, copies the
16-bit weights over its fp32 masters); ``update_interval: "auto"`` follows DeepSpeed's rule as written, decided with
the step's own gradient (DeepSpeed 0.19.8 divides the loss by the 0 it sets ``gradient_accumulation_steps`` to, and its
loss is NaN from the second step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The keys the mode's state takes in the optimizer's state while a save or load runs (ZenFlow.resident): per element
# unless named in _SCALARS. A dot keeps them apart from torch's own keys (checkpoint/optim_state.py loads a dotted key
# only into a run whose optimizer takes that namespace).
NAMESPACE = "zenflow."
_SUM, _SELECTED, _EXP_AVG, _EXP_AVG_SQ, _AHEAD = (NAMESPACE + k for k in ("grad_sum", "selected", "exp_avg",
                                                                       "exp_avg_sq", "ahead"))
_CRITIC, _NONCRITIC = NAMESPACE + "auto_critic", NAMESPACE + "auto_noncritic"
_STEP, _FAST_STEPS, _COUNT, _PENDING, _SINCE = (NAMESPACE + k for k in ("step", "fast_steps", "count", "pending",
                                                                       "auto_since"))


@dataclass(frozen=True)
class ZenFlowPolicy:
    """ZenFlow's settings, resolved from ``zero_optimization.zenflow`` once (``hf_zero/engine/zero_setup.py``).

    ``select_every`` is the reselection interval in steps for ``select_strategy`` "step", in epochs for "epoch"
    (DeepSpeed's "auto" is "epoch" with 1); 0 chooses the columns once. ``update_interval`` None is "auto".
    ``steps_per_epoch`` is the config's, used when the engine has no training loader to take the length from.
    """

    topk_ratio: float = 0.1
    by_epoch: bool = False
    select_every: int = 0
    update_interval: int | None = 4
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = 0.99
    warm_up: int = 0
    reserved_cores: float = 0.5
    steps_per_epoch: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.topk_ratio < 1.0:
            raise ValueError(f"ZenFlowPolicy.topk_ratio: got {self.topk_ratio!r}; give a share between 0 and 1")
        if self.update_interval is not None and self.update_interval < 1:
            raise ValueError(f"ZenFlowPolicy.update_interval: got {self.update_interval}; give at least 1 (None: auto)")
        if self.select_every < 0 or self.warm_up < 0:
            raise ValueError("ZenFlowPolicy.select_every and warm_up: give counts of 0 or more")

    def host_bytes_per_element(self) -> int:
        """Host memory the mode adds per offloaded element: the gradient sum (4), and with ``overlap_step`` the sum
        being consumed and the masters' copy the background update writes (8 more)."""
        return 12 if self.overlap_step else 4


def selected_columns(num_columns: int, topk_ratio: float) -> int:
    """How many of a weight's ``num_columns`` columns are important: DeepSpeed's ``max(1, int(cols * ratio))``."""
    return 0 if num_columns == 0 else max(1, int(num_columns * topk_ratio))


class Schedule:
    """Which steps choose the columns and which take the host update: functions of the step index alone."""

    def __init__(self, policy: ZenFlowPolicy) -> None:
        self.policy = policy
        self.select_interval = 0 if policy.by_epoch else policy.select_every  # steps; "epoch": set_epoch_length
        if policy.by_epoch and policy.steps_per_epoch:
            self.set_epoch_length(policy.steps_per_epoch)

    def set_epoch_length(self, steps: int) -> None:
        """``select_strategy`` "epoch": the epoch is ``steps`` optimizer steps long. The same check as DeepSpeed's
        ``configure_zenflow``: the interval may not be shorter than ``update_interval``."""
        if not self.policy.by_epoch or steps < 1:
            return
        self.select_interval = self.policy.select_every * steps
        k = self.policy.update_interval
        if k is not None and 0 < self.select_interval < k:
            raise ValueError(f"zero_optimization.zenflow.select_interval: {self.policy.select_every} epoch(s) of {steps} "
                             f"steps is {self.select_interval} steps, less than update_interval {k}; the columns can be "
                             "chosen again only after the others' update, so give update_interval at most "
                             f"{self.select_interval} or select again less often")

    def warm(self, m: int) -> bool:
        """Step ``m`` is one of the ``full_warm_up_rounds``: every element stepped on the host."""
        return m < self.policy.warm_up

    def selects(self, m: int) -> bool:
        w, s = self.policy.warm_up, self.select_interval
        return m >= w and (m == w or (s > 0 and m % s == 0))

    def updates(self, m: int) -> bool:
        """A fixed ``update_interval``'s host update at step ``m`` (warm-up steps are full steps instead)."""
        w, k, s = self.policy.warm_up, self.policy.update_interval, self.select_interval
        if m < w:
            return False
        forced = s > 0 and (m + 1) % s == 0  # a reselection at m + 1 starts from an empty sum
        return forced or (k is not None and (m + 1 - w) % k == 0)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """ZenFlow steps the important elements with Adam: the optimizer must be Adam or AdamW (torch's, hf_zero's
    ``DeepSpeedCPUAdam``), without AMSGrad; one sentence otherwise."""
    ok = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or (
        type(optimizer).__name__ == "DeepSpeedCPUAdam" and all("betas" in pg for pg in optimizer.param_groups))
    if not ok:
        raise ValueError(f"zero_optimization.zenflow steps the important columns with Adam, and the optimizer is "
                         f"{type(optimizer).__name__}; use torch.optim.AdamW or Adam (or the config's \"AdamW\"), or "
                         "remove zenflow")
    if not all(pg.get("bias_correction", True) for pg in optimizer.param_groups):
        raise ValueError("zero_optimization.zenflow's Adam corrects its moments' bias, and a param group of the "
                         "optimizer has bias_correction=False; turn it on, or remove zenflow")
    if any(pg.get("amsgrad") for pg in optimizer.param_groups):
        raise ValueError("zero_optimization.zenflow's Adam steps without AMSGrad, and a param group of the optimizer "
                         "has amsgrad=True; turn it off, or remove zenflow")
