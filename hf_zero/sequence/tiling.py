"""Memory for long sequences beyond attention: the MLP in tiles, block inputs kept in host memory.

**Tiled MLP** (ALST's TiledMLP). A block's MLP widens each token to the intermediate size
(3.5x the hidden size for Llama, and SwiGLU keeps three such tensors for backward), so at long
sequences its activations dominate a block's. Tokens do not interact in the MLP, so it can run
on tiles of the sequence: each tile is a non-reentrant checkpoint, whose intermediates are
dropped as soon as the tile's output exists and recomputed, one tile at a time, in backward.
The peak holds one tile's intermediates instead of the sequence's; the price is one more
forward of the MLP per step. Gradients reach the parameters through autograd as usual (summed
over the tiles before they are accumulated, so ZeRO's gradient hooks fire once per step).

**Offloaded block checkpoints.** With ``activation_checkpointing.checkpoint_blocks`` a block
keeps only its input for the recomputation; with ``cpu_checkpointing`` that input moves to host
memory once the block's forward is done and comes back for its backward. PyTorch's
``save_on_cpu`` cannot do this around a non-reentrant checkpoint (the checkpoint keeps its inputs
itself, outside the saved-tensor hooks), so the input travels in a small holder instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def tiled_mlp_forward(inner: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """``inner(x)`` for ``x`` of shape ``[batch, sequence, ...]``, computed in tiles of ``tile_tokens`` along the sequence."""
    seq = x.shape[1]
    if not torch.is_grad_enabled() or seq <= tile_tokens:
        return inner(x)
    outs = [checkpoint(inner, x[:, lo : lo + tile_tokens], use_reentrant=False) for lo in range(0, seq, tile_tokens)]
    return torch.cat(outs, dim=1)


def find_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The per-block MLPs of a transformers decoder: the ``mlp`` child of each block (``_no_split_modules``)."""
    from hf_zero.zero.units import find_units

    found = []
    for _, block in find_units(model):
        mlp = getattr(block, "mlp", None) or getattr(block, "feed_forward", None)
        if isinstance(mlp, torch.nn.Module):
            found.append(mlp)
    return found


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """Run every block's MLP in tiles of ``tile_tokens`` tokens; returns how many MLPs were tiled.

    The MLP's ``forward`` is wrapped (not its ``__call__``), so hooks on it run once per call.
    A MoE layer (its router sees all tokens at once) is left alone.
    """
    count = 0
    for mlp in find_mlps(model):
        if getattr(mlp, "_hf_zero_tiled", False) or hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            continue
        inner = mlp.forward

        def forward(x: torch.Tensor, *args: Any, _inner: Callable = inner, **kwargs: Any) -> torch.Tensor:
            if args or kwargs or x.dim() < 3:
                return _inner(x, *args, **kwargs)
            return tiled_mlp_forward(_inner, x, tile_tokens)

        mlp.forward = forward
        mlp._hf_zero_tiled = True
        count += 1
    return count


class _HostHolder:
    """A block's input: the tensor itself during forward, a host copy between forward and backward."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x: torch.Tensor | None = x
        self.host: torch.Tensor | None = None
        self.device, self.requires_grad = x.device, x.requires_grad

    def get(self) -> torch.Tensor:
        if self.x is not None:
            return self.x
        assert self.host is not None
        # the recomputation must save what the forward saved, so the copy requires grad as the input did
        return self.host.to(self.device, non_blocking=True).requires_grad_(self.requires_grad)

    def offload(self) -> None:
        x, self.x = self.x, None
        assert x is not None
        if x.device.type == "cpu":
            self.host = x.detach()
            return
        self.host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        self.host.copy_(x.detach(), non_blocking=True)


def _run(holder: _HostHolder, inner: Callable, *args: Any, **kwargs: Any) -> Any:
    return inner(holder.get(), *args, **kwargs)


def checkpoint_offloaded(inner: Callable, *args: Any, _checkpoint_kwargs: dict | None = None, **kwargs: Any) -> Any:
    """``checkpoint(inner, hidden, ...)`` whose kept input ``hidden`` (the first argument, or ``hidden_states=``)
    waits for backward in host memory; a call without a tensor there is a plain checkpoint.
    ``_checkpoint_kwargs`` go to ``torch.utils.checkpoint.checkpoint`` itself (e.g. ``context_fn``)."""
    own = _checkpoint_kwargs or {}
    if args and torch.is_tensor(args[0]):
        hidden, rest = args[0], args[1:]
    elif not args and torch.is_tensor(kwargs.get("hidden_states")):
        hidden, rest = kwargs.pop("hidden_states"), ()
    else:
        return checkpoint(inner, *args, use_reentrant=False, **own, **kwargs)
    holder = _HostHolder(hidden)
    out = checkpoint(_run, holder, inner, *rest, use_reentrant=False, **own, **kwargs)
    holder.offload()
    return out
