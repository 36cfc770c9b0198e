"""The process groups of expert parallelism: EP groups and expert-data-parallel groups, made once per process."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place among ``world = ep_size x edp_size`` ranks.

    ``ep_group``: the ``ep_size`` consecutive ranks that split each layer's experts and exchange tokens;
    ``edp_group``: the ranks holding this rank's experts (one per EP group), over which ZeRO shards them.
    """

    ep_size: int
    ep_rank: int
    ep_group: dist.ProcessGroup
    edp_size: int
    edp_rank: int
    edp_group: dist.ProcessGroup
    world_size: int


_CACHE: dict[tuple[int, int], tuple[dist.ProcessGroup, ExpertGroups]] = {}


def expert_groups(ep_size: int) -> ExpertGroups:
    """This rank's groups for ``ep_size`` (which must divide the world size; the caller has checked it).

    ``new_group`` is collective: every rank makes every group, in the same order, the first time a size is asked
    for; a later engine with the same size (a second ``initialize`` in one process) reuses them, as long as the
    default process group is the same one.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    default = dist.distributed_c10d._get_default_group()
    key = (id(default), ep_size)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is default:
        return cached[1]
    ep_group = edp_group = None
    for k in range(world // ep_size):
        g = dist.new_group(list(range(k * ep_size, (k + 1) * ep_size)))
        if rank // ep_size == k:
            ep_group = g
    for i in range(ep_size):
        g = dist.new_group(list(range(i, world, ep_size)))
        if rank % ep_size == i:
            edp_group = g
    assert ep_group is not None and edp_group is not None
    groups = ExpertGroups(ep_size, rank % ep_size, ep_group, world // ep_size, rank // ep_size, edp_group, world)
    _CACHE[key] = (default, groups)
    return groups
