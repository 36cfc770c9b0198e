"""What an expert-parallel parameter holds of the model's fused expert tensor, carried on the parameter itself.

Layers that never see the experts module (consolidated weights, ``hf_zero/checkpoint/consolidated.py``) read it here
to put the whole tensor back together: the EP group's ranks hold consecutive blocks of experts along dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ATTR = "hf_zero_expert"


@dataclass(frozen=True)
class ExpertSlice:
    """Experts ``[first, first + local)`` of ``total`` along dim 0; the ``size`` ranks of ``group`` hold the others."""

    first: int
    local: int
    total: int
    group: dist.ProcessGroup
    size: int

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The model's own shape of the tensor ``t`` is this rank's slice of."""
        return (self.total, *t.shape[1:])


def slice_of(t: torch.Tensor) -> ExpertSlice | None:
    """The expert slice ``t`` holds, or None for any other tensor."""
    return getattr(t, ATTR, None)


def mark(p: torch.Tensor, s: ExpertSlice) -> None:
    setattr(p, ATTR, s)


def gather_whole(t: torch.Tensor, s: ExpertSlice) -> torch.Tensor:
    """The whole fused tensor from every EP rank's slice (collective over ``s.group``), as a new tensor."""
    parts = [torch.empty_like(t) for _ in range(s.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=s.group)
    return torch.cat(parts, dim=0)
