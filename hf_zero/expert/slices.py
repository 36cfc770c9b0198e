"""What an expert-parallel parameter holds of the model's fused expert tensor, carried on the parameter itself.

Layers that never see the experts module (consolidated weights, ``hf_zero/checkpoint/consolidated.py``) read it here
to put the whole tensor back together: the EP group's ranks hold consecutive blocks of experts along dim 0, or, for
PEFT's LoRA adapters of the experts, along the experts axis of a view of the adapter (``hf_zero/parallel/tp_split.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.parallel.tp_split import join

ATTR = "hf_zero_expert"


@dataclass(frozen=True)
class ExpertSlice:
    """Experts ``[first, first + local)`` of ``total`` along dim 0; the ``size`` ranks of ``group`` hold the others.

    A PEFT adapter of the experts holds them along ``dim`` of its whole tensor (of shape ``shape``) seen as ``view``
    (``lora_B``'s ``(out, r, total)``, dim 2); a fused experts tensor has neither.
    """

    first: int
    local: int
    total: int
    group: dist.ProcessGroup
    size: int
    dim: int = 0
    view: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The model's own shape of the tensor ``t`` is this rank's slice of."""
        return self.shape if self.shape is not None else (self.total, *t.shape[1:])


def slice_of(t: torch.Tensor) -> ExpertSlice | None:
    """The expert slice ``t`` holds, or None for any other tensor."""
    return getattr(t, ATTR, None)


def mark(p: torch.Tensor, s: ExpertSlice) -> None:
    setattr(p, ATTR, s)


def gather_whole(t: torch.Tensor, s: ExpertSlice) -> torch.Tensor:
    """The whole fused tensor from every EP rank's slice (collective over ``s.group``), as a new tensor."""
    parts = [torch.empty_like(t) for _ in range(s.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=s.group)
    return join(parts, s.dim, s.full_shape(t), s.view)
