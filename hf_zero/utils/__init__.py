"""DeepSpeed's module path ``deepspeed.utils``: its logger, ``log_dist``, ``zero_to_fp32``, ``groups``, ``RepeatingLoader``
and the per-parameter accessors ``safe_get_full_fp32_param`` and the like (``hf_zero/zero/accessors.py``).

``set_z3_leaf_modules`` and ``OnDevice`` are not here yet; asking for one says so instead of failing with a
bare AttributeError.
"""

from __future__ import annotations

import logging
from typing import Any

from hf_zero.training.data import RepeatingLoader
from hf_zero.utils import groups, zero_to_fp32
from hf_zero.zero.accessors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

__all__ = [
    "logger", "log_dist", "zero_to_fp32", "groups", "RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
    "safe_set_local_grad", "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized",
]

logger = logging.getLogger("hf_zero")

_NOT_YET = ("set_z3_leaf_modules", "OnDevice")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks only (all ranks for ``[-1]``; rank 0 when ``ranks`` is None)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    wanted = [0] if ranks is None else ranks
    if -1 in wanted or rank in wanted:
        logger.log(level, "[Rank %d] %s", rank, message)


def __getattr__(name: str) -> Any:
    if name in _NOT_YET:
        raise AttributeError(f"hf_zero.utils.{name} (DeepSpeed's deepspeed.utils.{name}) is not supported by hf_zero yet")
    raise AttributeError(f"module 'hf_zero.utils' has no attribute {name!r}")
