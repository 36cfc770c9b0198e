"""The causal-LM loss of a sequence shard: tiled so full-length logits never exist, and averaged
over the whole sequence-parallel group.

**Tiles.** transformers computes ``logits = lm_head(hidden)`` for every position and upcasts them
to fp32 for the cross-entropy: at 32k tokens and a 128k vocabulary that is 16 GB for one sample.
:func:`fused_linear_cross_entropy` walks the sequence in tiles; for each tile it computes the
logits, the summed loss of its targets and, right away, the tile's gradients with respect to the
hidden states and the LM head (``softmax - onehot`` times the head, and its transpose times the
hidden states), then drops the logits. Backward only scales those gradients by the incoming
gradient (a scalar: any function of the loss is linear at that point). That is the same
arithmetic as the unfused path, in the same dtypes, with no recomputation, and the largest
temporary is one tile of fp32 logits; what it keeps from forward to backward is a gradient the
size of the hidden states (the unfused path keeps the hidden states themselves for the head's
backward) and one the size of the head.

**The mean over the group.** Each sp rank holds ``1/sp`` of a sample's targets, and some shards
may hold none (prompt tokens masked with ``-100``). The loss is the sum of the token losses over
the group divided by the number of targets over the group, not a mean of shard means.
:func:`sequence_parallel_mean` all-reduces ``[sum, count]`` once; the sum goes through a
differentiable all-reduce, so every rank holds the group's loss and back-propagates it, which
hands each rank ``sp/count`` per unit of its own sum: the factor that the engine's average over
all ``dp x sp`` ranks divides out again (see :mod:`hf_zero.sequence.groups`).
"""

from __future__ import annotations

import torch

from hf_zero.sequence.batch import IGNORE_INDEX
from hf_zero.sequence.comm import all_reduce_sum
from hf_zero.sequence.groups import SequenceParallelGroups

TILE_BYTES = 1 << 30  # one tile of fp32 logits: 1 GiB, as DeepSpeed's ALST sizes its loss shards


def auto_tile_tokens(vocab_size: int) -> int:
    """Tokens per loss tile so that one tile of fp32 logits is about :data:`TILE_BYTES`."""
    return max(1, TILE_BYTES // (4 * max(1, vocab_size)))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,  # type: ignore[override]
                tile: int, ignore_index: int) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None
        for lo in range(0, hidden.shape[0], tile):
            h, y = hidden[lo : lo + tile], targets[lo : lo + tile]
            logits = torch.nn.functional.linear(h, weight, bias).float()
            valid = y != ignore_index
            safe = torch.where(valid, y, torch.zeros_like(y))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            # d(sum of losses)/d(logits) = softmax - onehot on the targeted rows, 0 on ignored ones
            g = logits.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
            g.mul_(valid[:, None])
            g = g.to(hidden.dtype)
            if grad_h is not None:
                grad_h[lo : lo + tile] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).float()
            if grad_b is not None:
                grad_b += g.float().sum(0)
            del g, logits
        ctx.save_for_backward(
            *(t.to(dtype) if t is not None else None for t, dtype in ((grad_h, hidden.dtype), (grad_w, weight.dtype),
                                                                      (grad_b, bias.dtype if bias is not None else None)))
        )
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = lambda t: None if t is None else t * grad_out.to(t.dtype)  # noqa: E731
        return scale(grad_h), scale(grad_w), scale(grad_b), None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, *,
    tile_tokens: int | None = None, ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of targets)`` of ``linear(hidden, weight, bias)`` against ``targets``, in tiles.

    ``hidden`` is ``[..., H]`` and ``targets`` the matching ``[...]`` (already shifted; ``ignore_index``
    marks positions without a target). The sum is fp32; its gradients reach ``hidden``, ``weight``
    and ``bias`` as the unfused ``cross_entropy(linear(...).float(), reduction="sum")`` would send them.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"fused_linear_cross_entropy: {h.shape[0]} hidden positions but {y.shape[0]} targets")
    tile = int(tile_tokens) if tile_tokens else auto_tile_tokens(weight.shape[0])
    total = _FusedLinearCrossEntropy.apply(h, weight, bias, y, max(1, tile), ignore_index)
    return total, (y != ignore_index).sum()


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of targets)`` from full logits (fp32), as transformers' loss computes them."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    y = targets.reshape(-1).to(flat.device)
    total = torch.nn.functional.cross_entropy(flat, y, ignore_index=ignore_index, reduction="sum")
    return total, (y != ignore_index).sum()


def sequence_parallel_mean(
    total: torch.Tensor, count: torch.Tensor, groups: SequenceParallelGroups | None, num_items_in_batch: object = None,
) -> torch.Tensor:
    """The loss of the whole sample group: summed token losses over summed targets across the sp group.

    ``num_items_in_batch`` (transformers' gradient-accumulation normaliser), when given, replaces
    the count. A group without a single target gives 0 (and zero gradients), not nan.
    """
    on = groups is not None and groups.enabled
    if on:
        both = torch.stack([total.float(), count.to(total.device, torch.float32)])
        both = all_reduce_sum(both, groups.sp_group, groups.sp_size)
        total, count = both[0], both[1].detach()
    if num_items_in_batch is not None:
        denom = num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        return total / denom
    return total / count.to(total.device, torch.float32).clamp(min=1)
