"""DeepSpeed's module path ``deepspeed.checkpointing``: re-exports hf_zero.training.recompute's names.

The implementation lives in :mod:`hf_zero.training.recompute`; this path exists so that ``import hf_zero as deepspeed``
scripts find ``deepspeed.checkpointing.checkpoint`` and ``configure`` where DeepSpeed puts them. (Resume
checkpoints are :mod:`hf_zero.checkpoint`, a different thing.)
"""

from __future__ import annotations

from typing import Any

from hf_zero.training import recompute
from hf_zero.training.recompute import (
    checkpoint,
    checkpoint_blocks,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["checkpoint", "checkpoint_blocks", "non_reentrant_checkpoint", "configure", "is_configured", "reset"]


def __getattr__(name: str) -> Any:
    return getattr(recompute, name)  # recompute's own __getattr__ explains the model-parallel names it lacks
