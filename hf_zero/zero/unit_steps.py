"""Stage 3 with ``overlap_param_gather`` and the optimizer offloaded: each unit's host step taken where the next
forward first gathers the unit.

Why: an offloaded step is bound by the CPU's pass over the masters and the optimizer state. Taken whole inside
``engine.step()``, the GPU waits for all of it before the next forward starts. At stages 1-2 ``overlap_param_gather``
already moves each group's host step into the next forward (:class:`hf_zero.zero.overlap.DeferredPublish`, waited
for by the blocks' forward pre-hooks); this is the same at stage 3, where the reader of a unit's weights is its
all-gather. :meth:`DeferredUnitStep.gather` runs the group's pending step (and, in forward order, every group's
before it that is not stepped yet: :meth:`hf_zero.zero.host_step.HostStep.through`) just before it gathers, so the
CPU steps unit ``i + 1`` while the GPU runs the kernels of unit ``i`` already queued. The step arithmetic is the
same calls on the same values in another order per group: the weights equal the eager offloaded step's bit for bit.

Stage 3 is also where parameter offload lives, so this is the mode that keeps the GPU's memory at the units gathered
at the moment while the CPU works from the backward of one step (``super_offload``) through the forward of the next.

Who else reads a unit's values between the step and its gather, and waits first (:meth:`DeferredUnitSteps.wait_all`,
which steps every group left): the next step and the next backward, ``engine.wait_params()`` and the engine's saves,
loads and consolidation (through :meth:`hf_zero.zero.optimizer.ShardedOptimizer.wait_params`), DeepSpeed's accessors
(:mod:`hf_zero.zero.accessors`), and a gather (``GatheredParameters``, and so a module's ``state_dict()`` under it). The small parameters stage 3 keeps whole (norms, biases: :class:`FlatGroup`
buckets) are stepped at once inside ``engine.step()``: they are a few hundred thousand elements, read by every block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_zero.zero.flat import FlatGroup
from hf_zero.zero.group import ShardGroup
from hf_zero.zero.stage3 import Stage3Runtime


class DeferredUnitStep:
    """A stage-3 group's side of the deferral (mixed into :class:`hf_zero.zero.offload.OffloadedShardedParamGroup`).

    ``_deferred``: the step to run before the group's values are read (the host step's bound ``through``);
    ``_published``: the event of a publish left on the step's stream (the master copied to the device shard), which
    the gather's stream waits for.
    """

    _deferred: Callable[[ShardGroup], None] | None = None
    _published: torch.cuda.Event | None = None

    def defer_step(self, through: Callable[[ShardGroup], None]) -> None:
        """The optimizer has not stepped this group yet: the next gather (or :meth:`run_deferred_step`) calls
        ``through(self)``, which steps and publishes it and every group before it in forward order."""
        self._deferred = through

    @property
    def publish_pending(self) -> bool:
        """A deferred step is still to run before the group's values are read."""
        return self._deferred is not None

    def run_deferred_step(self) -> None:
        """Take the deferred step now (a no-op when there is none)."""
        step, self._deferred = self._deferred, None
        if step is not None:
            step(self)  # type: ignore[arg-type]

    def gather(self, stream: torch.cuda.Stream | None) -> None:
        self.run_deferred_step()
        published, self._published = self._published, None
        if published is not None:  # the publish's copy to the device shard ran on the step's stream
            (stream if stream is not None else torch.cuda.current_stream(published.device)).wait_event(published)
        super().gather(stream)  # type: ignore[misc]


class DeferredUnitSteps:
    """The deferral's order and waits over one stage-3 model (the ``overlap`` a deferred host runner steps through).

    The interface is :class:`hf_zero.zero.overlap.DeferredPublish`'s (``order``, :meth:`step_now`, :meth:`armed`,
    :meth:`wait_all`, ``forward_hooks`` and ``dict_hooks`` for detaching). ``order`` is read at each step, since the
    forward order is recorded on the first forward (:attr:`Stage3Runtime.order`): the whole-kept buckets first (stepped
    at once), then the root unit's groups and the pinned units' (gathered as the root's forward begins), then each unit's
    in the recorded order, then any group no forward has gathered yet.
    """

    def __init__(self, runtime: Stage3Runtime, flat_groups: list[FlatGroup],
                 groups: list[ShardGroup]) -> None:
        self.runtime, self.flat_groups = runtime, list(flat_groups)
        self.groups = [g for g in groups if isinstance(g, DeferredUnitStep)]
        self.pending = False
        self.waits = {"other": 0}  # steps wait_all took (the rest were taken by the gathers): tests read it
        self.forward_hooks: list[Any] = []  # none: the gathers are the hooks (detach reads both lists)
        self.dict_hooks: list[Any] = []  # none: a unit's state_dict() reads it gathered (GatheredParameters: a gather)

    @property
    def order(self) -> list[ShardGroup]:
        rt = self.runtime
        units = [*rt._with_root(), *(rt.order or rt.units)]
        mine = {id(g) for g in self.groups}
        out: list[ShardGroup] = list(self.flat_groups)
        seen: set[int] = set()
        for u in units:
            for g in u.groups:
                if id(g) in mine and id(g) not in seen:
                    seen.add(id(g))
                    out.append(g)
        out += [g for g in self.groups if id(g) not in seen]
        return out

    def step_now(self, through: Callable[[ShardGroup], None], work: list[ShardGroup]) -> None:
        """At the step, of ``work`` (in :attr:`order`): the whole-kept buckets, stepped and their all-gathers waited for
        at once (no hook waits for them at stage 3), or, without any, the first group, so that the step is seen taken."""
        flats = [g for g in work if isinstance(g, FlatGroup)]
        through(flats[-1] if flats else work[0])
        for g in flats:
            g.wait()

    def armed(self) -> None:
        """The step deferred its groups' steps: the readers have stepping to do."""
        self.pending = any(g.publish_pending for g in self.groups)

    def wait_all(self) -> None:
        """Take every step still deferred (a no-op when none is)."""
        if not self.pending:
            return
        self.pending = False
        for g in self.order:
            if isinstance(g, DeferredUnitStep) and g.publish_pending:
                g.run_deferred_step()
                self.waits["other"] += 1
