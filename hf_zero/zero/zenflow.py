"""ZenFlow (DeepSpeed 0.19.8's ``zero_optimization.zenflow``) on the offloaded optimizer of stages 1-2.

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

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.group import ShardGroup
from hf_zero.zero.host_step import intra_op_threads, step_master, sub_group_ranges

Timed = Callable[[str, float], None]

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


@dataclass
class _Lane:
    """One offloaded group's ZenFlow state on this rank."""

    group: ShardGroup
    acc: torch.Tensor | None = None  # host: the sum of the gradients since the last host update
    back: torch.Tensor | None = None  # overlap_step: the sum the update in flight reads
    ahead: torch.Tensor | None = None  # overlap_step: the masters the update in flight writes
    sel: torch.Tensor | None = None  # host int64: the important elements' positions in the shard
    sel_dev: torch.Tensor | None = None
    x: torch.Tensor | None = None  # device fp32: the important elements' weights (the masters there follow them)
    exp_avg: torch.Tensor | None = None  # their moments (host memory with zenflow.offload)
    exp_avg_sq: torch.Tensor | None = None
    two_d: list[tuple[int, int, int, int, int]] | None = None  # (slot index, lo, hi, at, cols) of the 2-D owned ranges


class ZenFlow:
    """The mode's state and its step over the offloaded groups (:class:`hf_zero.zero.runner.ZenFlowRunner` drives it).

    ``optimizer`` is the user's (or the config's) Adam/AdamW, its param groups pointed at the host masters; the fast
    step is one more ``torch.optim.Adam`` over the important elements, its hyperparameters copied from the host
    groups each step. ``groups`` are the host-master groups in the optimizer's order; ``threads`` the host step's
    intra-op threads (:func:`hf_zero.zero.host_step.host_step_threads`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, policy: ZenFlowPolicy, threads: int | None,
                 sub_group_size: int | None = None) -> None:
        check_optimizer(optimizer)
        self.optimizer, self.stream, self.device, self.policy = optimizer, stream, device, policy
        self.threads, self.sub_group_size = threads, sub_group_size
        self.schedule = Schedule(policy)
        # DeepSpeed divides the loss by update_interval (its gradient_accumulation_steps): every gradient ZenFlow uses
        # is the step's divided by it, the host update's the sum of those (the mean over a full interval)
        self.scale = 1.0 / policy.update_interval if policy.update_interval is not None else 1.0
        self.lanes = [_Lane(g) for g in groups]
        self.m = 0  # the index of the next step
        self.fast_steps = 0  # the fast Adam's step count (DeepSpeed's selective optimizer's)
        self.count = 0  # gradients in the sums
        self.fast: torch.optim.Optimizer | None = None
        self.fast_on_host = policy.offload
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[float] | None = None  # overlap_step: the host update in flight
        self.pending = False  # overlap_step: an update stepped into ``ahead`` and not yet published
        n = threads or torch.get_num_threads()
        reserve = math.ceil(policy.reserved_cores * n)  # DeepSpeed's _split_affinity
        self.background_threads = n - reserve if 0 < reserve < n else n
        # update_interval "auto": per 2-D parameter (by name) the running statistics of DeepSpeed's rule
        self.critic: dict[str, float] = {}
        self.noncritic: dict[str, float] = {}
        self.since = 0  # steps in the current interval
        self.two_d_total = sum(1 for g in groups for s in g.slots if len(s.shape) == 2)
        self.cpu_seconds = 0.0
        self.counts = {"host_updates": 0, "selections": 0}

    # --------------------------------------------------------------- the step

    def step(self, timed: Timed | None) -> None:
        """One optimizer step over the offloaded groups, then the publish of their weights (see the module doc)."""
        clock = time.perf_counter
        t0 = clock()
        grads = self._take_grads()
        t1 = clock()
        m, sched = self.m, self.schedule
        self.cpu_seconds = 0.0
        if sched.warm(m):
            self._full_step(grads, m)
        else:
            selects = sched.selects(m)
            if selects:
                if self.pending or self._future is not None:
                    self._publish_update()  # overlap_step: the update in flight lands before the columns change
                self._select(grads)
            self._fast_step(grads)
            self._accumulate(grads)
            update = sched.updates(m) or self._auto_update(grads)
            if update and self.policy.overlap_step:
                landed = self.pending or self._future is not None
                if landed:
                    self._publish_update()
                else:
                    self._publish_selected()
                self._submit(m)
            elif update:
                self._host_update(m)
            else:
                self._publish_selected()
        self.m += 1
        t2 = clock()
        C.wait_for(self.stream)
        if timed is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            timed("step.wait_grads", t1 - t0)
            timed("step.cpu_optimizer", self.cpu_seconds)
            timed("step.to_device", (t2 - t1 - self.cpu_seconds) + (clock() - t2))

    def _take_grads(self) -> list[torch.Tensor | None]:
        """Each group's reduced (unscaled, clipped) gradient shard in host memory, taken off its master's ``.grad``
        so the host optimizer sees one master's gradient at a time."""
        out = []
        for lane in self.lanes:
            g = lane.group
            g.before_step()
            assert g.master is not None
            out.append(g.master.grad)
            g.master.grad = None
        return out

    def _ranges(self, g: ShardGroup) -> list[tuple[int, int]]:
        assert g.master is not None
        return [(0, g.master.numel())] if self.sub_group_size is None else sub_group_ranges(g, self.sub_group_size)

    def _set_step_count(self, master: torch.Tensor, m: int) -> None:
        """The host Adam's count before the update of step ``m``, so its bias correction uses ``m + 1`` (DeepSpeed's
        ``step_id``); the state is made here where the optimizer has none yet (torch's keys and dtypes)."""
        state = self.optimizer.state.get(master)
        if not state:
            self.optimizer.state[master] = {"step": torch.tensor(float(m), dtype=torch.float32),
                                            "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
            return
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.fill_(float(m))
        else:
            state["step"] = torch.tensor(float(m), dtype=torch.float32)

    def _full_step(self, grads: list[torch.Tensor | None], m: int) -> None:
        """A warm-up step: every element on the host, as the ordinary offloaded step."""
        start = time.perf_counter()
        for lane, grad in zip(self.lanes, grads):
            g = lane.group
            assert g.master is not None
            if grad is not None:
                if self.scale != 1.0:
                    grad.mul_(self.scale)  # the group's host copy, written again by the next backward
                self._set_step_count(g.master, m)
                with intra_op_threads(self.threads):
                    step_master(self.optimizer, g.master, grad, self._ranges(g))
            g.publish_master(self.stream)
        self.cpu_seconds += time.perf_counter() - start

    # ---------------------------------------------------------- the columns

    def _two_d(self, lane: _Lane) -> list[tuple[int, int, int, int, int]]:
        if lane.two_d is None:
            slot_index = {id(s): i for i, s in enumerate(lane.group.slots)}
            lane.two_d = [(slot_index[id(r.slot)], r.lo, r.hi, r.at, r.slot.shape[1]) for r in lane.group.owned()
                          if len(r.slot.shape) == 2]
        return lane.two_d

    def _column_sums(self, lane: _Lane, grad: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """Per 2-D parameter of the group (by slot index), the sum over rows of ``|grad|`` of each column, over every
        rank's shard (one all-reduce of the group's columns)."""
        g = lane.group
        slots = [(i, s) for i, s in enumerate(g.slots) if len(s.shape) == 2]
        if not slots:
            return {}
        offsets, total = {}, 0
        for i, s in slots:
            offsets[i] = total
            total += s.shape[1]
        sums = torch.zeros(total, dtype=torch.float32)
        if grad is not None:
            for i, lo, hi, at, cols in self._two_d(lane):
                e = torch.arange(lo, hi)
                sums.index_add_(0, offsets[i] + e % cols, grad[at : at + hi - lo].abs())
        if g.partitioned and g.world_size > 1:
            C.all_reduce_(sums, g.group, g.world_size)
        return {i: sums[offsets[i] : offsets[i] + s.shape[1]] for i, s in slots}

    def _select(self, grads: list[torch.Tensor | None]) -> None:
        """Choose the important elements from this step's gradient and give them fresh moments."""
        for lane, grad in zip(self.lanes, grads):
            g = lane.group
            sums = self._column_sums(lane, grad)
            chosen = {i: torch.topk(v, selected_columns(v.numel(), self.policy.topk_ratio)).indices.sort().values
                      for i, v in sums.items()}
            parts = []
            slot_index = {id(s): i for i, s in enumerate(g.slots)}
            for r in g.owned():
                i = slot_index[id(r.slot)]
                if i in chosen:
                    e = torch.arange(r.lo, r.hi)
                    keep = torch.isin(e % r.slot.shape[1], chosen[i])
                    parts.append(r.at + (e[keep] - r.lo))
                else:
                    parts.append(torch.arange(r.at, r.at + r.hi - r.lo))
            self._set_selection(lane, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
        self._build_fast()
        self.counts["selections"] += 1

    def _set_selection(self, lane: _Lane, sel: torch.Tensor, exp_avg: torch.Tensor | None = None,
                       exp_avg_sq: torch.Tensor | None = None) -> None:
        master = lane.group.master
        assert master is not None
        lane.sel = sel.to(torch.int64)
        lane.sel_dev = lane.sel.to(self.device)
        lane.x = master[lane.sel].to(self.device, copy=True)
        where = torch.device("cpu") if self.fast_on_host else self.device
        lane.exp_avg = (torch.zeros(sel.numel(), dtype=torch.float32, device=where) if exp_avg is None
                        else exp_avg.to(where, torch.float32, copy=True))
        lane.exp_avg_sq = (torch.zeros(sel.numel(), dtype=torch.float32, device=where) if exp_avg_sq is None
                           else exp_avg_sq.to(where, torch.float32, copy=True))

    def _build_fast(self) -> None:
        """The fast Adam over the lanes' important elements, one param group per host param group that has any."""
        opt = self.optimizer
        owner = {id(m): i for i, pg in enumerate(opt.param_groups) for m in pg["params"]}
        params: list[list[torch.Tensor]] = [[] for _ in opt.param_groups]
        for lane in self.lanes:
            assert lane.group.master is not None
            if lane.x is not None and lane.x.numel():
                params[owner[id(lane.group.master)]].append(lane.x)
        self._fast_owner = [i for i, ps in enumerate(params) if ps]  # the host param group of each fast one
        if not self._fast_owner:
            self.fast = None
            return
        self.fast = torch.optim.Adam([{"params": params[i]} for i in self._fast_owner], lr=0.0,
                                     fused=self.device.type in ("cpu", "cuda"))

    def _copy_hyper(self) -> None:
        """This step's hyperparameters of each host param group onto its fast group."""
        assert self.fast is not None
        host = self.optimizer.param_groups
        decoupled = isinstance(self.optimizer, torch.optim.AdamW)
        for fast_pg, i in zip(self.fast.param_groups, self._fast_owner):
            pg = host[i]
            lr = pg["lr"]
            fast_pg["lr"] = float(lr) if isinstance(lr, torch.Tensor) else lr
            fast_pg["betas"] = tuple(pg["betas"])
            fast_pg["eps"] = pg["eps"]
            fast_pg["weight_decay"] = pg["weight_decay"]
            fast_pg["maximize"] = bool(pg.get("maximize", False))
            fast_pg["decoupled_weight_decay"] = bool(pg.get("decoupled_weight_decay", decoupled))

    def _fast_step(self, grads: list[torch.Tensor | None]) -> None:
        """Adam on the important elements with this step's gradient, on the device; the masters follow."""
        fast = self.fast
        self.fast_steps += 1
        if fast is None:
            return
        self._copy_hyper()
        for lane, grad in zip(self.lanes, grads):
            x = lane.x
            if x is None or not x.numel():
                continue
            assert lane.sel is not None and lane.exp_avg is not None and lane.exp_avg_sq is not None
            if grad is None:
                x.grad = torch.zeros_like(x)
            else:
                x.grad = grad[lane.sel].to(self.device)
                if self.scale != 1.0:
                    x.grad.mul_(self.scale)
            fast.state[x] = {"step": torch.tensor(float(self.fast_steps - 1), dtype=torch.float32, device=x.device),
                             "exp_avg": lane.exp_avg.to(x.device), "exp_avg_sq": lane.exp_avg_sq.to(x.device)}
        fast.step()
        for lane in self.lanes:
            x = lane.x
            if x is None or not x.numel():
                continue
            assert lane.exp_avg is not None and lane.exp_avg_sq is not None and lane.sel is not None
            state = fast.state.pop(x)
            if self.fast_on_host:  # zenflow.offload: the moments wait in host memory between steps
                lane.exp_avg.copy_(state["exp_avg"])
                lane.exp_avg_sq.copy_(state["exp_avg_sq"])
            else:
                lane.exp_avg, lane.exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            x.grad = None
            master = lane.group.master
            assert master is not None
            master.index_copy_(0, lane.sel, x.to(master.device))

    # ---------------------------------------------------------- the others

    def _accumulate(self, grads: list[torch.Tensor | None]) -> None:
        with intra_op_threads(self.threads):
            for lane, grad in zip(self.lanes, grads):
                master = lane.group.master
                assert master is not None
                if lane.acc is None:
                    lane.acc = torch.zeros_like(master)
                if grad is not None:
                    lane.acc.add_(grad)
        self.count += 1

    def _host_update(self, m: int) -> None:
        """The host update of step ``m``: every element with the mean of the sums, the important ones then back to
        their fast values, and every group published."""
        start = time.perf_counter()
        for lane in self.lanes:
            g = lane.group
            assert g.master is not None and lane.acc is not None
            grad = self._host_grad(lane.acc)
            self._set_step_count(g.master, m)
            with intra_op_threads(self.threads):
                step_master(self.optimizer, g.master, grad, self._ranges(g))
            lane.acc.zero_()
            self._keep_fast(lane, g.master)
            g.publish_master(self.stream)
        self.count, self.since = 0, 0
        self.noncritic = dict.fromkeys(self.noncritic, 0.0)
        self.counts["host_updates"] += 1
        self.cpu_seconds += time.perf_counter() - start

    def _host_grad(self, acc: torch.Tensor) -> torch.Tensor:
        """The host update's gradient, in place of the sum: times 1/update_interval (DeepSpeed's; the mean over a full
        interval, less over one a reselection cuts short), or, with "auto", the mean over the interval."""
        with intra_op_threads(self.threads):
            return acc.mul_(self.scale) if self.policy.update_interval is not None else acc.div_(max(self.count, 1))

    def _keep_fast(self, lane: _Lane, master: torch.Tensor) -> None:
        if lane.sel is not None and lane.x is not None and lane.sel.numel():
            master.index_copy_(0, lane.sel, lane.x.to(master.device))

    def _publish_selected(self) -> None:
        """A step without a host update: only the important elements changed; write them into this rank's range of
        the parameters and all-gather every group (every rank takes part, with or without elements of its own)."""
        with C.on_stream(self.stream):
            for lane in self.lanes:
                g = lane.group
                shard = g.param_flat[g.shard_lo : g.shard_hi]  # type: ignore[attr-defined]
                if lane.sel_dev is not None and lane.x is not None and lane.x.numel():
                    shard.index_copy_(0, lane.sel_dev, lane.x.to(shard.dtype))
                if g.partitioned:
                    C.all_gather_(g.param_flat, shard, g.group, g.world_size)  # type: ignore[attr-defined]

    # ------------------------------------------------------ overlap_step

    def _shadow(self, aheads: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
        """The host optimizer as the background update sees it: this step's hyperparameters and the same state
        tensors, its params the ``ahead`` copies, so training going on (a scheduler's lr, the next step's
        ``.grad``) cannot reach it."""
        opt = self.optimizer
        shadow = object.__new__(type(opt))
        shadow.__dict__.update({k: v for k, v in opt.__dict__.items()
                                if k not in ("param_groups", "state") and not callable(v)})
        shadow.param_groups = [{**{k: v for k, v in pg.items() if k != "params"},
                                "params": [aheads[id(m)] for m in pg["params"] if id(m) in aheads]}
                               for pg in opt.param_groups]
        state: Any = {}
        for pg in opt.param_groups:
            for m in pg["params"]:
                if id(m) in aheads:
                    state[aheads[id(m)]] = opt.state[m]
        shadow.state = state
        return shadow

    def _submit(self, m: int) -> None:
        """overlap_step: start step ``m``'s host update in the background, into a copy of the masters."""
        work = []
        aheads: dict[int, torch.Tensor] = {}
        for lane in self.lanes:
            g = lane.group
            assert g.master is not None and lane.acc is not None
            if lane.ahead is None:
                lane.ahead = torch.empty_like(g.master)
            lane.ahead.copy_(g.master)
            lane.acc, lane.back = (lane.back if lane.back is not None else torch.zeros_like(lane.acc)), lane.acc
            lane.acc.zero_()
            self._host_grad(lane.back)
            self._set_step_count(g.master, m)
            aheads[id(g.master)] = lane.ahead
            work.append((lane.ahead, lane.back, self._ranges(g)))
        shadow = self._shadow(aheads)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-zenflow")
        self._future = self._pool.submit(self._background, shadow, work, self.background_threads)
        self.count, self.since = 0, 0
        self.noncritic = dict.fromkeys(self.noncritic, 0.0)
        self.counts["host_updates"] += 1

    @staticmethod
    def _background(shadow: torch.optim.Optimizer, work: list, threads: int) -> float:
        start = time.perf_counter()
        with intra_op_threads(threads):
            for ahead, grad, ranges in work:
                step_master(shadow, ahead, grad, ranges)
        return time.perf_counter() - start

    def _wait(self) -> None:
        """The update in flight has finished (its error, if any, raised here)."""
        future, self._future = self._future, None
        if future is not None:
            self.cpu_seconds += future.result()
            self.pending = True

    def _publish_update(self) -> None:
        """overlap_step: the update in flight lands: its masters become the model's, the important elements keep
        their fast values, every group is published."""
        self._wait()
        if not self.pending:
            return
        for lane in self.lanes:
            g = lane.group
            assert g.master is not None and lane.ahead is not None
            g.master.copy_(lane.ahead)
            self._keep_fast(lane, g.master)
            g.publish_master(self.stream)
        self.pending = False

    # ------------------------------------------------------------ "auto"

    def _auto_update(self, grads: list[torch.Tensor | None]) -> bool:
        """``update_interval: "auto"``: DeepSpeed's rule over each 2-D parameter ``p``, decided with this step's
        gradient: ``critic_p`` is the mean, over the steps since the last update, of ``sum |g|`` over its important
        columns divided by ``10 * topk_ratio``, ``noncritic_p`` the running sum of the rest divided by
        ``10 * (1 - topk_ratio)``; the host update runs when at least ``int(auto_ratio * n)`` of the ``n`` 2-D
        parameters have ``noncritic_p >= critic_p``. The sums are all-reduced, so every rank decides alike."""
        if self.policy.update_interval is not None:
            return False
        ratio = self.policy.topk_ratio
        self.since += 1
        ui = self.since
        meeting = 0
        for lane, grad in zip(self.lanes, grads):
            g = lane.group
            slots = [(i, s) for i, s in enumerate(g.slots) if len(s.shape) == 2]
            if not slots:
                continue
            sums = torch.zeros(2 * len(slots), dtype=torch.float64)
            where = {i: j for j, (i, _) in enumerate(slots)}
            if grad is not None:
                picked = torch.zeros(grad.numel(), dtype=torch.bool)
                if lane.sel is not None:
                    picked[lane.sel] = True
                for i, lo, hi, at, _ in self._two_d(lane):
                    part, keep = grad[at : at + hi - lo].abs().double(), picked[at : at + hi - lo]
                    sums[2 * where[i]] += part[keep].sum()
                    sums[2 * where[i] + 1] += part.sum()
            if g.partitioned and g.world_size > 1:
                C.all_reduce_(sums, g.group, g.world_size)
            for j, (_, s) in enumerate(slots):
                critic, total = float(sums[2 * j]), float(sums[2 * j + 1])
                prev = self.critic.get(s.name, 0.0)
                self.critic[s.name] = (prev * (ui - 1) + critic) / ui / (ratio * 10)
                self.noncritic[s.name] = self.noncritic.get(s.name, 0.0) + (total - critic) / ((1 - ratio) * 10)
                meeting += int(self.noncritic[s.name] >= self.critic[s.name])
        return meeting >= int(self.policy.auto_ratio * self.two_d_total)

    # ----------------------------------------------------- saves and loads

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """A save or a load: the update in flight finished, the mode's state laid out per element (and as scalars) in
        the optimizer's state under ``zenflow.*`` keys for the block, then taken back from there: what a save wrote,
        or what a load read (none: a checkpoint of another mode, and ZenFlow starts over from its step 0)."""
        self._wait()
        versions = self._lay_out()
        try:
            yield
        finally:
            self._take_back(versions)

    def _lay_out(self) -> dict[int, tuple[torch.Tensor, int]]:
        """The mode's state into the optimizer's, per master; returns what is needed to tell a load from a save."""
        opt = self.optimizer
        laid = {}
        for lane in self.lanes:
            master = lane.group.master
            assert master is not None
            n = master.numel()
            st = opt.state.setdefault(master, {})
            st[_SUM] = lane.acc.clone() if lane.acc is not None else torch.zeros(n)
            selected, exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n), torch.zeros(n)
            if lane.sel is not None and lane.exp_avg is not None and lane.exp_avg_sq is not None:
                selected[lane.sel] = 1.0
                exp_avg[lane.sel] = lane.exp_avg.to("cpu", torch.float32)
                exp_avg_sq[lane.sel] = lane.exp_avg_sq.to("cpu", torch.float32)
            st[_SELECTED], st[_EXP_AVG], st[_EXP_AVG_SQ] = selected, exp_avg, exp_avg_sq
            if self.pending:
                assert lane.ahead is not None
                st[_AHEAD] = lane.ahead.clone()
            if self.policy.update_interval is None:
                crit, non = torch.zeros(n), torch.zeros(n)
                for r in lane.group.owned():
                    crit[r.at : r.at + r.hi - r.lo] = self.critic.get(r.slot.name, 0.0)
                    non[r.at : r.at + r.hi - r.lo] = self.noncritic.get(r.slot.name, 0.0)
                st[_CRITIC], st[_NONCRITIC] = crit, non
            for key, value in ((_STEP, self.m), (_FAST_STEPS, self.fast_steps), (_COUNT, self.count),
                               (_PENDING, int(self.pending)), (_SINCE, self.since)):
                st[key] = torch.tensor(float(value), dtype=torch.float64)
            laid[id(master)] = (st[_STEP], master._version)  # a load makes its scalars anew
        return laid

    def _take_back(self, laid: dict[int, tuple[torch.Tensor, int]]) -> None:
        """The mode's state from the optimizer's after the block: what a load put there, or what :meth:`_lay_out` did
        (a save; or a load without optimizer state, after which an update in flight no longer matches the masters)."""
        opt = self.optimizer
        states = []
        kept, changed = True, False  # the optimizer state not loaded; the masters written
        for lane in self.lanes:
            master = lane.group.master
            assert master is not None
            st = opt.state.get(master, {})
            mine = {k: st.pop(k) for k in [k for k in st if k.startswith(NAMESPACE)]}
            if not st:
                opt.state.pop(master, None)
            states.append(mine)
            ours, version = laid.get(id(master), (None, -1))
            kept = kept and mine.get(_STEP) is ours
            changed = changed or master._version != version
        if not states or any(_STEP not in s for s in states):
            self._reset()
            return
        first = states[0]
        self.m, self.fast_steps = int(first[_STEP]), int(first[_FAST_STEPS])
        self.count, self.since = int(first[_COUNT]), int(first[_SINCE])
        # an update in flight goes on if it came with the state (a save; a load of a checkpoint that had one), not after
        # a load of the weights alone, which it would overwrite
        self.pending = bool(int(first[_PENDING])) and all(_AHEAD in s for s in states) and not (kept and changed)
        chosen = self.m > self.policy.warm_up  # the step that chose the columns has run
        for lane, st in zip(self.lanes, states):
            master = lane.group.master
            assert master is not None
            lane.acc = st[_SUM].to(torch.float32).clone()
            lane.back = None
            lane.ahead = st[_AHEAD].to(torch.float32).clone() if self.pending else None
            if chosen:
                mask = st[_SELECTED] > 0.5
                self._set_selection(lane, mask.nonzero().flatten(), st[_EXP_AVG][mask], st[_EXP_AVG_SQ][mask])
            else:
                lane.sel = lane.sel_dev = lane.x = lane.exp_avg = lane.exp_avg_sq = None
        if self.policy.update_interval is None:
            self._take_back_auto(states)
        if chosen:
            self._build_fast()
        else:
            self.fast = None

    def _take_back_auto(self, states: list[dict[str, Any]]) -> None:
        """The per-parameter statistics of "auto" from their per-element copies: a rank holding no element of a
        parameter learns its values from the others (one all-reduce per group)."""
        self.critic, self.noncritic = {}, {}
        for lane, st in zip(self.lanes, states):
            g = lane.group
            slots = [s for s in g.slots if len(s.shape) == 2]
            if not slots or _CRITIC not in st:
                continue
            rows = torch.zeros(3 * len(slots), dtype=torch.float64)
            where = {s.name: j for j, s in enumerate(slots)}
            for r in g.owned():
                j = where.get(r.slot.name)
                if j is not None and r.hi > r.lo:
                    rows[3 * j] += float(st[_CRITIC][r.at])
                    rows[3 * j + 1] += float(st[_NONCRITIC][r.at])
                    rows[3 * j + 2] += 1.0
            if g.partitioned and g.world_size > 1:
                C.all_reduce_(rows, g.group, g.world_size)
            for j, s in enumerate(slots):
                if rows[3 * j + 2] > 0:
                    self.critic[s.name] = float(rows[3 * j] / rows[3 * j + 2])
                    self.noncritic[s.name] = float(rows[3 * j + 1] / rows[3 * j + 2])

    def _reset(self) -> None:
        """No ZenFlow state to continue from: the mode starts again at its step 0 (warm-up, then a selection)."""
        self.m = self.fast_steps = self.count = self.since = 0
        self.pending = False
        self.critic, self.noncritic = {}, {}
        self.fast = None
        for lane in self.lanes:
            lane.acc = lane.back = lane.ahead = lane.sel = lane.sel_dev = lane.x = None
            lane.exp_avg = lane.exp_avg_sq = None

    def set_epoch_length(self, steps: int) -> None:
        """The training loader's epoch, in optimizer steps (``select_strategy`` "epoch" and "auto")."""
        self.schedule.set_epoch_length(steps)

    def selection(self) -> dict[str, torch.Tensor]:
        """Per parameter this rank holds a part of, a boolean mask of the elements (of that part, flattened) that are
        important now; the rest are stepped on the host. Empty before the first selection. For tests and tools."""
        out: dict[str, torch.Tensor] = {}
        for lane in self.lanes:
            g = lane.group
            if lane.sel is None or g.master is None:
                continue
            mask = torch.zeros(g.master.numel(), dtype=torch.bool)
            mask[lane.sel] = True
            for r in g.owned():
                out[r.slot.name] = mask[r.at : r.at + r.hi - r.lo].clone()
        return out

    def close(self) -> None:
        """Finish the update in flight and stop the background thread (``engine.destroy()``)."""
        try:
            self._wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


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
