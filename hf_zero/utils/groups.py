"""DeepSpeed's module path ``deepspeed.utils.groups``: holds the process groups of the engine ``initialize`` built last.

DeepSpeed keeps its groups in module globals that ``initialize`` sets; transformers' and Accelerate's
sequence-parallel code (``_get_sequence_parallel_group``, ``_world_size``, ``_rank``) and scripts
(``_get_data_parallel_world_size``, ...) read them from here. hf_zero's groups belong to the engine
(``engine.group``, ``engine.sequence_parallel_groups``, ``engine.tensor_parallel_groups``), so these
functions answer for the engine ``initialize`` returned last (:func:`hf_zero.api.latest_engine`), and
before any engine for the whole world, as DeepSpeed answers without a model-parallel unit:

- data parallel: the ranks that see different samples (the world; under sequence or tensor
  parallelism the ranks at the same place of their sp or tp groups);
- sequence parallel: the ranks that share a sample's tokens; without it the world size is 1, the
  rank 0, and asking for the group raises ``KeyError`` as DeepSpeed's does;
- sequence-data parallel: the ranks ZeRO shards over (DeepSpeed's name for dp x sp);
- tensor (model) parallel: ``tensor_parallel.autotp_size``'s groups; without it a degree of 1.

Expert (MoE) groups do not exist in hf_zero: asking for one says so.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hf_zero.api import latest_engine
from hf_zero.errors import UsageError
from hf_zero.parallel import DATA_AXES

__all__ = [
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size", "get_model_parallel_group",
    "get_model_parallel_rank", "get_model_parallel_world_size", "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_world_size",
]


def _need_dist() -> None:
    if not dist.is_initialized():
        raise UsageError("deepspeed.utils.groups needs torch.distributed initialised; call hf_zero.init_distributed() "
                         "or hf_zero.initialize() first")


def _world(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A process group object (hf_zero's None means the world, DeepSpeed hands back a group)."""
    return group if group is not None else dist.group.WORLD


def _grid() -> Any:
    """The grid (``hf_zero/parallel/grid.py``) of the engine built last, or None before any."""
    engine = latest_engine()
    return getattr(engine, "grid", None) if engine is not None else None


def _sp() -> Any:
    engine = latest_engine()
    sp = getattr(engine, "sequence_parallel_groups", None) if engine is not None else None
    return sp if sp is not None and sp.sp_size > 1 else None


def _tp() -> Any:
    engine = latest_engine()
    return getattr(engine, "tensor_parallel_groups", None) if engine is not None else None


# ------------------------------------------------------------------ data parallel


def _get_data_parallel_group() -> dist.ProcessGroup:
    """The group of ranks that see different samples: the grid's data-parallel axes."""
    _need_dist()
    grid = _grid()
    return _world(grid.group(*DATA_AXES) if grid is not None else None)


def _get_data_parallel_world_size() -> int:
    _need_dist()
    grid = _grid()
    return grid.dp_size if grid is not None else dist.get_world_size()


def _get_data_parallel_rank() -> int:
    _need_dist()
    grid = _grid()
    return grid.dp_rank if grid is not None else dist.get_rank()


def _get_data_parallel_group_ranks() -> list[int]:
    _need_dist()
    grid = _grid()
    return list(grid.ranks(*DATA_AXES)) if grid is not None else list(range(dist.get_world_size()))


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# ------------------------------------------------------------------ sequence parallel


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    sp = _sp()
    if sp is None:
        raise KeyError("No sequence parallel group found")  # DeepSpeed's words, and its exception
    return sp.sp_group


def _get_sequence_parallel_world_size() -> int:
    _need_dist()
    sp = _sp()
    return sp.sp_size if sp is not None else 1


def _get_sequence_parallel_rank() -> int:
    sp = _sp()
    return sp.sp_rank if sp is not None else 0


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    """The ranks ZeRO shards over: the grid's ZeRO group (dp x sp)."""
    _need_dist()
    grid = _grid()
    return _world(grid.zero_group if grid is not None else None)


def _get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(_get_sequence_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    """The global rank of the first rank of the sequence-data-parallel group."""
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


# ------------------------------------------------------------------ tensor (model) parallel


def get_tensor_model_parallel_world_size() -> int:
    tp = _tp()
    return tp.tp_size if tp is not None else 1


def get_tensor_model_parallel_rank() -> int:
    tp = _tp()
    return tp.tp_rank if tp is not None else 0


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    _need_dist()
    tp = _tp()
    if tp is None or tp.tp_group is None:
        raise AssertionError("intra_layer_model parallel group is not initialized")  # DeepSpeed's assertion
    return tp.tp_group


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    tp = _tp()
    return tp.tp_ranks[0] if tp is not None else dist.get_rank()


get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_group = get_tensor_model_parallel_group


def _get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def __getattr__(name: str) -> Any:
    if "expert" in name:
        raise AttributeError(f"deepspeed.utils.groups.{name}: hf_zero has no mixture-of-experts (expert parallel) groups")
    raise AttributeError(f"module 'hf_zero.utils.groups' has no attribute {name!r} (DeepSpeed's groups that hf_zero "
                         "answers are the data, sequence, sequence-data and tensor parallel ones)")
