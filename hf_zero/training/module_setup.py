"""Putting the user's module where an engine trains it: checked, on the device, from rank 0's weights.

These run once, in ``ZeroEngine.__init__``, before ZeRO lays the parameters out. A model built
under ``zero.Init`` arrives as per-rank slices (:mod:`hf_zero.zero.preshard`): it must be trained
on the ranks that built it, its slices are never moved or broadcast (they are consistent by
construction), and only stage 3 with an optimizer keeps them as slices.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hf_zero.errors import UsageError
from hf_zero.zero import collectives as C
from hf_zero.zero import param_attrs
from hf_zero.zero.group import subgroup_of
from hf_zero.zero.preshard import is_presharded, materialize_

logger = logging.getLogger("hf_zero")


def check_presharded(model: torch.nn.Module, world_size: int, device: torch.device, gather: bool) -> bool:
    """Whether ``model`` was built under ``zero.Init``; refuses another world size; ``gather`` makes it whole."""
    pre = [p for p in model.parameters() if is_presharded(p)]
    if not pre:
        return False
    built = pre[0].hf_zero_preshard.world_size
    if built != world_size:
        raise UsageError(
            f"the model was built under hf_zero.zero.Init on {built} ranks but the engine runs on "
            f"{world_size}; build it with the same data-parallel group as initialize()"
        )
    if gather:  # stages 0-2 need whole parameters
        materialize_(pre, device)
        for p in pre:  # whole from now on: nothing for DeepSpeed's ZeRO-3 readers to see
            param_attrs.clear(p)
    return True


def move_to_device(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to(device)``, leaving parameters that only exist as ``zero.Init`` slices alone."""
    if not any(is_presharded(p) for p in module.parameters()):
        module.to(device)
        return
    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and not is_presharded(p) and p.device != device:
                    p.data = p.data.to(device)
            for key, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[key] = b.to(device)


def broadcast_module(module: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Start every rank of ``group`` from its first rank's weights and buffers, as DeepSpeed does."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            sub = subgroup_of(t)
            if sub is not None:  # an expert's weights: only the ranks holding the same experts start alike
                sub_world = dist.get_world_size(sub.group)
                sub_src = dist.get_global_rank(sub.group, 0) if sub.group is not None else 0
                C.broadcast_(t.data, sub_src, sub.group, sub_world)
            elif not is_presharded(t):
                C.broadcast_(t.data, src, group, world)


def cast_frozen_params(module: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Frozen floating parameters follow the compute dtype too (ZeRO casts the trainable ones)."""
    if compute_dtype == torch.float32:
        return
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != compute_dtype:
                p.data = p.data.to(compute_dtype)


def no_kv_cache_in_training(module: torch.nn.Module, why: str) -> None:
    """Turn a transformers model's ``config.use_cache`` off, as transformers does under gradient checkpointing.

    A KV cache filled while training is dead weight; its writes inside a recomputed block stop
    torch.compile from capturing the block, and its per-layer index makes dynamo compile each
    block separately (past ``torch._dynamo.config.cache_size_limit`` blocks, silently eager).
    ``generate`` passes ``use_cache`` itself, so decoding still caches. ``why``: the setting that asked, for the log.
    """
    mc = getattr(module, "config", None)
    if getattr(mc, "use_cache", False):
        logger.info("%s: setting the model's config.use_cache to False", why)
        mc.use_cache = False
