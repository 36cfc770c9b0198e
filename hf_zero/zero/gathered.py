"""``GatheredParameters`` (DeepSpeed's name): full parameters inside a block, even under stage 3 or ``zero.Init``."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
import torch.distributed as dist

from hf_zero.distributed import dist as hz_dist
from hf_zero.zero import collectives as C
from hf_zero.zero.external import register_external_parameter
from hf_zero.zero.preshard import is_presharded, materialize_, reshard_
from hf_zero.zero.sharded_group import ShardState


def _as_list(params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None) -> list[torch.nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def src_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """The global rank of ``group``'s rank ``rank_in_group`` (collectives take global ranks)."""
    return dist.get_global_rank(group, rank_in_group) if group is not None else rank_in_group


def broadcast_from(tensor: torch.Tensor, r: int, group: dist.ProcessGroup | None, world_size: int,
                   place: object = None) -> None:
    """Overwrite ``tensor`` with rank ``r``'s copy, ``r`` counted in the ranks holding the parameter whole.

    Under hybrid sharding (``place.replicas`` > 1) those are the shard group times its replicas, numbered as the
    grid numbers its ZeRO group (replica-major): rank ``r`` is shard rank ``r % world_size`` of replica
    ``r // world_size``, so the value goes round the shard group first, then across the replicate group.
    """
    replicas = getattr(place, "replicas", 1)
    shard_r, replica_r = (r % world_size, r // world_size) if replicas > 1 else (r, 0)
    C.broadcast_(tensor, src_rank(group, shard_r), group, world_size)
    if replicas > 1:
        replicate = place.replicate  # type: ignore[attr-defined]
        C.broadcast_(tensor, src_rank(replicate, replica_r), replicate, replicas)


class GatheredParameters:
    """Full parameters inside the block, even under ZeRO stage 3 or ``zero.Init``.

    With ``modifier_rank=r`` the values rank ``r`` holds when the block ends are broadcast to
    every rank and written into each rank's shard and fp32 master, so an edit (re-initialising a
    head, copying in pretrained weights) survives resharding and is what the optimizer continues
    from. With ``modifier_rank=None`` edits are discarded, as in DeepSpeed. Outside stage 3 the
    parameters are already whole; ``modifier_rank`` still broadcasts the edit and refreshes the
    fp32 master copy. Every rank must enter the block with the same parameters (it is a collective).
    """

    def __init__(
        self,
        params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None,
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = _as_list(params)
        if fwd_module is not None and enabled:  # DeepSpeed registers them as external parameters of fwd_module
            for p in self.params:
                if isinstance(p, torch.nn.Parameter):
                    register_external_parameter(fwd_module, p)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._groups: list = []
        self._was_sharded: list[bool] = []
        self._presharded: list[torch.nn.Parameter] = []
        self._preshard_group: dist.ProcessGroup | None = None

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        seen: set[int] = set()
        for p in self.params:
            g = getattr(p, "hf_zero_group", None)
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                self._groups.append(g)
                self._was_sharded.append(g.state is ShardState.SHARDED)
                g.gather(None)
                g.wait()
            elif getattr(p, "hf_zero_flat", None) is not None:
                p.hf_zero_flat.wait()  # a step with overlap_param_gather may have left its all-gather in flight
            elif is_presharded(p) and id(p) not in seen:
                seen.add(id(p))
                self._presharded.append(p)
        if self._presharded:
            self._preshard_group = self._presharded[0].hf_zero_preshard.group
            # slices may wait in host memory (zero.Init(remote_device="cpu")); they are gathered where the
            # collectives run and go back where they were
            self._slice_device = self._presharded[0].hf_zero_preshard.shard.device
            materialize_(self._presharded, hz_dist.get_device() if dist.is_initialized() else self._slice_device)
        return self

    def _process_group(self, p: torch.nn.Parameter) -> dist.ProcessGroup | None:
        """The group whose ranks hold ``p`` whole (its FlatGroup's, its zero.Init group, else the world)."""
        fg = getattr(p, "hf_zero_flat", None)
        if fg is not None:
            return fg.group
        return self._preshard_group if any(p is q for q in self._presharded) else None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        r = self.modifier_rank
        if r is not None and exc_type is None and dist.is_initialized():
            # As DeepSpeed: ``modifier_rank`` is a rank of each parameter's own process group.
            for g in self._groups:
                broadcast_from(g.full, r, g.group, g.world_size, g.place)
                g.write_back_from_full()
            for p in self.params:
                if getattr(p, "hf_zero_group", None) is not None:
                    continue
                group = self._process_group(p)
                fg = getattr(p, "hf_zero_flat", None)
                with torch.no_grad():
                    broadcast_from(p.data, r, group, dist.get_world_size(group), fg.place if fg is not None else None)
                if fg is not None:
                    fg.write_back_param(next(s for s in fg.slots if s.param is p))
        for g, was in zip(self._groups, self._was_sharded):
            if was:  # a tensor taken from a parameter inside the block stays readable (ShardedParamGroup.reshard)
                g.reshard(leave_views=True)
        if self._presharded:
            # Without a modifier the shards are unchanged: every rank keeps the slice it had.
            reshard_(self._presharded, self._preshard_group, self._slice_device)
