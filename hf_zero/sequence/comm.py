"""The collectives of sequence parallelism, as autograd functions.

Ulysses moves activations between two layouts with one all-to-all each way: *sequence-sharded*
(every rank holds all heads of its ``1/sp`` of the tokens) and *head-sharded* (every rank holds
``1/sp`` of the heads for all tokens). :func:`all_to_all` is that exchange for any pair of
dimensions; its backward is the same exchange with the two dimensions swapped, so gradients
travel back along the path the activations came. gloo implements ``all_to_all_single`` on CPU
tensors, so the same code runs in the CPU tests and over NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into ``size`` chunks, send chunk ``j`` to rank ``j`` of ``group``,
    and concatenate what arrives along ``gather_dim`` in rank order."""
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"sequence parallelism: dimension {scatter_dim} of a {tuple(x.shape)} tensor does not split into "
            f"{size} equal parts for the all-to-all"
        )
    send = x.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    chunk = send.shape[0] // size
    # recv is [size * chunk, rest...]: rows i*chunk.. came from rank i. Put the scatter dimension
    # back (now ``chunk`` long), then the rank index right before the gather dimension, and merge.
    out = recv.view(size, chunk, *send.shape[1:]).movedim(1, scatter_dim + 1).movedim(0, gather_dim)
    shape = list(out.shape)
    merged = shape[:gather_dim] + [shape[gather_dim] * shape[gather_dim + 1]] + shape[gather_dim + 2 :]
    return out.reshape(merged)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        return _exchange(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.size), None, None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (of ``size`` ranks): ``x`` split along ``scatter_dim``,
    the pieces received concatenated along ``gather_dim``.

    ``[b, h, s/N, d]`` with ``scatter_dim=1, gather_dim=2`` becomes ``[b, h/N, s, d]`` (sequence- to
    head-sharded); ``[b, s, h/N, d]`` with ``scatter_dim=1, gather_dim=2`` goes back to ``[b, s/N, h, d]``.
    """
    if size == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, size)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Differentiable sum over ``group``; its backward sums the incoming gradients over the group too.

    When every rank back-propagates the summed value, each rank's input receives ``size`` times
    the gradient of one copy: the factor :mod:`hf_zero.sequence.groups` explains.
    """
    if size == 1 or group is None:
        return x
    return _AllReduceSum.apply(x, group)


def all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Non-differentiable all-gather concatenating along ``dim`` in rank order (positions, masks)."""
    if size == 1 or group is None:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
