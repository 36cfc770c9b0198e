"""``deepspeed.ops`` under hf_zero: the optimizers DeepSpeed scripts construct by name (``ops.adam``).

``cpu_adam`` holds the host Adam update itself (``adam_update``) that ``ops.adam.DeepSpeedCPUAdam``
and ZeRO-Offload step with.
"""

from hf_zero.ops import adam, cpu_adam

__all__ = ["adam", "cpu_adam"]
