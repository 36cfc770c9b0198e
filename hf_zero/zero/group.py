"""The shard-group interface: what the engine, the step policy and checkpoints may ask of a group.

A *shard group* is one bucket of parameters laid out back to back in one flat buffer
(:func:`lay_out`), padded to a multiple of its process group's size so that every rank owns an
equal, contiguous range of it: elements ``[shard_lo, shard_hi)``. For that range the group keeps
an fp32 *master* (what the optimizer steps; bf16 when the config asks for bf16 masters) and receives the averaged gradient (``master.grad``).
Everything outside ``hf_zero/zero`` talks to groups through :class:`ShardGroup` only:

- **ownership** (checkpoints): :meth:`ShardGroup.owned` lists which elements of which parameter
  this rank holds and where they sit in :meth:`ShardGroup.owned_values`; ``partitioned`` says
  whether ranks hold distinct ranges (False: every rank holds the same whole buffer, stage 0);
- **backward**: :meth:`ShardGroup.reduce_grads` averages this rank's gradients into
  ``master.grad`` over the group's process group; :meth:`ShardGroup.sum_grad_over` adds the same
  shard of other ranks (a weight tied across pipeline stages);
- **step**: :meth:`ShardGroup.grad_sq_sum` and :meth:`ShardGroup.nonfinite` are the group's part
  of the global norm and of the inf/nan check; after the optimizer steps the masters,
  :meth:`ShardGroup.publish_master` makes the parameters everywhere follow them;
- **use**: a group that is not ``resident`` keeps only shards between uses and is made whole by
  :meth:`ShardGroup.gather` + :meth:`ShardGroup.wait`, released by :meth:`ShardGroup.reshard`.

Two implementations: :class:`hf_zero.zero.flat.FlatGroup` (stages 0-2: the parameters stay whole
on every rank; from stage 1 the master and optimizer state cover only this rank's range) and
:class:`hf_zero.zero.sharded_group.ShardedParamGroup` (stage 3: the parameters themselves are sharded and
gathered per unit). Each takes its process group explicitly and never assumes the global world,
so ZeRO can run over a data-parallel sub-group (``world = dp x sp`` for sequence parallelism).
An offloaded group — master and optimizer state in host memory, gradient shards copied to the host
as each bucket is reduced, parameters copied back after a CPU optimizer step — is one more
subclass: it overrides :meth:`reduce_grads` (reduce, then copy the shard to the host master's
``.grad``), :meth:`publish_master` (host to device, then the all-gather) and keeps the norm
contributions on the compute device, as the contract below asks.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.zero import collectives as C


@dataclass
class ParamSlot:
    """Where one parameter lives inside its group's flat buffers."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Placement:
    """Where a shard group lives and how it communicates: its process group, the device, its dtypes.

    ``group`` is explicit (None: the default world) and ``rank`` / ``world_size`` are this rank's
    index in it and its size, so a group can shard over a data-parallel sub-group of the world.
    ``replicate`` (``replicas`` ranks) is hybrid sharding's replicate group: the ranks holding this rank's
    very shard in the other shard groups. Gradients reduce-scattered (or, unpartitioned, all-reduced) over
    ``group`` are then all-reduced over it, on the shard only, and averaged over ``world_size * replicas``;
    ``replicas`` 1 (the default) is flat ZeRO and ``replicate`` is then never used.
    ``compute_dtype`` is what the parameters are held in, ``reduce_dtype`` what gradients are
    averaged in, ``master_dtype`` what the masters and their reduced gradients are kept in (fp32,
    or bf16 under ``bf16.bf16_master_weights_and_grads``: then a bf16 master is the parameters'
    own shard, with no second copy).
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    replicate: dist.ProcessGroup | None = None
    replicas: int = 1
    average_over: int | None = None  # see SubGroup: the ranks whose losses a reduced gradient averages, when not these

    @classmethod
    def over(cls, group: dist.ProcessGroup | None, device: torch.device, compute_dtype: torch.dtype,
             reduce_dtype: torch.dtype, master_dtype: torch.dtype = torch.float32, *,
             replicate: dist.ProcessGroup | None = None) -> Placement:
        """This rank's placement in ``group`` (and, under hybrid sharding, across ``replicate``)."""
        replicas = dist.get_world_size(replicate) if replicate is not None else 1
        return cls(group, dist.get_rank(group), dist.get_world_size(group), device, compute_dtype, reduce_dtype,
                   master_dtype, replicate if replicas > 1 else None, replicas)

    @property
    def averaged_over(self) -> int:
        """How many ranks' gradients one reduced gradient averages: the shard group times its replicas, unless
        ``average_over`` says otherwise (:class:`SubGroup`)."""
        return self.average_over if self.average_over is not None else self.world_size * self.replicas

    @property
    def own_subgroup(self) -> bool:
        """Placed over a :class:`SubGroup`: other sub-groups of the ZeRO ranks hold other parameters under the same
        names, so an unpartitioned group's gradient is alike only on this placement's ranks (``hf_zero/training/step.py``)."""
        return self.average_over is not None


SUBGROUP_ATTR = "hf_zero_shard_over"


@dataclass(frozen=True)
class SubGroup:
    """A parameter that ZeRO shards over a sub-group of its ranks rather than over all of them.

    Expert parallelism (``hf_zero/expert/``) gives each rank of an EP group different experts under the same
    parameter name; the ranks holding the same experts (the expert-data-parallel group, ``group``) shard them
    between themselves. Such a parameter's gradient already sums the contributions of every token its EP group
    routed to it, so summing it over ``group`` and dividing by ``average_over`` (the whole ZeRO world) gives the
    average over all ranks' losses, as every other gradient is. It rides on the parameter (:func:`mark_subgroup`), so
    the optimizer places the parameter's shard group over ``group`` without knowing why.
    """

    group: dist.ProcessGroup | None
    average_over: int


def mark_subgroup(p: torch.Tensor, sub: SubGroup) -> None:
    """Make ZeRO shard ``p`` over ``sub.group`` (see :class:`SubGroup`)."""
    setattr(p, SUBGROUP_ATTR, sub)


def subgroup_of(p: torch.Tensor) -> SubGroup | None:
    """The sub-group ``p`` is sharded over, or None: the optimizer's own group."""
    return getattr(p, SUBGROUP_ATTR, None)


@dataclass(frozen=True)
class OwnedRange:
    """Elements ``[lo, hi)`` of ``slot.param`` (flattened) are ``owned_values()[at : at + hi - lo]``."""

    slot: ParamSlot
    lo: int
    hi: int
    at: int


def lay_out(named_params: list[tuple[str, torch.nn.Parameter]]) -> tuple[list[ParamSlot], int]:
    """Place parameters back to back in one flat buffer; returns their slots and the total size."""
    slots: list[ParamSlot] = []
    offset = 0
    for name, p in named_params:
        slots.append(ParamSlot(name, p, offset, p.numel(), p.shape))
        offset += p.numel()
    return slots, offset


def pack_grads(
    slots: list[ParamSlot], padded_numel: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The slots' gradients, each cast into its place in one flat buffer of ``dtype``, and the gradients read.

    One pass from autograd's gradients into a reduction's input: no zeroed buffer for autograd to
    add into. An unused parameter (no gradient) and the padding after the last slot are zeros.
    Runs on the current stream; the caller keeps the returned gradients alive for it.
    """
    src = torch.empty(padded_numel, dtype=dtype, device=device)
    end = slots[-1].offset + slots[-1].numel if slots else 0  # lay_out places slots back to back
    grads = [s.param.grad for s in slots]
    if slots and all(g is not None for g in grads):
        # Every parameter has its gradient: one cat (one kernel, cast included) into the buffer, instead of
        # a slice, a reshape and a copy per parameter (benchmarks/bench_host_overhead.py measures the difference).
        torch.cat([g.reshape(-1) for g in grads], out=src[:end])
        if padded_numel > end:
            src[end:].zero_()
        return src, grads
    held: list[torch.Tensor] = []
    for s in slots:
        view, g = src[s.offset : s.offset + s.numel], s.param.grad
        if g is None:
            view.zero_()
        else:
            view.copy_(g.reshape(-1))
            held.append(g)
    if padded_numel > end:
        src[end:].zero_()
    return src, held


class ShardGroup(abc.ABC):
    """One bucket of parameters sharded over an explicit process group; see the module docstring.

    Subclasses set ``trainable`` (the group has a master the optimizer steps), ``partitioned``
    (ranks own distinct ranges) and ``resident`` (the whole parameters always exist on the device),
    and ``master`` (None for a frozen group).
    """

    trainable: bool
    partitioned: bool
    resident: bool
    tp_split = False  # its parameters are tensor-parallel slices (a bucket never mixes slices and whole ones)
    master: torch.Tensor | None

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, parts: int) -> None:
        """Lay the parameters out and compute this rank's range; ``parts`` is 1 when nothing is partitioned."""
        self.place = place
        self.group, self.rank, self.world_size, self.device = place.group, place.rank, place.world_size, place.device
        self.compute_dtype, self.reduce_dtype, self.master_dtype = place.compute_dtype, place.reduce_dtype, place.master_dtype
        self.mixed = self.compute_dtype != self.master_dtype  # False: the master is (a view of) the parameters
        self.slots, self.numel = lay_out(named_params)
        self.padded_numel = math.ceil(self.numel / parts) * parts
        self.shard_numel = self.padded_numel // parts
        self.shard_lo = self.rank * self.shard_numel if parts > 1 else 0
        self.shard_hi = self.shard_lo + self.shard_numel

    # ------------------------------------------------------------ ownership

    def owned(self) -> Iterator[OwnedRange]:
        """The parts of this group's parameters that fall in this rank's range, in layout order."""
        lo, hi = self.shard_lo, self.shard_hi
        for s in self.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                yield OwnedRange(s, a - s.offset, b - s.offset, a - lo)

    def partitions(self) -> Iterator[tuple[ParamSlot, int, int]]:
        """Each parameter's partition in this rank's range, as DeepSpeed's per-parameter ones: ``(slot, at, n)``,
        elements ``[at, at + n)`` of the shard (:meth:`owned_values`, the gradient shard); empty where this rank
        holds none of it. The padding that ends the group is the last parameter's, as DeepSpeed pads each
        parameter to a multiple of the ranks (where a group holds one parameter, the two layouts are the same)."""
        lo, hi = self.shard_lo, self.shard_hi
        for i, s in enumerate(self.slots):
            a = max(s.offset, lo)
            b = hi if i == len(self.slots) - 1 else min(s.offset + s.numel, hi)
            yield s, a - lo, max(b - a, 0)

    def owned_values(self) -> torch.Tensor:
        """The tensor :meth:`owned`'s ``at`` offsets index: the fp32 master (a frozen group: its shard)."""
        assert self.master is not None
        return self.master

    # ------------------------------------------------------------- gradients

    def _sum_over_replicas(self, reduced: torch.Tensor) -> None:
        """Hybrid sharding: add the same shard's sums of the other shard groups (in the reduce dtype, in place),
        so that the reduced gradient sums every rank's; a no-op under flat ZeRO."""
        if self.place.replicas > 1:
            C.all_reduce_(reduced, self.place.replicate, self.place.replicas)

    @abc.abstractmethod
    def reduce_grads(self, stream: torch.cuda.Stream | None) -> None:
        """Average this rank's gradients over the process group into ``master.grad`` (issued on ``stream``)."""

    @abc.abstractmethod
    def zero_grads(self) -> None:
        """End of a step (applied or skipped): drop the reduced and any accumulated gradients."""

    def reduced_grad(self) -> torch.Tensor | None:
        """This rank's averaged gradient shard on the compute device (``master.grad``; an offloaded group keeps it apart)."""
        return self.master.grad if self.master is not None else None

    def _set_reduced_grad(self, grad: torch.Tensor | None) -> None:
        assert self.master is not None
        self.master.grad = grad

    def grad_values(self, writable: bool = False) -> torch.Tensor | None:
        """This rank's averaged gradient shard wherever it is now, for reading (or, ``writable``, editing) it
        between backward and step (``deepspeed.utils.safe_get_full_grad``): :meth:`reduced_grad`, or an
        offloaded group's host copy once its device shard was released (``writable`` brings it back, so the
        step's norm sees the edit)."""
        return self.reduced_grad()

    copy_after_reduce = False  # an offloaded group: copy the reduced shard to the host as soon as it is final

    def before_step(self) -> None:  # noqa: B027 - a no-op unless the master lives elsewhere, not abstract
        """Just before the optimizer steps the masters (an offloaded group copies its gradient shard to the host)."""

    def scale_host_copy(self, coef: torch.Tensor | float) -> None:  # noqa: B027 - a no-op without a host copy
        """The reduced gradient was multiplied by ``coef`` after its copy to the host left: scale that copy too."""

    def sum_grad_over(self, process_group: dist.ProcessGroup | None) -> None:
        """Add the same reduced shard of the other ranks of ``process_group`` (a weight tied across stages)."""
        g = self.reduced_grad()
        if g is not None:
            dist.all_reduce(g, group=process_group)

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced gradient: an fp32 scalar on the compute device, no host sync."""
        g = self.reduced_grad()
        if g is None:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(g, dtype=torch.float32).square()

    def nonfinite(self) -> torch.Tensor:
        """1.0 when this rank's reduced gradient holds an inf or nan, else 0.0 (on the compute device)."""
        g = self.reduced_grad()
        if g is None:
            return torch.zeros((), device=self.device)
        return (~torch.isfinite(g)).any().float()

    # ------------------------------------------------------------ parameters

    @abc.abstractmethod
    def publish_master(self, stream: torch.cuda.Stream | None) -> None:
        """After the optimizer step (or a checkpoint load): make the parameters follow the masters on every rank."""

    def gather(self, stream: torch.cuda.Stream | None) -> None:  # noqa: B027 - a no-op for resident groups, not abstract
        """Start making the whole parameters available (a resident group has them already)."""

    def wait(self) -> None:  # noqa: B027 - a no-op for resident groups, not abstract
        """Make the gathered parameters usable on the compute stream."""

    def reshard(self) -> None:  # noqa: B027 - a no-op for resident groups, not abstract
        """Release the whole parameters' memory, keeping only this rank's shard (resident groups keep all)."""

    @abc.abstractmethod
    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        """What this rank holds for the group, as ``{"params": [...], "grads": [...]}`` (memory accounting)."""
