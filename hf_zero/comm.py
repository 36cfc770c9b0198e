"""DeepSpeed's module path ``deepspeed.comm``: re-exports hf_zero.distributed.comm's collective API.

Scripts written for DeepSpeed do ``import deepspeed.comm as dist``; the functions (torch.distributed's, with
DeepSpeed's single-process answers for ``get_rank`` and the like) live in :mod:`hf_zero.distributed.comm`, and
any other name falls through to it, so that ``torch.distributed``'s names resolve here as they do there.
"""

from __future__ import annotations

from typing import Any

from hf_zero.distributed import comm as _comm
from hf_zero.distributed.comm import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    destroy_process_group,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter_tensor,
    send,
)

__all__ = [
    "ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank",
    "get_global_rank", "barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "broadcast", "reduce", "send", "recv", "isend", "irecv", "new_group", "destroy_process_group", "get_all_ranks_from_group",
]


def __getattr__(name: str) -> Any:
    """Every other name is :mod:`hf_zero.distributed.comm`'s (torch.distributed's own, or its AttributeError)."""
    return getattr(_comm, name)
