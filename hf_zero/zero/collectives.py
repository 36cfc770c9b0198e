"""Stateless collectives: each takes its buffers, the process group and the stream to run on.

Overlap comes from issuing a collective on a side stream that first waits on the compute
stream (so it sees finished gradients) and that the compute stream later waits on (so it
sees the result). Nothing here calls ``synchronize()``; on CPU (gloo) ``stream`` is None and
the call simply runs. Every function is a no-op for a group of one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on ``stream`` after it has waited for the current stream's work."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def wait_for(stream: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for everything queued on ``stream`` (no host sync)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None, world_size: int) -> None:
    """Sum ``tensor`` in place across the group."""
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, world_size: int
) -> None:
    """Sum ``inp`` (world_size equal chunks) across the group; this rank's chunk lands in ``out``.

    ``out`` may be this rank's own chunk of ``inp`` (the in-place form NCCL allows).
    """
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    _reduce_scatter(out, inp, group=group)


def all_gather_(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, world_size: int
) -> None:
    """Concatenate every rank's ``shard`` into ``out``; ``shard`` may be this rank's chunk of ``out``."""
    if world_size == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return
    _all_gather(out, shard, group=group)


def broadcast_(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, world_size: int) -> None:
    """Overwrite ``tensor`` with the group's global rank ``src`` copy."""
    if world_size > 1:
        dist.broadcast(tensor, src=src, group=group)
