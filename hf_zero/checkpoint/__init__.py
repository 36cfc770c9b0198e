"""Checkpoints: reshardable resume state (``sharded``) and Hugging Face weights (``consolidated``)."""

from hf_zero.errors import CheckpointError

__all__ = ["CheckpointError"]
