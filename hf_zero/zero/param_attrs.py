"""DeepSpeed's ZeRO-3 attributes on hf_zero's sharded parameters: ``ds_shape``, ``ds_numel``, ``ds_id``,
``ds_status``, ``ds_tensor``, ``ds_persist``.

Code written for DeepSpeed reads them to handle a parameter whose data is not all there: PEFT takes
a layer's shape from ``ds_shape`` and counts parameters with ``ds_numel``, transformers counts with
``ds_numel``, TRL gathers what is not ``ZeroParamStatus.AVAILABLE``, and DeepSpeed's own tests and
scripts check ``ds_status`` around ``GatheredParameters``. hf_zero keeps its own bookkeeping
(``hf_zero_group``, ``hf_zero_preshard``) and sets these beside it, with DeepSpeed's meanings:

- ``ds_shape`` / ``ds_numel``: the whole parameter's shape and element count;
- ``ds_id``: a number unique in the process, kept for the parameter's life;
- ``ds_status``: ``AVAILABLE`` while the whole parameter is there (inside a gather, or always for a
  parameter kept whole), ``NOT_AVAILABLE`` while only this rank's part is, ``INFLIGHT`` while its
  all-gather runs;
- ``ds_tensor``: this rank's elements of the parameter, flat (under ``zero.Init`` its padded slice;
  in a stage-3 engine the part of the fp32 master, or of a frozen shard, that this rank owns, which
  may be empty: hf_zero shards a unit's parameters together, not each parameter by itself; the padding
  that ends a shard group counts to its last parameter, as DeepSpeed pads each parameter's partition).
  It is a view of where the values live (a :class:`Partition`), so a write changes the parameter: in place
  (``ds_tensor.fill_(v)``) or, as scripts and DeepSpeed's tests write it, ``ds_tensor.data = t``, which
  here copies ``t`` in (DeepSpeed rebinds its partition to ``t``; the next gather reads it either way);
- ``ds_persist``: True for a parameter a stage-3 engine keeps whole on every rank.

Where they differ from DeepSpeed: between gathers a parameter of a stage-3 *engine* keeps its shape
(its storage is released, ``hf_zero/zero/stage3.py``) and refuses ops that read its values
(``hf_zero/zero/released.py``), where DeepSpeed's is a 0-element tensor; a
parameter built under ``zero.Init`` is a 0-element tensor outside the ``with`` block, as DeepSpeed's.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable

import torch

ATTRS = ("ds_shape", "ds_numel", "ds_id", "ds_status", "ds_tensor", "ds_persist")


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``, with its values."""

    AVAILABLE = 1  # the whole parameter is on this rank
    NOT_AVAILABLE = 2  # only this rank's part is
    INFLIGHT = 3  # being gathered


_ids = itertools.count()


class Partition(torch.Tensor):
    """``ds_tensor``: a view of the storage a parameter's partition lives in, whose ``.data = t`` copies ``t`` in.

    ``ds_tensor.data = t`` is how code written for DeepSpeed sets a partition (DeepSpeed gathers from whatever
    tensor ``ds_tensor`` holds). hf_zero's partition is a view of its shard (the fp32 master, a frozen shard,
    ``zero.Init``'s slice), so rebinding the view would change nothing; the assignment writes through instead,
    and refuses a tensor of another element count. Every other operation is a plain tensor's (the subclass
    does not propagate through ops).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value.numel() != self.numel():
            raise ValueError(f"ds_tensor.data = t: this rank's partition holds {self.numel()} elements, t has "
                             f"{value.numel()}; write a tensor of the partition's size (torch.full_like(ds_tensor, v))")
        with torch.no_grad():
            torch.Tensor.copy_(self, value.reshape(self.shape))


def as_partition(local: torch.Tensor) -> Partition:
    """``local`` (a view of where a partition lives) as a :class:`Partition`, sharing its storage, outside autograd
    (an fp32 master is an optimizer leaf: a write through ``ds_tensor`` needs no ``torch.no_grad()``)."""
    return local if isinstance(local, Partition) else local.detach().as_subclass(Partition)


def mark(param: torch.nn.Parameter, shape: torch.Size | tuple[int, ...], local: torch.Tensor,
         status: ZeroParamStatus, persist: bool = False) -> None:
    """Set DeepSpeed's attributes on ``param`` (its ``ds_id`` is kept once given)."""
    if "ds_id" not in param.__dict__:
        param.ds_id = next(_ids)
    param.ds_shape = torch.Size(shape)
    param.ds_numel = math.prod(param.ds_shape)
    param.ds_tensor = as_partition(local)
    param.ds_status = status
    param.ds_persist = persist


def set_status(params: Iterable[torch.nn.Parameter], status: ZeroParamStatus) -> None:
    """``ds_status`` of each of ``params``: where hf_zero's own state of them changes."""
    for p in params:
        p.ds_status = status


def clear(param: torch.nn.Parameter) -> None:
    """Drop DeepSpeed's attributes: the parameter is an ordinary, whole one again."""
    for name in ATTRS:
        param.__dict__.pop(name, None)


def full_numel(param: torch.Tensor) -> int:
    """The whole parameter's element count, also for one that is a 0-element tensor outside a gather."""
    return int(param.__dict__.get("ds_numel", param.numel()))
