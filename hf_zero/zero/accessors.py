"""DeepSpeed's per-parameter accessors (``deepspeed.utils``' ``safe_get_full_*`` and the like, through
:mod:`hf_zero.utils`): read and edit one parameter's fp32 master,
averaged gradient and optimizer state, whole or this rank's part, at any ZeRO stage.

Training frameworks log and edit sharded weights with these (PEFT's AdaLoRA reads gradients with
``safe_get_full_grad``). Each starts from a parameter of an engine's module and works on its shard group
(``hf_zero/zero/group.py``): a ``full`` getter assembles only that one parameter, each rank adding the
elements it owns into a zeroed buffer of the parameter's size that one all-reduce over the group's ranks
completes (no communication at stage 0, where every rank holds everything); so every rank of the engine
calls it, as with DeepSpeed. Setters are local: every rank passes the same whole value and keeps its part.

DeepSpeed's semantics, and where hf_zero's differ:

- ``safe_get_full_fp32_param`` / ``safe_set_full_fp32_param``: the fp32 master the optimizer steps (bf16
  under ``bf16_master_weights_and_grads``). Setting it also sets the parameter the model computes with
  (cast), on every rank at once; DeepSpeed's stage 1-2 update that only at the next step. At stage 0 in
  fp32, where DeepSpeed keeps no separate master and returns None, hf_zero returns the parameter's values.
- ``safe_get_full_grad`` / ``safe_set_full_grad``: the gradient averaged over the data-parallel ranks (and
  scaled by 1/gradient_accumulation_steps, by the fp16 loss scale until the step unscales it), available
  after the backward of an accumulation boundary and until the step: at stages 2-3 it is reduced every
  micro-step and holds the micro-steps so far; at stages 0-1 it is reduced at the boundary, and before that
  the parameter's own (unreduced) ``.grad`` is returned, as DeepSpeed returns ``param.grad`` when it is set.
  None when there is none (before backward, after the step).
- ``safe_get_full_optimizer_state(param, key)`` / ``safe_set_full_optimizer_state``: the optimizer's state
  ``key`` for the parameter (Adam's ``"exp_avg"``, its first moment, and ``"exp_avg_sq"``, its second). The
  optimizer makes its state at its first step: before it the getter returns None (DeepSpeed's, whose
  optimizer state exists from the start, returns zeros) and the setter refuses.
- ``safe_get_local_*`` / ``safe_set_local_*``: this rank's elements of the parameter, flat. DeepSpeed defines
  them at stage 3 only, where each parameter is cut into equal per-rank pieces; hf_zero cuts a unit's (or
  bucket's) parameters together, so a rank's part of one parameter may be of any length, empty included,
  and is defined at every stage (at stage 0 the whole parameter).

Under NVMe offload (``"device": "nvme"``) the master and state of the parameter's group are read from their file for
the call (and a setter writes them back); the local getters then return copies, not views.
A frozen parameter (``requires_grad=False``) has no master, gradient or state: the getters return None and
the setters do nothing, as DeepSpeed's. A parameter of no engine (or of a destroyed one) gets None too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from hf_zero.errors import UsageError
from hf_zero.zero import collectives as C
from hf_zero.zero.sharded_group import ShardState

__all__ = [
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
    "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]


def _place(param: torch.Tensor) -> tuple[Any, Any] | None:
    """``(group, slot)`` of a trainable parameter an engine holds, else None."""
    if not isinstance(param, torch.Tensor):
        raise UsageError(f"deepspeed.utils accessors take a parameter of the engine's module, got {type(param).__name__}")
    g = param.__dict__.get("hf_zero_group") or param.__dict__.get("hf_zero_flat")
    if g is None or not g.trainable or not param.requires_grad:
        return None
    if g.resident:
        g.wait()  # a step deferred to the next forward (overlap_param_gather) is taken before its values are read
    elif getattr(g, "publish_pending", False):
        g.run_deferred_step()  # stage 3's deferred to the unit's next gather (hf_zero/zero/unit_steps.py) likewise
    slot = next(s for s in g.slots if s.param is param)
    return g, slot


def _owned(g: Any, slot: Any) -> tuple[int, int, int] | None:
    """``(lo, hi, at)``: the elements of ``slot``'s parameter this rank owns and where they sit in its shard."""
    for r in g.owned():
        if r.slot is slot:
            return r.lo, r.hi, r.at
    return None


def _local(g: Any, slot: Any, values: torch.Tensor) -> torch.Tensor:
    """The part of ``values`` (a tensor laid out like the shard) holding this rank's elements of the parameter: a view."""
    own = _owned(g, slot)
    if own is None:
        return values[:0]
    lo, hi, at = own
    return values[at : at + hi - lo]


def _full(g: Any, slot: Any, values: torch.Tensor) -> torch.Tensor:
    """The whole parameter's values, from every rank's part of ``values`` (one all-reduce over the group's ranks)."""
    out = torch.zeros(slot.numel, dtype=values.dtype, device=g.device)
    own = _owned(g, slot)
    if own is not None:
        lo, hi, at = own
        out[lo:hi].copy_(values[at : at + hi - lo])
    if g.partitioned:
        C.all_reduce_(out, g.group, g.world_size)
    return out.view(slot.shape)


def _write(g: Any, slot: Any, target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """This rank's part of the whole ``value`` into ``target`` (laid out like the shard)."""
    flat = _whole(value, slot, what)
    own = _owned(g, slot)
    if own is not None:
        lo, hi, at = own
        with torch.no_grad():
            target[at : at + hi - lo].copy_(flat[lo:hi])


def _whole(value: torch.Tensor, slot: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != slot.numel:
        got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UsageError(f"{what}: the value for '{slot.name}' has {got}, expected {slot.numel} (shape {tuple(slot.shape)})")
    return value.detach().reshape(-1)


def _state(g: Any, key: str, what: str, must: bool) -> torch.Tensor | None:
    """The optimizer's state ``key`` of ``g``'s master (None if the optimizer has made none yet, unless ``must``)."""
    owner = getattr(g, "hf_zero_owner", None)
    zo = owner() if owner is not None else None
    state = zo.optimizer.state.get(g.master) if zo is not None else None
    if not state or key not in state:
        if not must:
            return None
        have = sorted(state) if state else []
        raise UsageError(f"{what}: the optimizer holds no state {key!r} for this parameter "
                         f"({'it has ' + ', '.join(map(repr, have)) if have else 'it makes its state at its first step'}); "
                         "set it after a step, with one of the keys it has")
    return state[key]


def _in_memory(g: Any, write: bool = False) -> contextlib.AbstractContextManager[None]:
    """``g``'s master and optimizer state in host memory for the block: with NVMe offload they wait in files between
    steps (``hf_zero/zero/nvme.py``), read for the block and, when ``write``, written back after it."""
    owner = getattr(g, "hf_zero_owner", None)
    zo = owner() if owner is not None else None
    swap = getattr(getattr(zo, "nvme", None), "swap", None)
    if swap is None or id(g) not in swap.layout:
        return contextlib.nullcontext()
    return swap.group_resident(g, write)


def _swapped(g: Any) -> bool:
    owner = getattr(g, "hf_zero_owner", None)
    zo = owner() if owner is not None else None
    swap = getattr(getattr(zo, "nvme", None), "swap", None)
    return swap is not None and id(g) in swap.layout


def _per_element(g: Any, t: torch.Tensor) -> bool:
    return t.dim() > 0 and t.numel() == g.master.numel()


# ------------------------------------------------------------------ fp32 parameter


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (collective over the engine's ranks); None for a frozen parameter."""
    place = _place(param)
    if place is None:
        return None
    g, slot = place
    with _in_memory(g):
        return _full(g, slot, g.master)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master, and the parameter the model computes with, to ``value`` (the same on every rank)."""
    place = _place(param)
    if place is None:
        return
    g, slot = place
    store = getattr(g, "shard_store", None)  # NVMe offload_param: the 16-bit shard in a file, recast from the master
    with _in_memory(g, write=True):
        _write(g, slot, g.master, value, "safe_set_full_fp32_param")
        if store is not None:
            store.put(g, g.master)
    flat = _whole(value, slot, "safe_set_full_fp32_param")
    with torch.no_grad():
        if g.resident:  # stages 0-2: the whole parameter is on every rank, and every rank has the whole value
            param.data.copy_(flat.view(slot.shape))
            return
        shard = getattr(g, "param_shard", None)  # stage 3: a compute-dtype shard next to the master (offload)
        if shard is not None and store is None:
            _write(g, slot, shard, value, "safe_set_full_fp32_param")
        if g.state is not ShardState.SHARDED:  # gathered now: the gathered copy too
            g.full[slot.offset : slot.offset + slot.numel].copy_(flat)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s fp32 master (a flat view; possibly empty)."""
    place = _place(param)
    if place is None:
        return None
    g, slot = place
    with _in_memory(g):  # NVMe offload: a copy (the master goes back to its file)
        return _local(g, slot, g.master).clone() if _swapped(g) else _local(g, slot, g.master)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of ``param``'s fp32 master (as many as :func:`safe_get_local_fp32_param` returns).

    The parameter the model computes with follows at the next step (stages 1-2) or gather (stage 3); at
    stage 0 and in fp32 the master is that parameter."""
    place = _place(param)
    if place is None:
        return
    g, slot = place
    with _in_memory(g, write=True):
        _local_set(_local(g, slot, g.master), value, "safe_set_local_fp32_param")


def _local_set(target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != target.numel():
        got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UsageError(f"{what}: got {got}, expected this rank's {target.numel()} (what the matching get returns)")
    with torch.no_grad():
        target.copy_(value.detach().reshape(-1))


# ------------------------------------------------------------------ gradient


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole averaged gradient of ``param`` (collective once reduced); see the module doc for when it exists."""
    place = _place(param)
    if place is None:
        return param.grad if isinstance(param, torch.Tensor) and param.requires_grad else None
    g, slot = place
    reduced = g.grad_values()
    if reduced is not None:
        return _full(g, slot, reduced)
    return param.grad


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set ``param``'s averaged gradient (the same whole ``value`` on every rank); what the step will use."""
    place = _place(param)
    if place is None:
        return
    g, slot = place
    reduced = g.grad_values(writable=True)
    if reduced is not None:
        _write(g, slot, reduced, value, "safe_set_full_grad")
    if param.grad is not None:
        with torch.no_grad():
            param.grad.copy_(_whole(value, slot, "safe_set_full_grad").view(slot.shape))


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s averaged gradient (a flat view), once reduced; else None."""
    place = _place(param)
    if place is None:
        return None
    g, slot = place
    reduced = g.grad_values()
    return _local(g, slot, reduced) if reduced is not None else None


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of ``param``'s averaged gradient (as many as :func:`safe_get_local_grad` returns)."""
    place = _place(param)
    if place is None:
        return
    g, slot = place
    reduced = g.grad_values(writable=True)
    if reduced is None:
        raise UsageError("safe_set_local_grad: the gradient is not reduced yet; call it after the backward of an "
                         "accumulation boundary and before engine.step()")
    _local_set(_local(g, slot, reduced), value, "safe_set_local_grad")


# ------------------------------------------------------------------ optimizer state


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer's state ``optim_state_key`` of ``param``, whole (collective); None before the first step.

    A state that is one number for the whole group (Adam's ``"step"``) comes back as it is."""
    place = _place(param)
    if place is None:
        return None
    g, slot = place
    with _in_memory(g):
        t = _state(g, optim_state_key, "safe_get_full_optimizer_state", must=False)
        if t is None:
            return None
        return _full(g, slot, t) if _per_element(g, t) else t.detach().clone()


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer's state ``optim_state_key`` of ``param`` to ``value`` (the same whole value on every rank)."""
    place = _place(param)
    if place is None:
        return
    g, slot = place
    with _in_memory(g, write=True):
        t = _state(g, optim_state_key, "safe_set_full_optimizer_state", must=True)
        if not _per_element(g, t):
            raise UsageError(f"safe_set_full_optimizer_state: the optimizer's {optim_state_key!r} is one value for a "
                             "whole group of parameters, not per element; it cannot be set for one parameter")
        _write(g, slot, t, value, "safe_set_full_optimizer_state")


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's elements of the optimizer's state ``optim_state_key`` of ``param`` (a flat view)."""
    place = _place(param)
    if place is None:
        return None
    g, slot = place
    with _in_memory(g):
        t = _state(g, optim_state_key, "safe_get_local_optimizer_state", must=False)
        if t is None or not _per_element(g, t):
            return None if t is None else t.detach().clone()
        return _local(g, slot, t).clone() if _swapped(g) else _local(g, slot, t)  # NVMe: a copy


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's elements of the optimizer's state ``optim_state_key`` of ``param``."""
    place = _place(param)
    if place is None:
        return
    g, slot = place
    with _in_memory(g, write=True):
        t = _state(g, optim_state_key, "safe_set_local_optimizer_state", must=True)
        if not _per_element(g, t):
            raise UsageError(f"safe_set_local_optimizer_state: the optimizer's {optim_state_key!r} is one value for a "
                             "whole group of parameters, not per element")
        _local_set(_local(g, slot, t), value, "safe_set_local_optimizer_state")


def safe_update_full_grad_vectorized(param_list: list[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]) -> None:
    """DeepSpeed's ``safe_update_full_grad_vectorized``: replace each parameter's averaged gradient by
    ``update_func(full_grad, param)``, in ``param_list``'s order.

    As DeepSpeed's: a parameter whose ``.grad`` is set has it updated in place; otherwise the gradient the step
    will use is read whole (:func:`safe_get_full_grad`, collective) and set back (:func:`safe_set_full_grad`), so
    every rank calls it with the same list. A trainable parameter with no gradient yet is left alone.
    """
    for p in param_list:
        if p.grad is not None and _place(p) is None:
            with torch.no_grad():
                p.grad.copy_(update_func(p.grad, p))
        elif p.requires_grad:
            full = safe_get_full_grad(p)
            if full is not None:
                safe_set_full_grad(p, update_func(full, p))
