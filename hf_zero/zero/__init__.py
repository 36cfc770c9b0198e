"""ZeRO: flat buffers, the stage policies, and the stage-3 user helpers (DeepSpeed's names)."""

from hf_zero.zero.external import register_external_parameter, unregister_external_parameter
from hf_zero.zero.gathered import GatheredParameters
from hf_zero.zero.init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
