"""ZenFlow's own state through saves and loads: laid out per element in the optimizer's state under ``zenflow.*`` keys
for the block of a save or load, then taken back (:class:`ZenFlowState`, a base of :class:`hf_zero.zero.zenflow.ZenFlow`).

Why per element: a checkpoint stores the optimizer's state by parameter name and range, so state laid out like the
masters reshards with them, and a run resumes exactly at any world size (:mod:`hf_zero.zero.zenflow_policy`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.zenflow_policy import (
    _AHEAD,
    _COUNT,
    _CRITIC,
    _EXP_AVG,
    _EXP_AVG_SQ,
    _FAST_STEPS,
    _NONCRITIC,
    _PENDING,
    _SELECTED,
    _SINCE,
    _STEP,
    _SUM,
    NAMESPACE,
)


class ZenFlowState:
    """The saves-and-loads half of :class:`hf_zero.zero.zenflow.ZenFlow` (it reads and sets that class's attributes)."""

    optimizer: Any
    lanes: list[Any]
    policy: Any

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

