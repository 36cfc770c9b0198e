"""Checkpoints: reshardable resume state and Hugging Face weights.

- :mod:`~hf_zero.checkpoint.format`: the resume checkpoint's on-disk format and a reader (public);
- :mod:`~hf_zero.checkpoint.save` / :mod:`~hf_zero.checkpoint.load`: writing and restoring it
  (collective), with :mod:`~hf_zero.checkpoint.ranks` (who stores what, agreement across ranks),
  :mod:`~hf_zero.checkpoint.atomic` (whole or not at all, rotation) and
  :mod:`~hf_zero.checkpoint.optim_state` (optimizer state followed by parameter name);
- :mod:`~hf_zero.checkpoint.consolidated`: full weights in Hugging Face's safetensors layout.

Nothing here knows the engine classes or pipelines: the engine hands over a
:class:`~hf_zero.checkpoint.state.TrainState` (``engine.train_state()``: its layout, its shard groups
through the ``zero`` interface, scheduler, scaler, counters, data position), and a load hands the
counters back as a :class:`~hf_zero.checkpoint.state.Progress`.
"""

from hf_zero.errors import CheckpointError

__all__ = ["CheckpointError"]
