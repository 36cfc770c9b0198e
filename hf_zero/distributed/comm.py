"""DeepSpeed's collective API (what ``deepspeed.comm`` answers, through :mod:`hf_zero.comm`), which mirrors
``torch.distributed``.

Scripts written for DeepSpeed do ``import deepspeed.comm as dist`` and call ``dist.get_rank()``,
``dist.all_reduce(t)``, ``dist.barrier()`` and so on with torch's signatures; DeepSpeed forwards
them to ``torch.distributed``, and so does this module. ``init_distributed`` is hf_zero's (the
same one ``initialize`` calls), and ``get_local_rank`` reads the launcher's ``LOCAL_RANK``. Any
other ``torch.distributed`` name resolves to torch's own function.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as _td
from torch.distributed import ReduceOp

from hf_zero.distributed.dist import init_distributed

__all__ = [
    "ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank",
    "get_global_rank", "barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "broadcast", "reduce", "send", "recv", "isend", "irecv", "new_group", "destroy_process_group", "get_all_ranks_from_group",
]

is_initialized = _td.is_initialized
is_available = _td.is_available
barrier = _td.barrier
all_reduce = _td.all_reduce
all_gather = _td.all_gather
all_gather_into_tensor = _td.all_gather_into_tensor
reduce_scatter_tensor = _td.reduce_scatter_tensor
broadcast = _td.broadcast
reduce = _td.reduce
send, recv, isend, irecv = _td.send, _td.recv, _td.isend, _td.irecv
new_group = _td.new_group
destroy_process_group = _td.destroy_process_group
get_global_rank = _td.get_global_rank


def get_rank(group: Any = None) -> int:
    """This process's rank (0 before the process group exists, as DeepSpeed's single-process runs expect)."""
    return _td.get_rank(group) if _td.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks (1 before the process group exists)."""
    return _td.get_world_size(group) if _td.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its machine, from the launcher's ``LOCAL_RANK`` (0 when launched without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks in ``group`` (every rank for None), in the group's rank order."""
    if group is None:
        return list(range(get_world_size()))
    return [_td.get_global_rank(group, r) for r in range(_td.get_world_size(group))]


def __getattr__(name: str) -> Any:
    """Other ``torch.distributed`` names (``all_to_all_single``, ``get_backend``, ...) are torch's own."""
    if hasattr(_td, name):
        return getattr(_td, name)
    raise AttributeError(f"hf_zero.comm has no {name!r} (neither DeepSpeed's comm API as hf_zero provides it nor torch.distributed has it)")
