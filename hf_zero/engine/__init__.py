"""``ZeroEngine``: DeepSpeed's engine API over the layers below, one concept a module.

- ``zero_engine.py``: :class:`ZeroEngine` itself, the step (``forward``, ``backward``, ``step``), its set-up
  and ``destroy``;
- ``surface.py``: ``DeepSpeedSurface``, DeepSpeed's getters (``train_batch_size``, ``zero_optimization_stage``,
  ``get_lr``, ...), its names for saves and loads, and the fall-through to the wrapped module's attributes;
- ``train_state.py``: ``TrainStateSource``, the ``TrainState`` the engine hands to checkpoints and the counters
  a load gives back;
- ``persistence.py``: ``Persistence``, the collaborator that saves and loads (resume checkpoints, 16-bit and
  Hugging Face weights, the Hub) and owns the background write;
- ``long_runs.py``: ``LongRuns``, the collaborator that watches for preemption and saves before the exit;
- ``zero_setup.py``: the ZeRO optimizer built from the config, once.

``hf_zero.engine.ZeroEngine`` and the error classes once defined here keep their import paths.
"""

from hf_zero.engine.zero_engine import ZeroEngine
from hf_zero.errors import CheckpointError, ConfigError, NoSyncAtStage3Error, StepInNoSyncError, UsageError

__all__ = ["CheckpointError", "ConfigError", "NoSyncAtStage3Error", "StepInNoSyncError", "UsageError", "ZeroEngine"]
