"""User-facing stage-3 helpers: ``GatheredParameters`` (DeepSpeed's name and semantics)."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
import torch.distributed as dist

from hf_zero.zero import collectives as C
from hf_zero.zero.params import ShardState


def _as_list(params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None) -> list[torch.nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


class GatheredParameters:
    """Full parameters inside the block, even under ZeRO stage 3.

    With ``modifier_rank=r`` the values rank ``r`` holds when the block ends are broadcast to
    every rank and written into each rank's shard and fp32 master, so an edit (re-initialising a
    head, copying in pretrained weights) survives resharding and is what the optimizer continues
    from. With ``modifier_rank=None`` edits are discarded, as in DeepSpeed. Outside stage 3 the
    parameters are already whole; ``modifier_rank`` still broadcasts the edit and refreshes the
    fp32 master copy.
    """

    def __init__(
        self,
        params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None,
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._groups: list = []
        self._was_sharded: list[bool] = []

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
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc_type is None and dist.is_initialized():
            world = dist.get_world_size()
            for g in self._groups:
                C.broadcast_(g.full, self.modifier_rank, None, world)
                g.write_back_from_full()
            for p in self.params:
                if getattr(p, "hf_zero_group", None) is not None:
                    continue
                with torch.no_grad():
                    C.broadcast_(p.data, self.modifier_rank, None, world)
                fg = getattr(p, "hf_zero_flat", None)
                if fg is not None:
                    fg.write_back_param(next(s for s in fg.slots if s.param is p))
        for g, was in zip(self._groups, self._was_sharded):
            if was:
                g.reshard()
