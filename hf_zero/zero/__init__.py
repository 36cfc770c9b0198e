"""ZeRO: flat buffers, the stage policies, and the stage-3 user helpers."""

from hf_zero.zero.init import GatheredParameters

__all__ = ["GatheredParameters"]
