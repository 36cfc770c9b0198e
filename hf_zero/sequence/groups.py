"""Ulysses sequence parallelism's view of the run's grid (``hf_zero/parallel/grid.py``): ``world = dp x sp``.

The grid's ``sp`` axis is innermost but for ``tp``: ranks ``k*sp .. k*sp+sp-1`` form sequence-parallel group
``k``: they share every sample, each holding ``1/sp`` of its tokens, and trade activations with
all-to-alls inside attention. The ranks at the same position of their sp groups form a
data-parallel group: they see different samples. Consecutive ranks share a sample so that,
with one process per GPU, the all-to-alls stay inside a node (NVLink) whenever sp divides the
GPUs per node.

ZeRO runs over the whole parent group (DeepSpeed calls it the sequence-data-parallel group),
not over the dp group alone. Every rank of an sp group holds the same parameters, so sharding
over all ``dp x sp`` ranks divides parameter, gradient and optimizer memory by the whole world,
and a single reduce-scatter over all ranks does what SP needs of gradient reduction: each rank's
gradient is only its tokens' part of the sample's gradient, so the parts must be *summed* over
sp and *averaged* over dp. The engine averages over all ranks, which is ``(1/sp)`` times the sum
over sp averaged over dp; :func:`hf_zero.sequence.loss.sequence_parallel_mean` makes up the factor
sp by giving every rank the whole group's loss (see there), exactly as one process computing the
mean over the group's tokens would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hf_zero.parallel import DATA_AXES, GridShape, ParallelGrid, grid_for
from hf_zero.parallel.grid import device_type_of_default_group


class SequenceParallelError(ValueError):
    """A sequence-parallel setup that cannot run: one sentence naming what to change."""


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place in the ``dp x sp`` grid, and the groups to talk over.

    ``sp_group`` is only used when ``sp_size > 1`` and ``dp_group`` only when ``dp_size > 1``
    (they are None otherwise: this rank alone). ``zero_group`` is the parent group (None: the
    world) that ZeRO shards and reduces over.
    """

    sp_size: int
    sp_rank: int
    sp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    zero_group: dist.ProcessGroup | None
    sp_ranks: tuple[int, ...]  # global ranks of this rank's sp group, in sequence order
    dp_ranks: tuple[int, ...]

    @property
    def enabled(self) -> bool:
        return self.sp_size > 1


def view_of(grid: ParallelGrid) -> SequenceParallelGroups | None:
    """The ``sp`` axis of the run's grid (:mod:`hf_zero.parallel.grid`) as this rank sees it; None when it is 1."""
    sp = grid.size("sp")
    if sp == 1:
        return None
    dp = grid.dp_size
    return SequenceParallelGroups(
        sp_size=sp,
        sp_rank=grid.rank("sp"),
        sp_group=_explicit(grid.group("sp")),
        dp_size=dp,
        dp_rank=grid.dp_rank,
        dp_group=_explicit(grid.group(*DATA_AXES)) if dp > 1 else None,
        zero_group=grid.zero_group,
        sp_ranks=grid.ranks("sp"),
        dp_ranks=grid.ranks(*DATA_AXES),
    )


def make_groups(sp_size: int, group: dist.ProcessGroup | None = None) -> SequenceParallelGroups:
    """The ``dp x sp`` view of a grid of the whole world with ``sp_size`` consecutive ranks per sequence-parallel group.

    Every rank calls this with the same ``sp_size`` (the groups are made collectively, once per process).
    """
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise SequenceParallelError(f"sequence_parallel_size: got {sp_size!r}, expected an integer >= 1")
    if group is not None:
        raise SequenceParallelError("make_groups(group=...): sequence parallelism is cut from the whole world's grid; "
                                    "leave group unset")
    n = dist.get_world_size()
    if n % sp_size:
        raise SequenceParallelError(
            f"sequence_parallel_size {sp_size} does not divide the {n} ranks; the world must be data-parallel "
            f"degree x sequence-parallel degree, so choose a divisor of {n}"
        )
    grid = grid_for(GridShape.fill(n, sp=sp_size), device_type_of_default_group())
    view = view_of(grid)
    if view is None:  # sp_size 1: every rank its own sequence-parallel group
        rank = dist.get_rank()
        return SequenceParallelGroups(1, 0, None, n, rank, None if n == 1 else dist.group.WORLD, None, (rank,),
                                      tuple(range(n)))
    return view


def _explicit(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The grid answers None for a group of every rank; these views name the world group instead, as they always did."""
    return dist.group.WORLD if group is None else group
