"""What travels between pipeline stages, and how one neighbour's messages are posted together.

An activation (a tensor or a tuple of tensors) is described once per ``train_batch`` by a fixed
block of int64 words (:func:`encode_meta`: tuple or not, and each tensor's dtype and shape), so
the receiver can allocate its buffers; every later micro-batch must have the same shapes. The
sends and receives with one neighbour that stand together in a schedule are posted as one
``batch_isend_irecv`` (:class:`Exchange`): that is what keeps 1F1B from deadlocking on NCCL
(see :mod:`hf_zero.pipe.schedule`). Receives are waited for; sends are left in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.errors import UsageError
from hf_zero.precision.policies import SAFETENSORS_DTYPES

_DTYPES = list(SAFETENSORS_DTYPES)  # numbered in this order on the wire
META_LEN = 64  # int64 words: [is_tuple, n, (dtype, ndim, *shape) per tensor]


def flatten(x: Any, what: str) -> tuple[list[torch.Tensor], bool]:
    """A stage's input or output as a list of tensors, and whether it was a tuple."""
    if torch.is_tensor(x):
        return [x], False
    if isinstance(x, (tuple, list)) and all(torch.is_tensor(t) for t in x):
        return list(x), True
    raise UsageError(f"a pipeline stage's {what} must be a tensor or a tuple of tensors, got {type(x).__name__}")


def encode_meta(tensors: list[torch.Tensor], is_tuple: bool) -> list[int]:
    """The ``META_LEN`` words that describe an activation to the stage receiving it."""
    words = [int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise UsageError(f"a pipeline activation has dtype {t.dtype}, which cannot be sent between stages")
        words += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(words) > META_LEN:
        raise UsageError(f"a pipeline activation of {len(tensors)} tensors is too large to describe; pass at most a few tensors between stages")
    return words + [0] * (META_LEN - len(words))


def decode_meta(words: list[int]) -> tuple[list[tuple[torch.dtype, tuple[int, ...]]], bool]:
    """Each tensor's ``(dtype, shape)`` and whether the activation is a tuple."""
    is_tuple, n, i, out = bool(words[0]), words[1], 2, []
    for _ in range(n):
        dt, nd = _DTYPES[words[i]], words[i + 1]
        out.append((dt, tuple(words[i + 2 : i + 2 + nd])))
        i += 2 + nd
    return out, is_tuple


def post(ops: list[dist.P2POp]) -> list[Any]:
    """Post point-to-point operations together; their handles (one per op on gloo, one in all on NCCL)."""
    return [w for w in dist.batch_isend_irecv(ops) if w is not None]


@dataclass
class Exchange:
    """The sends and receives with one neighbour (global ``rank``, over the pair's ``group``) posted as one batch."""

    rank: int
    group: Any
    ops: list[dist.P2POp] = field(default_factory=list)
    is_recv: list[bool] = field(default_factory=list)
    landed: list[tuple[int, list[torch.Tensor], str]] = field(default_factory=list)  # (micro-batch, buffers, kind)

    def send(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.ops.append(dist.P2POp(dist.isend, t, self.rank, self.group))
            self.is_recv.append(False)

    def recv(self, bufs: list[torch.Tensor], micro: int, kind: str) -> None:
        for b in bufs:
            self.ops.append(dist.P2POp(dist.irecv, b, self.rank, self.group))
            self.is_recv.append(True)
        self.landed.append((micro, bufs, kind))

    def run(self, pending: list[Any]) -> None:
        """Post everything; wait for the receives; sends still in flight join ``pending``."""
        if not self.ops:
            return
        works = post(self.ops)
        if len(works) == len(self.ops):  # one handle per op (gloo): leave the sends in flight
            for w, r in zip(works, self.is_recv):
                if r:
                    w.wait()
                else:
                    pending.append(w)
        else:  # one coalesced handle (NCCL): waiting only orders the compute stream after it
            for w in works:
                w.wait()
