"""Stages 0-2: the parameters' all-gather after a step, waited for where the next forward first needs it.

After the optimizer step every :class:`hf_zero.zero.flat.FlatGroup` copies its updated master shard
into its 16-bit flat parameters and all-gathers them. Made eager (the step returns only once the
compute stream waits for every group), the whole all-gather sits between the step and the next
forward with nothing to hide behind. :class:`DeferredPublish` lets the step return with the
gathers still in flight and makes each reader wait for exactly the groups it reads:

- **the forward**: a forward pre-hook on each transformer block (the outermost modules of the
  model's ``_no_split_modules`` classes) waits for the groups holding any of the block's
  parameters; a pre-hook on the root waits for every group holding a parameter outside the
  blocks (the embedding, the final norm, the LM head), because a parent may read a child's
  weight without calling the child (a tied LM head as ``F.linear(h, self.embed.weight)``); and
  every module outside the blocks that owns parameters waits for its own, for a caller that
  runs it without the root (``model.get_input_embeddings()(ids)``). A model without such
  blocks waits for everything at the root: correct, with nothing gained.
- **the order**: the groups are published in the order these hooks first need them (the root's,
  then block 0's, block 1's, ...), so the first blocks' weights arrive first and the later
  blocks' gathers run while the first blocks compute.
- **everything else** that reads or writes the parameters waits for all of them first:
  ``state_dict()`` and ``load_state_dict()`` of the model or of any module in it (pre-hooks
  here), the next step and the next backward (:class:`hf_zero.zero.optimizer.ShardedOptimizer`),
  ``GatheredParameters`` and a group's own next publish (:meth:`hf_zero.zero.flat.FlatGroup.wait`),
  the engine's saves, loads and consolidation (``hf_zero/engine/``). ``zero_grad`` does not
  wait (it touches gradients only, and the engine calls it right after the step). Code that
  reads ``module.parameters()`` directly between ``step()`` and the next forward (an EMA of the
  weights, ``copy.deepcopy``, ``.cpu()``), or calls a module inside a block on its own, passes
  through none of these and must call ``engine.wait_params()`` first; that is why the mechanism
  is asked for in the config rather than always on.

With the optimizer offloaded (:mod:`hf_zero.zero.offload`) the same waits carry the CPU optimizer step too:
each group's step is deferred (:meth:`hf_zero.zero.flat.FlatGroup.defer_step`) and its first wait runs
it, and every group before it in this order, before the copy back and the gather
(:class:`hf_zero.zero.host_step.HostStep`), so the CPU steps the later blocks while the GPU runs the first.

On CUDA a group's wait is its all-gather's event (the compute stream waits for it, no host sync);
on CPU (gloo) it is the collective's ``async_op`` work handle, so the deferred wait is exercised
on CPU as well. Nothing changes in what is computed: the same collectives over the same buffers,
in an order every rank derives from the same module tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hf_zero.zero.flat import FlatGroup
from hf_zero.zero.units import find_units


def blocks_of(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules of the model's ``_no_split_modules`` classes, in registration order (none: [])."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    if not names or not any(type(m).__name__ in names for m in module.modules() if m is not module):
        return []  # find_units would walk the tree for units instead, whose weights a parent may read directly
    return find_units(module)


def _outside_blocks(module: torch.nn.Module, blocks: set[int]) -> Iterator[torch.nn.Module]:
    """``module`` and every module under it that is reached without passing through a block."""
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in blocks:
            continue
        seen.add(id(m))
        yield m
        stack.extend(reversed(list(m.children())))


class DeferredPublish:
    """The wait points of one model over its FlatGroups, and the publish order they imply.

    ``order`` is the list to publish in; after publishing with ``defer=True`` the caller calls
    :meth:`armed`. ``waits`` counts the groups waited for by the forward hooks and by
    :meth:`wait_all` (tests read it to see who did the waiting).
    """

    def __init__(self, module: torch.nn.Module, groups: list[FlatGroup]) -> None:
        self.groups = list(groups)
        group_of = {id(s.param): g for g in self.groups for s in g.slots}

        def held(params: Any) -> list[FlatGroup]:
            out: list[FlatGroup] = []
            for p in params:
                g = group_of.get(id(p))
                if g is not None and all(g is not h for h in out):
                    out.append(g)
            return out

        blocks = blocks_of(module)
        block_ids = {id(m) for _, m in blocks}
        outside = list(_outside_blocks(module, block_ids))
        # (module, the groups its pre-hook waits for); the root first, then the blocks in order
        root_groups = held(p for m in outside for p in m.parameters(recurse=False))
        points: list[tuple[torch.nn.Module, list[FlatGroup]]] = [(module, root_groups)]
        points += [(m, held(m.parameters(recurse=False))) for m in outside if m is not module]
        points += [(m, held(m.parameters())) for _, m in blocks]
        first: dict[int, int] = {}
        for rank, (_, gs) in enumerate(points):
            for g in gs:
                first.setdefault(id(g), rank)
        position = {id(g): i for i, g in enumerate(self.groups)}
        # Within a wait point (and for groups no hook needs) the later bucket first: buckets are laid out in
        # backward order, so that is forward order.
        self.order = sorted(self.groups, key=lambda g: (first.get(id(g), len(points)), -position[id(g)]))
        self.pending = False
        self._left = 0  # groups published with defer=True that no hook has waited for yet
        self.waits = {"forward": 0, "other": 0}
        # prepend: before any hook the user registered earlier, which may read the weights too
        self.forward_hooks = [m.register_forward_pre_hook(self._waiter(gs), prepend=True) for m, gs in points if gs]
        # on every module, not only the root: model.model.layers[0].state_dict() reads weights too
        self.dict_hooks = [h for m in module.modules() for h in (m.register_state_dict_pre_hook(self._before_state_dict),
                                                                 m.register_load_state_dict_pre_hook(self._before_load_state_dict))]

    def _waiter(self, groups: list[FlatGroup]) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self.pending:
                return
            for g in groups:
                if g.publish_pending:
                    g.wait()
                    self.waits["forward"] += 1
                    self._left -= 1
            if self._left <= 0:  # every group waited for: the hooks go back to returning at once
                self.pending = False

        return hook

    def step_now(self, through: Any, work: list[FlatGroup]) -> None:
        """At a deferred host step (:class:`hf_zero.zero.runner.DeferredHostRunner`), of ``work`` (in :attr:`order`): the
        first group the forward reads, stepped at once, so that a scheduler sees the step taken; its hook waits for it."""
        through(work[0])

    def armed(self) -> None:
        """The groups were just published with ``defer=True``: the hooks have waiting to do."""
        self._left = sum(g.publish_pending for g in self.groups)
        self.pending = self._left > 0

    def wait_all(self) -> None:
        """Make every group's parameters usable on the current stream (a no-op when none is in flight)."""
        if not self.pending:
            return
        for g in self.groups:
            if g.publish_pending:
                g.wait()
                self.waits["other"] += 1
        self.pending, self._left = False, 0

    def _before_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self.wait_all()

    def _before_load_state_dict(self, module: torch.nn.Module, *args: Any) -> None:
        self.wait_all()
