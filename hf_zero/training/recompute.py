"""Activation checkpointing (recomputing activations in backward), at DeepSpeed's path ``deepspeed.checkpointing``.

Not to be confused with resume checkpoints (:mod:`hf_zero.checkpoint`): this module trades
compute for activation memory. Two ways in: the engine's ``"activation_checkpointing":
{"checkpoint_blocks": true}`` (:func:`checkpoint_blocks`, no model code touched), and DeepSpeed's
API called from the user's model code (:func:`checkpoint`, :func:`configure`).

Megatron-style models call ``deepspeed.checkpointing.checkpoint(block, hidden, mask)`` inside
their forward to recompute a block in backward instead of storing its activations, after
``deepspeed.checkpointing.configure(None, deepspeed_config=...)``. Here that is PyTorch's
non-reentrant ``torch.utils.checkpoint`` (the RNG state is restored for the recomputation, so
dropout draws the same masks). Of the config's ``activation_checkpointing`` options,
``cpu_checkpointing`` keeps the checkpointed input (the first argument) in host memory until backward
and ``synchronize_checkpoint_boundary`` synchronizes the device around each checkpoint;
``partition_activations`` splits checkpoints across model-parallel ranks, of which hf_zero has
none, so there is nothing to split. For whole transformers blocks without touching model code,
``"activation_checkpointing": {"checkpoint_blocks": true}`` in the engine config does the same.
A pipeline's ``activation_checkpoint_interval`` is :class:`hf_zero.pipe.PipelineModule`'s.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from hf_zero.errors import UsageError
from hf_zero.zero.units import find_units, is_lookup

__all__ = ["checkpoint", "checkpoint_blocks", "non_reentrant_checkpoint", "configure", "is_configured", "reset"]

logger = logging.getLogger("hf_zero")

_OPTIONS = {"partition_activations": False, "cpu_checkpointing": False, "synchronize_checkpoint_boundary": False,
            "contiguous_memory_optimization": False, "number_checkpoints": None, "profile": False}
_state: dict[str, Any] = {"configured": False, **_OPTIONS}


def _section(deepspeed_config: Any) -> dict:
    """The ``activation_checkpointing`` section of a config given as a path, a dict or a loaded config."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f)
    if isinstance(deepspeed_config, dict):
        section = deepspeed_config.get("activation_checkpointing", {})
    else:
        section = getattr(deepspeed_config, "activation_checkpointing", {})
    if not isinstance(section, dict):
        raise UsageError(f"activation_checkpointing: got {section!r}, expected an object of options")
    return section


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the options of :func:`checkpoint` from a config's ``activation_checkpointing`` section and/or arguments."""
    if mpu_ is not None:
        raise UsageError("checkpointing.configure(mpu_=...): model parallelism is not supported by hf_zero; pass None")
    opts = dict(_OPTIONS)
    for key, value in _section(deepspeed_config).items():
        if key in opts:
            opts[key] = value
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    opts.update({k: v for k, v in given.items() if v is not None})
    if opts["profile"]:
        raise UsageError("activation_checkpointing.profile: got true, but hf_zero does not time checkpoints; use torch.profiler")
    if opts["contiguous_memory_optimization"]:
        logger.warning("activation_checkpointing.contiguous_memory_optimization has no effect in hf_zero: "
                       "PyTorch's caching allocator reuses the checkpoint buffers")
    _state.update(opts, configured=True)


def is_configured() -> bool:
    return bool(_state["configured"])


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; hf_zero keeps none, so only the options stay."""


def checkpoint(function: Callable, *args: Any) -> Any:
    """``function(*args)``, with its activations recomputed in backward instead of stored."""
    sync = _state["synchronize_checkpoint_boundary"] and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    if _state["cpu_checkpointing"]:
        # save_on_cpu around a non-reentrant checkpoint moves nothing (the checkpoint keeps its inputs
        # itself); the first argument, the hidden states, goes to host memory through a holder instead
        from hf_zero.sequence.tiling import checkpoint_offloaded

        out = checkpoint_offloaded(function, *args)
    else:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    if sync:
        torch.cuda.synchronize()
    return out


non_reentrant_checkpoint = checkpoint


# Attention kernels whose outputs a checkpointed block may keep (see keep_attention in checkpoint_blocks).
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
KEEP_ATTENTION_FRACTION = 0.15  # "auto": keep when all blocks' kept outputs fit in this share of the GPU's memory


def attention_ops() -> list[Any]:
    """The attention kernel ops of this torch (SDPA's fused kernels, and flash-attn's when it is installed)."""
    ops = [getattr(torch.ops.aten, name).default for name in _ATTENTION_OPS if hasattr(torch.ops.aten, name)]
    flash = getattr(torch.ops, "flash_attn", None)
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        try:
            ops.append(getattr(flash, name).default)
        except (AttributeError, RuntimeError):
            pass
    return ops


def _keeps_attention(keep: bool | str, hidden: Any, blocks: int) -> bool:
    """Whether a block forward on ``hidden`` keeps its attention outputs.

    A block's attention output has as many elements as its input hidden states (heads × head size =
    hidden size; under Ulysses the sequence is whole and the heads split, the same count), so all
    blocks keep about ``blocks × hidden.nbytes``. "auto" keeps them on a GPU when that is at most
    :data:`KEEP_ATTENTION_FRACTION` of its memory, and never on a CPU.
    """
    if keep != "auto":
        return bool(keep)
    if not torch.is_tensor(hidden) or hidden.device.type != "cuda":
        return False
    total = torch.cuda.get_device_properties(hidden.device).total_memory
    return blocks * hidden.numel() * hidden.element_size() <= KEEP_ATTENTION_FRACTION * total


def checkpoint_blocks(module: torch.nn.Module, offload: bool = False, keep_attention: bool | str = "auto") -> int:
    """Recompute each block's forward in backward instead of keeping its activations; returns how many blocks.

    The blocks are stage 3's units (a transformers model's decoder layers). Each block's
    ``forward`` (not its ``__call__``) is wrapped, so stage 3's hooks run once per call as usual
    and the recomputation happens while backward has the block gathered; non-reentrant
    ``torch.utils.checkpoint``, so the numbers are unchanged. ``offload`` (DeepSpeed's
    ``cpu_checkpointing``) keeps the block input saved for the recomputation in host memory.

    ``keep_attention`` keeps what the attention kernel returned (its output and log-sum-exp) through
    the recomputation instead of running the kernel again (selective activation checkpointing): at
    long sequences attention is most of a block's time, and its forward is then run once per step
    instead of twice, for one hidden-state-sized tensor per block (see :func:`_keeps_attention` for "auto").
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from hf_zero.sequence.tiling import checkpoint_offloaded

    # An embedding lookup is left as it is: its forward saves only the ids, so recomputing it saves nothing, and
    # stage 3 does not gather it for backward (is_lookup), so a recomputation would read a released weight (a model
    # whose units are its top-level children has one among them).
    blocks = [block for _, block in find_units(module) if not is_lookup(block)]
    keep_ops = attention_ops() if keep_attention else []
    saving = functools.partial(create_selective_checkpoint_contexts, keep_ops) if keep_ops else None
    for block in blocks:
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, _block: torch.nn.Module = block, **kwargs: Any) -> Any:
            if _block.training and torch.is_grad_enabled():
                hidden = args[0] if args else kwargs.get("hidden_states")
                extra = {"context_fn": saving} if saving and _keeps_attention(keep_attention, hidden, len(blocks)) else {}
                if offload:
                    return checkpoint_offloaded(_inner, *args, _checkpoint_kwargs=extra, **kwargs)
                return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)
            return _inner(*args, **kwargs)

        block.forward = forward
    return len(blocks)


def __getattr__(name: str) -> Any:
    if name in ("model_parallel_cuda_manual_seed", "get_cuda_rng_tracker", "CheckpointFunction", "model_parallel_reconfigure_tp_seed"):
        raise AttributeError(
            f"hf_zero.checkpointing.{name} belongs to model parallelism, which hf_zero does not support; "
            "use hf_zero.checkpointing.checkpoint and torch.manual_seed"
        )
    raise AttributeError(f"module 'hf_zero.checkpointing' has no attribute {name!r}")
