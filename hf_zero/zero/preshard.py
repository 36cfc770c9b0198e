"""Parameters that exist only as this rank's slice: what ``zero.Init`` builds models out of.

A *presharded* parameter carries ``hf_zero_preshard``: this rank's contiguous slice of the
flattened parameter, padded so that every rank's slice has the same length. The engine later turns
these per-parameter slices into its per-unit flat shards, gathering one unit at a time, so the
model never exists whole. Its data is what DeepSpeed's is: a 0-element tensor of its dtype on the
training device, with the whole shape in ``ds_shape`` and DeepSpeed's other attributes beside it
(``hf_zero/zero/param_attrs.py``), so code written for DeepSpeed reads it as it reads DeepSpeed's.
While a ``zero.Init`` block is open (:func:`building`), the data is a tensor of the whole shape on the
``meta`` device instead: the module code that runs there (constructors, transformers' weight
initialisation) does not know it runs under ZeRO-3 and reads shapes; the block's end turns those
into the 0-element form (:func:`show_empty_`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.distributed import dist as hz_dist
from hf_zero.zero import collectives as C
from hf_zero.zero.param_attrs import ZeroParamStatus, mark

# While a zero.Init block is open: presharded parameters keep their shape on meta (see the module doc), and
# those made so are remembered, to be shown empty when the block ends (by id: a weak reference would stop
# set_data_'s swap_tensors, and the block holds its model anyway).
_building: list[bool] = [False]
_kept_shape: dict[int, torch.nn.Parameter] = {}


@dataclass
class PreShard:
    """This rank's slice of one parameter, and what is needed to rebuild the whole."""

    shard: torch.Tensor  # 1-D, ``shard_numel`` elements: flat[rank*shard_numel : (rank+1)*shard_numel], zero padded
    shape: torch.Size
    world_size: int
    group: dist.ProcessGroup | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """``(lo, hi, shard_numel)``: the flat range rank ``rank`` owns (``hi`` clipped to ``numel``)."""
    k = math.ceil(numel / world_size) if numel else 0
    lo = min(rank * k, numel)
    return lo, min(lo + k, numel), k


def is_presharded(param: torch.Tensor) -> bool:
    return getattr(param, "hf_zero_preshard", None) is not None


def set_data_(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data``, also across the meta/real boundary, which ``.data`` assignment refuses.

    The parameter object stays the same (modules, tied references and optimizers keep pointing at
    it); only its tensor contents are swapped in, and its Python attributes are kept.
    """
    if param.device.type == data.device.type:
        param.data = data
        return
    attrs = dict(param.__dict__)
    torch.utils.swap_tensors(param, torch.nn.Parameter(data, requires_grad=param.requires_grad))
    param.__dict__.update(attrs)


def building(on: bool) -> None:
    """``zero.Init`` opens (True) or closes (False) its block; see the module doc."""
    _building[0] = on


def _empty_like(param: torch.Tensor) -> torch.Tensor:
    device = hz_dist.get_device() if dist.is_initialized() else torch.device("cpu")
    return torch.empty(0, dtype=param.dtype, device=device)


def preshard_(param: torch.nn.Parameter, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Make ``param`` presharded with ``shard`` (this rank's padded slice); its data becomes empty (see the module doc)."""
    world = dist.get_world_size(group)
    shape = param.shape if not is_presharded(param) else param.hf_zero_preshard.shape
    if _building[0]:
        set_data_(param, torch.empty(shape, dtype=param.dtype, device="meta"))
        _kept_shape[id(param)] = param
    else:
        set_data_(param, _empty_like(param))
    param.hf_zero_preshard = PreShard(shard=shard, shape=shape, world_size=world, group=group)
    mark(param, shape, shard, ZeroParamStatus.NOT_AVAILABLE)


def show_empty_() -> None:
    """The end of a ``zero.Init`` block: presharded parameters made inside it become 0-element tensors."""
    for p in _kept_shape.values():
        if is_presharded(p) and p.device.type == "meta":
            set_data_(p, _empty_like(p))
    _kept_shape.clear()


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's whole shape, presharded or not."""
    return param.hf_zero_preshard.shape if is_presharded(param) else param.shape


def slice_of(full: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """This rank's padded slice of ``full`` (a copy, so the full tensor can be freed)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = full.detach().reshape(-1)
    lo, hi, k = shard_bounds(flat.numel(), world, rank)
    out = torch.zeros(k, dtype=full.dtype, device=device)
    out[: hi - lo].copy_(flat[lo:hi])
    return out


def materialize_(params: list[torch.nn.Parameter], device: torch.device) -> None:
    """All-gather presharded parameters back to full tensors (collective: every rank, same order)."""
    for p in params:
        ps: PreShard | None = getattr(p, "hf_zero_preshard", None)
        if ps is None:
            continue
        k = ps.shard.numel()
        full = torch.empty(k * ps.world_size, dtype=ps.shard.dtype, device=device)
        C.all_gather_(full, ps.shard.to(device), ps.group, ps.world_size)
        p.hf_zero_preshard = None
        set_data_(p, full[: ps.numel].view(ps.shape).to(p.dtype))
        p.ds_status = ZeroParamStatus.AVAILABLE


def reshard_(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
    """Keep only this rank's slice of each (full, identical on every rank) parameter again, on ``device``
    (default: where the parameter is; host memory for a ``zero.Init(remote_device="cpu")`` model)."""
    for p in params:
        preshard_(p, slice_of(p.data, group, device or p.device), group)
