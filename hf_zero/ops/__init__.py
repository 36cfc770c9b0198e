"""DeepSpeed's module path ``deepspeed.ops``: re-exports hf_zero.optim's optimizers under DeepSpeed's names.

``ops.adam`` answers ``FusedAdam`` and ``DeepSpeedCPUAdam``, ``ops.cpu_adam`` the host Adam update
(``adam_update``) that ZeRO-Offload steps with; both live in :mod:`hf_zero.optim`.
"""

from hf_zero.ops import adam, cpu_adam

__all__ = ["adam", "cpu_adam"]
