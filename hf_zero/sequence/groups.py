"""Process groups for Ulysses sequence parallelism: ``world = dp x sp``.

Ranks ``k*sp .. k*sp+sp-1`` (in the order of the parent group) form sequence-parallel group
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


def make_groups(sp_size: int, group: dist.ProcessGroup | None = None) -> SequenceParallelGroups:
    """Split ``group`` (default: the world) into sp groups of ``sp_size`` consecutive ranks and dp groups across them.

    Every rank of ``group`` calls this, with the same ``sp_size``. Only the members of each new
    group take part in creating it, so ``group`` may itself be a sub-group of the world.
    """
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise SequenceParallelError(f"sequence_parallel_size: got {sp_size!r}, expected an integer >= 1")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    n = len(ranks)
    if n % sp_size:
        raise SequenceParallelError(
            f"sequence_parallel_size {sp_size} does not divide the {n} ranks; the world must be data-parallel "
            f"degree x sequence-parallel degree, so choose a divisor of {n}"
        )
    me = ranks.index(dist.get_rank())
    k, j = divmod(me, sp_size)
    sp_ranks = tuple(ranks[k * sp_size : (k + 1) * sp_size])
    dp_ranks = tuple(ranks[j::sp_size])
    return SequenceParallelGroups(
        sp_size=sp_size,
        sp_rank=j,
        sp_group=_subgroup(sp_ranks, n, group),
        dp_size=n // sp_size,
        dp_rank=k,
        dp_group=_subgroup(dp_ranks, n, group),
        zero_group=group,
        sp_ranks=sp_ranks,
        dp_ranks=dp_ranks,
    )


_CREATED: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _subgroup(members: tuple[int, ...], parent_size: int, parent: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group of ``members``, made once per process (a second engine reuses it: torch names
    locally synchronised groups by their ranks, so making it twice would collide)."""
    if len(members) == 1:
        return None
    if len(members) == parent_size:
        return parent if parent is not None else dist.group.WORLD
    if members not in _CREATED:
        _CREATED[members] = dist.new_group(list(members), use_local_synchronization=True)
    return _CREATED[members]
