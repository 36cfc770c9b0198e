"""Sending each (token, expert) pair to the rank that holds its expert, and the result back.

One MoE layer's forward on a rank of an EP group of ``P`` ranks, each holding ``L`` experts:

1. the pairs (``T`` tokens x top ``K``) are sorted by expert, which also sorts them by the rank holding it;
2. the ranks exchange how many pairs each sends to each of the other's experts (one all-to-all of ``P x L``
   counts), so the splits of the next exchanges may be uneven (a rank may send nothing to another, or receive
   nothing at all) and each received row's local expert follows from the counts;
3. the pairs' hidden states go to the owners (one all-to-all);
4. the owner runs its local experts on what it received, each row with routing weight 1, through the model's own
   experts code (or transformers' grouped GEMM), so biases and activations are the model's;
5. the results come back (the reverse all-to-all) and are combined with the routing weights on the token's rank,
   as the model combines them.

Every rank takes part in every exchange whatever it routes, in forward and in backward: the two differentiable
exchanges (:class:`_AllToAll`, whose backward is the reverse exchange) hang on a requires-grad anchor, and a rank that
received no pair still ties its (empty) result to its experts' weights, so each rank's backward runs the same
collectives in the same order and gives its experts a gradient (zero) at the same point (ZeRO's buckets then fill
in the same order on every rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor | None, send: list[int], recv: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        del anchor  # only makes autograd record this exchange on every rank
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                     local_experts: int, group: dist.ProcessGroup, group_size: int, run_local: LocalExperts,
                     weights: list[torch.Tensor]) -> torch.Tensor:
    """The MoE layer's routed output for ``hidden`` ``[T, H]``, its experts spread over ``group`` (see the module doc).

    ``top_k_index`` / ``top_k_weights`` ``[T, K]`` are the router's global expert indices and weights;
    ``run_local(x, index, weight)`` runs this rank's experts the model's way (``index`` local, ``[R, 1]``);
    ``weights`` are those experts' parameters, tied into the graph when this rank receives no pair.
    """
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, hence by owner; stable: a token's pairs keep their order
    expert = flat[order]
    # pairs per expert, sent to the experts' owners: each rank learns how many rows of each of its experts every
    # rank sends, so the rows' local expert indices follow from the counts (the rows arrive sorted by expert)
    per_expert = torch.bincount(expert, minlength=group_size * local_experts)
    recv_per_expert = torch.empty_like(per_expert)
    dist.all_to_all_single(recv_per_expert, per_expert, group=group)
    send, recv = torch.stack([per_expert.view(group_size, local_experts).sum(1),
                              recv_per_expert.view(group_size, local_experts).sum(1)]).tolist()  # the one host sync
    anchor = None
    if torch.is_grad_enabled():
        anchor = torch.zeros(0, device=hidden.device, requires_grad=True)
    x_recv = _AllToAll.apply(hidden[torch.div(order, k, rounding_mode="floor")], anchor, send, recv, group)
    local_ids = torch.repeat_interleave(torch.arange(local_experts, device=expert.device).repeat(group_size),
                                        recv_per_expert, output_size=sum(recv)).unsqueeze(-1)
    if x_recv.shape[0] > 0:
        ones = torch.ones(x_recv.shape[0], 1, dtype=top_k_weights.dtype, device=x_recv.device)
        y_recv = run_local(x_recv, local_ids, ones).to(hidden.dtype)
    else:  # nothing to run: an empty result that still leads back to the inputs and to the experts' weights
        y_recv = x_recv * 0
        if torch.is_grad_enabled():
            y_recv = y_recv + sum(w.sum() for w in weights if w.requires_grad) * 0
    y = _AllToAll.apply(y_recv, anchor, recv, send, group)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    pairs = y[back].view(tokens, k, hidden.shape[-1])  # the pairs in the router's order again
    # each weighted result in the hidden dtype before the sum, as the model's index_add_ adds them
    return (pairs * top_k_weights.unsqueeze(-1)).to(hidden.dtype).sum(dim=1)
