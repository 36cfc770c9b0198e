"""Stage 3's no-grad forwards: what one may leave gathered for the next, and only inside ``generate``.

A forward without grad (evaluation, ``generate``) releases each unit after it, as training does, within the same
memory. ``generate`` is the exception worth a policy: it runs the same forward once per token, so gathering every
unit afresh for each token costs one all-gather of the model per token. Inside ``generate`` (:class:`_DecodingScope`,
set over each ``generate`` under the root), a unit may stay gathered for the next decoding step, within
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance``, and what is kept goes when ``generate`` returns or
the next training forward begins. :class:`InferenceKeep` holds that policy and its state for
:class:`hf_zero.zero.stage3.Stage3Runtime`, whose hooks call it; the runtime's own names for it
(``release_inference()``, ``kept_numel()``) forward here. A model that only runs forward (a reference model, an
optimizer-free engine) follows the same rule: ``generate``'s end releases what its steps kept.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_zero.zero.units import Unit


class InferenceKeep:
    """What no-grad forwards keep gathered from one to the next, and the reuse distances that decide it.

    Its own state and nothing of the runtime's: the units it may keep (``units``, the runtime's list of the units
    other than the root), the root unit, and ``with_root`` (the runtime's list of the root with the pinned units,
    the same list object, which ``Stage3Runtime.pin`` extends). What it needs of the runtime's moment (whether a
    forward order is recorded, whether a training forward's backward is pending) the runtime passes in.
    """

    def __init__(self, units: list[Unit], root_unit: Unit | None, with_root: list[Unit], *, max_live_numel: int,
                 max_reuse_numel: int) -> None:
        self.units = units
        self.root_unit = root_unit
        self.with_root = with_root
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        # Whether no-grad forwards left anything gathered (units in `kept`, the root with the pinned units when
        # `root_kept`): what release undoes before the next training forward.
        self.gathered = False
        self.kept: dict[int, Unit] = {}  # id -> a unit a no-grad forward left gathered for the next one
        self.root_kept = False
        # id(unit) -> its reuse distance in no-grad forwards: the elements of the other units that run between
        # one use and the next, the recorded order taken as repeating (the next decoding step); see set_order
        self.reuse: dict[int, int] = {}
        # > 0 inside ``generate``: only its decoding steps keep units gathered from one forward to the next
        # (after_unit); an evaluation forward outside it releases everything, as training does
        self.decoding = 0

    def release(self) -> None:
        """Reshard everything that no-grad forwards (evaluation, generate) left gathered."""
        if self.gathered:
            for u in self.units:
                u.reshard()
            if self.root_unit is not None:
                self.root_unit.reshard()
            self.gathered = False
        self.kept.clear()
        self.root_kept = False

    def kept_numel(self) -> int:
        """Elements that no-grad forwards left gathered for the next one (units, and the root with the pinned ones)."""
        n = sum(u.numel for u in self.kept.values() if u.gathered)
        if self.root_kept:
            n += sum(u.numel for u in self.with_root)
        return n

    def set_order(self, order: list[Unit]) -> None:
        """Each unit's reuse distance in the recorded forward order ``order`` (``Stage3Runtime._set_order``).

        The reuse distance counts, as DeepSpeed's ``stage3_max_reuse_distance`` does, the elements of the units
        that run between one use of a unit and its next; a unit used once per forward is next used in the next
        forward (``generate`` runs the same order once per token), so the order is walked round: for such a unit
        it is the rest of the model. A unit used twice in one forward takes the smaller of its distances.
        """
        self.reuse = {}
        n = len(order)
        for i, u in enumerate(order):
            dist = 0
            for k in range(1, n + 1):
                nxt = order[(i + k) % n]
                if nxt is u:
                    break
                dist += nxt.numel
                if dist > self.max_reuse_numel:
                    break  # beyond the distance already: how far does not matter
            prev = self.reuse.get(id(u))
            self.reuse[id(u)] = dist if prev is None else min(prev, dist)

    def after_unit(self, unit: Unit, ordered: bool) -> None:
        """End of a unit's no-grad forward (evaluation, ``generate``): release it, or keep it for the next forward.

        Kept, as DeepSpeed keeps a parameter whose next use is near, only when its reuse distance (the elements of
        the other units run before it is used again, the next no-grad forward repeating this one: the next decoding
        step or evaluation batch) is within ``stage3_max_reuse_distance``, and when what a forward then holds
        gathered at once stays within ``stage3_max_live_parameters`` (DeepSpeed's "parameters resident before
        releasing"): everything kept, this unit included, plus the root unit and the largest unit that runs
        beside them (:meth:`working_numel`). So a model under the cap is gathered once for a whole
        ``generate``; a larger one keeps its first units and gathers the rest per forward, as training does,
        instead of holding the whole model gathered (which a model big enough to need ZeRO-3 has no room for).
        What is kept is the same on every rank (the order and sizes are), so the ranks' gathers stay matched.
        ``ordered``: whether the runtime has recorded a forward order yet.
        """
        kept = self.kept.get(id(unit))
        if kept is not None:
            if unit.gathered:
                return  # already counted in the cap
            del self.kept[id(unit)]  # resharded by something else in between (a GatheredParameters exit)
        reuse = self.reuse.get(id(unit))
        if reuse is None and not ordered:
            # The first forward of the engine, before any order is recorded: no unit's distance can exceed the
            # elements of all the units together, the bound used until the order is known.
            reuse = sum(u.numel for u in self.units)
        if (self.decoding and reuse is not None and reuse <= self.max_reuse_numel
                and self.kept_numel() + unit.numel + self.working_numel() <= self.max_live_numel):
            self.kept[id(unit)] = unit
            self.gathered = True
            return
        unit.reshard()

    def largest_unit(self) -> int:
        """Elements of the largest unit: what a forward gathers beside what is kept, at the least (the running unit)."""
        return max((u.numel for u in self.units if not u.pinned), default=0)

    def working_numel(self) -> int:
        """What a no-grad forward holds gathered beside the kept units: the root unit with the pinned units (for the
        whole forward, unless they are kept themselves) and the running unit (the largest, to be safe)."""
        root = 0 if self.root_kept else sum(u.numel for u in self.with_root)
        return root + self.largest_unit()

    def after_root(self, backward_pending: bool) -> None:
        """End of a no-grad forward of the root: keep the root unit (with the pinned units) if it fits under the cap.

        Its reuse distance is 0: the next forward gathers it first. It is decided last, so the units that ran before
        it have taken their share of ``stage3_max_live_parameters`` first; with the largest unit running beside
        everything kept, the cap still holds. ``backward_pending``: the root is gathered for a training forward's
        backward (a no-grad forward ran in between), which releases it.
        """
        if self.root_kept or backward_pending:
            return  # kept already, or gathered for a training forward's backward, which releases it
        numel = sum(u.numel for u in self.with_root)
        if (self.decoding and numel
                and self.kept_numel() + numel + self.largest_unit() <= self.max_live_numel):
            self.root_kept = True
            self.gathered = True
            return
        for u in self.with_root:
            u.reshard()


class _DecodingScope:
    """``module.generate`` while a stage-3 runtime watches it: counts the decoding loops that are running.

    Set as an instance attribute over the class's method (the model's own, a peft model's), so ``generate`` and
    everything that calls it (the Trainer's ``predict_with_generate``, TRL, pipelines) enter the scope;
    :meth:`remove` (in the runtime's ``handles``, taken off by ``engine.destroy()``) puts the attribute back. A
    deep copy of the module (TRL's reference model) gets the class's plain method, outside any scope.
    """

    def __init__(self, module: torch.nn.Module, keep: InferenceKeep) -> None:
        self.module = module
        self.keep = keep
        self.had = "generate" in module.__dict__
        self.previous = module.__dict__.get("generate")
        self.bound = module.generate
        functools.update_wrapper(self, self.bound)
        module.__dict__["generate"] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keep = self.keep
        keep.decoding += 1
        try:
            return self.bound(*args, **kwargs)
        finally:
            keep.decoding -= 1
            if keep.decoding == 0:
                keep.release()  # what the decoding steps kept goes with the loop that needed it

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.module))
        return type(copy).generate.__get__(copy) if copy is not None else self.bound

    def remove(self) -> None:
        if self.module.__dict__.get("generate") is self:
            if self.had:
                self.module.__dict__["generate"] = self.previous
            else:
                del self.module.__dict__["generate"]
