"""How a model's trainable parameters fall into shard groups, and what that layout comes to before any group exists.

Stages 0-2 (and the parameters stage 3 keeps whole) go in buckets of about ``reduce_bucket_size`` elements in backward
order (:func:`buckets_by_split`, tensor-parallel slices, whole parameters and expert-parallel ones apart); stage 3
makes a group per kind in each unit and optimizer param group (:func:`unit_parts`). :class:`hf_zero.zero.optimizer.ShardedOptimizer` builds its groups
with these, and counts them first with the same functions: how many trainable groups there will be (what
``offload_optimizer.ratio`` divides) and a bound on the largest (what host memory is planned for). Apart from the
optimizer because they are pure functions of the parameters, with no buffer or process group in them.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from hf_zero.parallel.tp_split import split_of
from hf_zero.zero.group import subgroup_of
from hf_zero.zero.param_attrs import full_numel
from hf_zero.zero.units import assign_units

NamedParams = list[tuple[str, torch.nn.Parameter]]


def buckets(named: NamedParams, bucket_numel: int) -> list[NamedParams]:
    """Split parameters (already in backward order) into buckets of about ``bucket_numel`` elements."""
    out: list[NamedParams] = []
    cur: NamedParams = []
    size = 0
    for item in named:
        n = full_numel(item[1])  # a zero.Init slice counts whole, as it will be once materialized
        if cur and size + n > bucket_numel:
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += n
    if cur:
        out.append(cur)
    return out


def kind(p: torch.Tensor) -> tuple[bool, int]:
    """What a bucket may not mix: tensor-parallel slices with whole parameters, and parameters sharded over different
    process groups (a :class:`hf_zero.zero.group.SubGroup`'s, such as expert parallelism's, or the optimizer's)."""
    sub = subgroup_of(p)
    return split_of(p) is not None, id(sub.group) if sub is not None else 0


def buckets_by_split(named: NamedParams, bucket_numel: int) -> list[NamedParams]:
    """``buckets``, except that parameters of different kinds (:func:`kind`) never share a bucket.

    The global norm counts a bucket of whole parameters once per tensor-parallel group and a bucket
    of slices on every rank (``hf_zero/training/step.py``), and a bucket is reduced over one process group. Each kind is
    bucketed on its own and the buckets are ordered by when their last gradient arrives, so they still launch about
    as backward fills them.
    """
    kinds = list(dict.fromkeys(kind(p) for _, p in named))
    if len(kinds) <= 1:
        return buckets(named, bucket_numel)
    pos = {id(p): i for i, (_, p) in enumerate(named)}
    out = [b for k in kinds for b in buckets([x for x in named if kind(x[1]) == k], bucket_numel)]
    return sorted(out, key=lambda b: pos[id(b[-1][1])])


def unit_parts(named: NamedParams, ui: int, unit_of: dict[int, int], threshold: int) -> list[NamedParams]:
    """Stage 3: the parameters of ``named`` in unit ``ui`` (-1: the root) at or above ``threshold``, as the groups they
    make, one per :func:`kind` (slices first): tensor-parallel slices and whole parameters apart, as
    :func:`buckets_by_split` keeps them, since the global norm counts the two kinds differently (``hf_zero/training/step.py``),
    and parameters sharded over a sub-group (expert parallelism's) apart, since a group is reduced over one process
    group."""
    picked = [x for x in named if unit_of.get(id(x[1]), -1) == ui and full_numel(x[1]) >= threshold]
    order = sorted(dict.fromkeys(kind(x[1]) for x in picked), key=lambda k: not k[0])  # slices first
    return [[x for x in picked if kind(x[1]) == k] for k in order]


def trainable_group_count(module: torch.nn.Module, group_named: list[NamedParams], stage: int, bucket_numel: int,
                           threshold: int) -> int:
    """How many trainable shard groups the build will make (before any exists): what ``offload_optimizer.ratio`` divides.

    Counted with the build's own helpers (:func:`unit_parts`, :func:`buckets_by_split`) on whole-parameter sizes, so a
    ``zero.Init`` slice counts as the parameter it will be.
    """
    if stage < 3:
        return sum(len(buckets_by_split(list(reversed(named)), bucket_numel)) for named in group_named)
    unit_mods, unit_of = assign_units(module)
    units = sum(sum(1 for part in unit_parts(named, ui, unit_of, threshold) if part) for ui in [*range(len(unit_mods)), -1]
                for named in group_named)
    small = sum(len(buckets_by_split([x for x in reversed(named) if full_numel(x[1]) < threshold], bucket_numel))
                for named in group_named)
    return units + small


def largest_group_bound(module: torch.nn.Module, group_named: list[NamedParams], stage: int, bucket_numel: int,
                         world: int, threshold: int) -> int:
    """An upper bound, in elements, on the largest trainable shard group this rank will hold (before they exist).

    Stages 1-2 (and the parameters below ``threshold`` that stage 3 keeps whole) go in buckets of about
    ``bucket_numel`` elements that hold at least one parameter; stage 3 groups the rest by unit (per optimizer
    param group, so a unit's total bounds them). Each rank holds ``1/world`` of either.
    """
    params = [p for named in group_named for _, p in named]
    small = [p for p in params if stage < 3 or full_numel(p) < threshold]
    biggest = max([min(bucket_numel, sum(full_numel(p) for p in small)), *(full_numel(p) for p in small)], default=0)
    if stage == 3:
        trainable = {id(p) for p in params if full_numel(p) >= threshold}
        _, unit_of = assign_units(module)
        per_unit: dict[int, int] = defaultdict(int)
        for p in module.parameters():
            if id(p) in trainable:
                per_unit[unit_of.get(id(p), -1)] += full_numel(p)
        biggest = max([biggest, *per_unit.values()])
    return math.ceil(biggest / world)
