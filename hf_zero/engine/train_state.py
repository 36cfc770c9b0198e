"""What an engine hands below itself: its ``TrainState`` (``hf_zero/checkpoint/state.py``) and the counters back.

Checkpoints, consolidated weights, the model card and the integrations never see the engine; they read one
value, the :class:`~hf_zero.checkpoint.state.TrainState` built here each time one of them runs, and a load's
counters come back through :meth:`TrainStateSource.restore_progress`, the one write into the engine.
:class:`TrainStateSource` is a base class of ``ZeroEngine`` that only reads what the engine set up; a
``PipelineEngine`` changes what its layout leaves to other stages (``_stored_elsewhere``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from hf_zero.checkpoint.ranks import CheckpointLayout
from hf_zero.checkpoint.state import Progress, TrainState
from hf_zero.errors import UsageError
from hf_zero.parallel.tp_split import split_of

if TYPE_CHECKING:
    from hf_zero.config import ZeroConfig
    from hf_zero.parallel import ParallelGrid
    from hf_zero.parallel.tensor_parallel import TensorParallelGroups
    from hf_zero.precision.policies import LossScaler
    from hf_zero.zero.optimizer import ShardedOptimizer


class TrainStateSource:
    """The engine's side of saves and loads: :meth:`train_state`, :meth:`checkpoint_layout`,
    :meth:`restore_progress`, :meth:`resident_state`."""

    # What the engine sets in its __init__ (hf_zero/engine/zero_engine.py) and its base DeepSpeedSurface answers.
    module: torch.nn.Module
    config: ZeroConfig
    grid: ParallelGrid | None
    group: Any
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    loss_scaler: LossScaler | None
    zero_optimizer: ShardedOptimizer | None
    lr_scheduler: Any
    training_dataloader: Any
    tensor_parallel_groups: TensorParallelGroups | None
    global_steps: int
    micro_steps: int
    global_samples: int
    skipped_steps: int
    _destroyed: bool

    if TYPE_CHECKING:  # DeepSpeedSurface's, ahead of this class in the engine's bases

        def gradient_accumulation_steps(self) -> int: ...
        def train_batch_size(self) -> int: ...
        def train_micro_batch_size_per_gpu(self) -> int: ...
        def gradient_clipping(self) -> float: ...
        def zero_optimization_stage(self) -> int: ...

    def resident_state(self) -> contextlib.AbstractContextManager[None]:
        """The optimizer's masters, state and offloaded shards in host memory for the block: what a save or a load
        that reads them outside ``save_checkpoint`` / ``load_checkpoint`` (which use it) needs under NVMe offload,
        where they wait in files between steps (``hf_zero/zero/nvme.py``). Collective; nothing to do otherwise."""
        zo = self.zero_optimizer
        return zo.resident() if zo is not None else contextlib.nullcontext()

    def train_state(self) -> TrainState:
        """What checkpoints, consolidated weights and the model card read of this engine, as of now.

        The objects are the engine's own (a load restores into them in place); the counters are a copy,
        which a load hands back as a :class:`Progress` for :meth:`restore_progress` (``hf_zero/checkpoint/state.py``).
        """
        if self._destroyed:
            raise UsageError("engine.destroy() was called on this engine; save before destroying it")
        return TrainState(
            layout=self.checkpoint_layout(), module=self.module, optimizer=self.zero_optimizer,
            lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler, config=self.config,
            progress=Progress(self.global_steps, self.micro_steps, self.global_samples, self.skipped_steps),
            gradient_accumulation_steps=self.gradient_accumulation_steps(), train_batch_size=self.train_batch_size(),
            micro_batch_size=self.train_micro_batch_size_per_gpu(), gradient_clipping=self.gradient_clipping(),
            zero_stage=self.zero_optimization_stage(), device=self.device, compute_dtype=self.compute_dtype,
            group=self.group, world_size=self.world_size,
            sampler=getattr(self.training_dataloader, "sampler", None), tensor_parallel=self.tensor_parallel_groups,
        )

    def restore_progress(self, progress: Progress | None) -> None:
        """Take the counters a checkpoint load read (None: a load of the module only, which leaves them)."""
        if progress is not None:
            self.global_steps, self.micro_steps = progress.global_steps, progress.micro_steps
            self.global_samples, self.skipped_steps = progress.global_samples, progress.skipped_steps

    def checkpoint_layout(self) -> CheckpointLayout:
        """Which ranks write a checkpoint of this engine together: the whole grid. The ZeRO group's ranks store their
        shards (its first, what is replicated; under hybrid sharding the first replica's ranks only); a tensor-parallel rank its own slices and, at ``tp`` rank 0, the
        whole parameters; a pipeline stage its layers, a tied weight at its first stage only."""
        g = self.grid
        others = set(self._stored_elsewhere())
        if g.rank("tp"):
            others |= {id(p) for p in self.module.parameters() if split_of(p) is None}
        pp = g.size("pp")
        return CheckpointLayout(None, g.global_rank, g.size(), g.zero_rank, pipe_stage=g.pipe_stage if pp > 1 else None,
                                num_stages=pp if pp > 1 else None, dp=g.zero_size, others=others, tp_rank=g.rank("tp"),
                                replica=g.replicate_rank)

    def _stored_elsewhere(self) -> set[int]:
        """Parameters (by id) another rank of the grid stores in checkpoints (a pipeline's tied weights at later stages)."""
        return set()
