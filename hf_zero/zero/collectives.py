"""Stateless collectives: each takes its buffers, the process group and the stream to run on.

Overlap comes from issuing a collective on a side stream that first waits on the compute
stream (so it sees finished gradients) and that the compute stream later waits on (so it
sees the result). Nothing here calls ``synchronize()``; on CPU (gloo) ``stream`` is None and
the call simply runs. Every function is a no-op for a group of one.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

# torch 2.13 added reduce_scatter_single / all_gather_single and deprecated the old names, but
# on gloo the new ones make about 3 processes in 10 abort at interpreter exit ("terminate
# called without an active exception"; a plain torch script shows it). The old names are used
# while torch has them, with only their deprecation notice silenced.
_reduce_scatter = getattr(dist, "reduce_scatter_tensor", None) or dist.reduce_scatter_single
_all_gather = getattr(dist, "all_gather_into_tensor", None) or dist.all_gather_single
warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", category=FutureWarning)


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
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, world_size: int,
    async_op: bool = False,
) -> dist.Work | None:
    """Concatenate every rank's ``shard`` into ``out``; ``shard`` may be this rank's chunk of ``out``.

    ``async_op``: return the collective's work handle instead of waiting (None when there was nothing to wait for).
    """
    if world_size == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return None
    return _all_gather(out, shard, group=group, async_op=async_op)


def broadcast_(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, world_size: int) -> None:
    """Overwrite ``tensor`` with the group's global rank ``src`` copy."""
    if world_size > 1:
        dist.broadcast(tensor, src=src, group=group)


class InflightLimit:
    """At most one reduction's buffers in flight on a side stream.

    Backward runs ahead of the communication stream. If each reduction's input buffer were just
    ``record_stream``-ed and dropped, the allocator could not reuse any of them until the side
    stream caught up, and every unit's gradient buffer would pile up. Instead the buffers of the
    last reduction are kept here; issuing the next one first makes the compute stream wait on
    the previous one's event (a GPU-side wait, no host sync) and only then releases its buffers.
    """

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None
        self._buffers: list[torch.Tensor] = []

    def before_issue(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None and self._event is not None:
            torch.cuda.current_stream(stream.device).wait_event(self._event)
        self._event = None
        self._buffers = []

    def after_issue(self, stream: torch.cuda.Stream | None, buffers: list[torch.Tensor]) -> None:
        if stream is None:
            return  # the collective already ran; nothing is in flight
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._buffers = buffers

    def drain(self, stream: torch.cuda.Stream | None) -> None:
        """End of backward: the compute stream waits for the last reduction; its buffers go."""
        self.before_issue(stream)
