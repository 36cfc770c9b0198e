"""What a tensor-parallel split of one parameter is, and the name its shard is stored under.

Tensor parallelism (``hf_zero/parallel/tensor_parallel.py``) cuts some weights into ``size`` equal slices
along one dimension, one slice per rank of a tensor-parallel group. Three layers need to know
which parameters are slices without knowing how they were made: ZeRO keeps slices and whole
(replicated) parameters in separate buckets so the global norm can count each once
(``zero/optimizer.py``, ``step.py``); resume checkpoints store a slice under a name of its own per
tensor-parallel rank, so that a checkpoint still reshards across data-parallel sizes by name
(``checkpoint/save.py``, ``load.py``); and consolidation puts the slices back together
(``checkpoint/consolidated.py``). The split travels on the parameter itself (``hf_zero_tp``), so
it follows the parameter wherever it goes.

Expert parallelism (``hf_zero/expert/``) cuts the same way: EP rank ``r`` of ``n`` holds a block of dim 0 of each fused
experts tensor (experts ``[r*E/n, (r+1)*E/n)``). Its cut rides on the parameter under an attribute of its own
(``hf_zero_ep_cut``, :func:`mark_expert_cut`), so that nothing that reads :func:`split_of` (ZeRO's tensor-parallel
buckets, the norm, consolidation's all-gather) takes experts for a tensor-parallel slice; only the checkpoint names
(``name@ep<r>of<n>``) and the parameter table (``"ep"``: the dim, the degree, the whole shape and the global expert
range) treat both alike, so a resume checkpoint reshards across EP degrees the way it does across tp degrees.

A cut need not be a block of the tensor itself. PEFT's LoRA on the fused experts (``LoraConfig(target_parameters=...)``)
keeps expert ``e``'s rank-``r`` factors of ``lora_B`` in columns ``e, E+e, 2E+e, ...`` (its weight is ``(out, r*E)``
read as ``(out, r, E)``): an EP rank's experts are a block of dim 2 of that view, strided columns of the weight. Such a
cut records the whole tensor's ``view`` with the cut axis ``dim`` apart; :func:`join` and :func:`cut` put the whole
back and take a rank's block through it, wherever the blocks are assembled or re-cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ATTR = "hf_zero_tp"
EP_ATTR = "hf_zero_ep_cut"
_KEY = re.compile(r"^(?P<name>.+)@(?P<kind>tp|ep)(?P<rank>\d+)of(?P<size>\d+)$")


@dataclass(frozen=True)
class TPSplit:
    """This rank's slice of a parameter: slice ``rank`` of ``size`` along ``dim`` of a tensor of ``full_shape`` (or,
    with ``view``, along ``dim`` of the whole tensor reshaped to ``view``: strided elements of it; module docstring)."""

    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]
    view: tuple[int, ...] | None = None


def _local_view(view: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return (*view[:dim], view[dim] // size, *view[dim + 1:])


def join(parts: list[torch.Tensor], dim: int, full_shape: tuple[int, ...],
         view: tuple[int, ...] | None = None) -> torch.Tensor:
    """The whole tensor from every rank's slice, in rank order (a new tensor): concatenated along ``dim``, or along
    ``dim`` of ``view`` and reshaped back to ``full_shape``."""
    if view is None:
        return torch.cat(parts, dim=dim)
    local = _local_view(tuple(view), dim, len(parts))
    return torch.cat([p.reshape(local) for p in parts], dim=dim).reshape(full_shape)


def cut(whole: torch.Tensor, dim: int, rank: int, size: int, view: tuple[int, ...] | None = None) -> torch.Tensor:
    """Slice ``rank`` of ``size`` of ``whole``, the inverse of :func:`join`: a view of ``whole`` narrowed along
    ``dim``, or with ``view`` the block of that view (its elements in the slice's order; reshape it to the slice's
    own shape)."""
    src = whole if view is None else whole.reshape(view)
    n = src.shape[dim] // size
    return src.narrow(dim, rank * n, n)


def split_of(p: torch.Tensor) -> TPSplit | None:
    """The split ``p`` is a slice of, or None for a whole parameter."""
    return getattr(p, ATTR, None)


def mark(p: torch.Tensor, split: TPSplit) -> None:
    setattr(p, ATTR, split)


def mark_expert_cut(p: torch.Tensor, cut: TPSplit) -> None:
    """Record that ``p`` holds EP rank ``cut.rank``'s block of experts: dim 0 of a fused experts tensor, or the
    experts axis of a PEFT adapter's ``view`` (module docstring)."""
    setattr(p, EP_ATTR, cut)


def stored_cut(p: torch.Tensor) -> tuple[str, TPSplit] | None:
    """How a checkpoint stores ``p``: ``("tp", split)`` for a tensor-parallel slice, ``("ep", cut)`` for an EP rank's
    experts, None for a whole parameter."""
    s = split_of(p)
    if s is not None:
        return "tp", s
    e = getattr(p, EP_ATTR, None)
    return ("ep", e) if e is not None else None


def checkpoint_name(name: str, p: torch.Tensor) -> str:
    """The name ``p``'s values are stored under in a resume checkpoint: ``name``, or ``name@tp<r>of<n>`` for a slice
    (``name@ep<r>of<n>`` for an EP rank's experts)."""
    c = stored_cut(p)
    return name if c is None else slice_name(name, c[1].rank, c[1].size, c[0])


def slice_name(name: str, rank: int, size: int, kind: str = "tp") -> str:
    return f"{name}@{kind}{rank}of{size}"


def parse_slice_name(key: str) -> tuple[str, int, int] | None:
    """``(name, rank, size)`` of a stored slice's name (tensor- or expert-parallel), or None for a whole parameter's."""
    m = _KEY.match(key)
    return (m["name"], int(m["rank"]), int(m["size"])) if m else None


def slice_kind(key: str) -> str | None:
    """``"tp"`` or ``"ep"`` for a stored slice's name, None for a whole parameter's."""
    m = _KEY.match(key)
    return m["kind"] if m else None


def stored_names(name: str, p: torch.Tensor) -> list[str]:
    """Every name the ranks of ``p``'s tensor-parallel (or EP) group store it under (``[name]`` for a whole one)."""
    c = stored_cut(p)
    return [name] if c is None else [slice_name(name, r, c[1].size, c[0]) for r in range(c[1].size)]


def table_entry(p: torch.Tensor, key: str | None = None) -> dict:
    """What a checkpoint's parameter table records of a slice beyond its shape: how to put the whole back (and for
    an EP rank's experts, the global expert range ``[first, end)`` that the rank named in the stored name ``key``
    holds; this rank's without ``key``)."""
    c = stored_cut(p)
    if c is None:
        return {}
    kind, s = c
    entry: dict = {"dim": s.dim, "size": s.size, "full_shape": list(s.full_shape)}
    if s.view is not None:
        entry["view"] = list(s.view)
    if kind == "ep":
        named = parse_slice_name(key) if key is not None else None
        rank = named[1] if named is not None else s.rank
        per = (s.view or s.full_shape)[s.dim] // s.size
        entry["experts"] = [rank * per, (rank + 1) * per]
    return {kind: entry}


def cut_entry(info: dict) -> dict | None:
    """A parameter table entry's cut (``"tp"`` or ``"ep"``: dim, size, full_shape, maybe view), None for a whole
    parameter."""
    return info.get("tp") or info.get("ep")


def join_entry(parts: list[torch.Tensor], entry: dict) -> torch.Tensor:
    """The whole tensor from the slices a checkpoint stored, as its table's ``entry`` (:func:`cut_entry`) says."""
    view = entry.get("view")
    return join(parts, entry["dim"], tuple(entry["full_shape"]), tuple(view) if view is not None else None)
