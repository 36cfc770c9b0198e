"""What an engine hands to checkpoints, consolidation and the model card: one :class:`TrainState`.

Saving, loading, consolidating weights and recording how a model was trained read the same things
of an engine: who writes (the :class:`~hf_zero.checkpoint.ranks.CheckpointLayout`), the module, the
shard groups and torch's optimizer (the ``ShardedOptimizer``), the scheduler, the loss scaler, the
counters, the data position, the device and dtypes, the config. The engine builds this value
(``engine.train_state()``, ``hf_zero/engine/train_state.py``) each time one of them runs, so nothing below the
engine reads the engine itself (``tests/test_layering.py`` checks that no function there takes one).

How a load writes back. The objects the state holds are the engine's own (the module, the shard
groups and optimizer, the scheduler, the loss scaler, the sampler): a load restores into them in
place, as each of them defines (``load_state_dict``, the masters' ranges). The counters are plain
integers, copied into :class:`Progress` when the state is built; a load returns the counters it
read as a new :class:`Progress` and the engine assigns them (``engine.restore_progress``), the one
write into the engine itself, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_zero.checkpoint.ranks import CheckpointLayout

if TYPE_CHECKING:
    from hf_zero.config import ZeroConfig
    from hf_zero.parallel.tensor_parallel import TensorParallelGroups
    from hf_zero.precision.policies import LossScaler
    from hf_zero.zero.optimizer import ShardedOptimizer


@dataclass(frozen=True)
class Progress:
    """The training counters a checkpoint stores and a load restores (DeepSpeed's names).

    ``micro_steps`` counts every ``step()`` call, ``global_steps`` the accumulation boundaries (applied
    or skipped), ``skipped_steps`` those skipped (fp16 overflow, a non-finite norm), ``global_samples``
    the samples seen over the data-parallel ranks.
    """

    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class TrainState:
    """One engine's training state as save, load, consolidation and the model card read it.

    Built by the engine at the moment it is needed (``engine.train_state()``): the counters are a
    snapshot, every object is the engine's own (restored into in place by a load).
    """

    layout: CheckpointLayout
    """Which ranks write a checkpoint together and what this rank stores (a pipeline's stage, tied weights)."""
    module: torch.nn.Module
    """The user's module as trained (a ``PipelineModule``'s stage in a pipeline)."""
    optimizer: ShardedOptimizer | None
    """The shard groups (``.groups``, ``.group_of``, ``.group_names``) and torch's optimizer (``.optimizer``);
    None for an engine built without one."""
    lr_scheduler: Any
    """The scheduler the engine steps, or None."""
    loss_scaler: LossScaler | None
    """fp16's dynamic loss scaler, or None."""
    config: ZeroConfig
    """The parsed config (``.raw``: the user's dict as given, for the model card)."""
    progress: Progress
    """The counters when the state was built."""
    gradient_accumulation_steps: int
    train_batch_size: int
    micro_batch_size: int
    """``train_micro_batch_size_per_gpu``."""
    gradient_clipping: float
    zero_stage: int
    device: torch.device
    compute_dtype: torch.dtype
    group: dist.ProcessGroup | None
    """The group ZeRO shards over (None: the default group), ``world_size`` ranks."""
    world_size: int
    sampler: Any = None
    """The training loader's sampler (the data position), when it has ``state_dict``/``load_state_dict``; else None."""
    tensor_parallel: TensorParallelGroups | None = None
    """The grid's tensor-parallel view, None without tensor parallelism."""

    @property
    def torch_optimizer(self) -> Any:
        """The user's (or the config's) torch optimizer the shard groups step, or None."""
        return self.optimizer.optimizer if self.optimizer is not None else None
