"""ZenFlow (DeepSpeed 0.19.8's ``zero_optimization.zenflow``) on the offloaded optimizer of stages 1-2: the step.

What it computes, its staleness bound and where it differs from DeepSpeed are :mod:`hf_zero.zero.zenflow_policy`'s
docstring; its state through saves and loads is :mod:`hf_zero.zero.zenflow_state`'s. Here: :class:`ZenFlow`, the
step :class:`hf_zero.zero.runner.ZenFlowRunner` takes (the selection of the important columns, their fast step on the
device, the host's sums and its update every ``update_interval`` steps, in the background with ``overlap_step``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.group import ShardGroup
from hf_zero.zero.host_step import intra_op_threads, report_step_parts, step_master, sub_group_ranges
from hf_zero.zero.zenflow_policy import NAMESPACE, Schedule, ZenFlowPolicy, check_optimizer, selected_columns
from hf_zero.zero.zenflow_state import ZenFlowState

# the definition's names a reader of the mode may look for here
__all__ = ["NAMESPACE", "ZenFlow", "ZenFlowPolicy", "check_optimizer"]

Timed = Callable[[str, float], None]


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


class ZenFlow(ZenFlowState):
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
            report_step_parts(timed, self.device, t0, t1, t2, self.cpu_seconds)

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
