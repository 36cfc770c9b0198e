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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ATTR = "hf_zero_tp"
_KEY = re.compile(r"^(?P<name>.+)@tp(?P<rank>\d+)of(?P<size>\d+)$")


@dataclass(frozen=True)
class TPSplit:
    """This rank's slice of a parameter: slice ``rank`` of ``size`` along ``dim`` of a tensor of ``full_shape``."""

    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]


def split_of(p: torch.Tensor) -> TPSplit | None:
    """The split ``p`` is a slice of, or None for a whole parameter."""
    return getattr(p, ATTR, None)


def mark(p: torch.Tensor, split: TPSplit) -> None:
    setattr(p, ATTR, split)


def checkpoint_name(name: str, p: torch.Tensor) -> str:
    """The name ``p``'s values are stored under in a resume checkpoint: ``name``, or ``name@tp<r>of<n>`` for a slice."""
    s = split_of(p)
    return name if s is None else slice_name(name, s.rank, s.size)


def slice_name(name: str, rank: int, size: int) -> str:
    return f"{name}@tp{rank}of{size}"


def parse_slice_name(key: str) -> tuple[str, int, int] | None:
    """``(name, rank, size)`` of a stored slice's name, or None for a whole parameter's."""
    m = _KEY.match(key)
    return (m["name"], int(m["rank"]), int(m["size"])) if m else None


def stored_names(name: str, p: torch.Tensor) -> list[str]:
    """Every name the ranks of ``p``'s tensor-parallel group store it under (``[name]`` for a whole parameter)."""
    s = split_of(p)
    return [name] if s is None else [slice_name(name, r, s.size) for r in range(s.size)]


def table_entry(p: torch.Tensor) -> dict:
    """What a checkpoint's parameter table records of a slice beyond its shape: how to put the whole back."""
    s = split_of(p)
    return {} if s is None else {"tp": {"dim": s.dim, "size": s.size, "full_shape": list(s.full_shape)}}
