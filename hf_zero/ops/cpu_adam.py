"""DeepSpeed's module path ``deepspeed.ops`` (``cpu_adam``): re-exports hf_zero.optim.cpu_adam's host Adam.

The implementation (the fused host Adam update ZeRO-Offload steps with, and ``DeepSpeedCPUAdam``) lives in
:mod:`hf_zero.optim.cpu_adam`; this module exists so that DeepSpeed's ``ops`` layout keeps answering.
"""

from hf_zero.optim.cpu_adam import ALIGN, DeepSpeedCPUAdam, adam_update, host_buffer, sub_group_ranges

__all__ = ["ALIGN", "DeepSpeedCPUAdam", "adam_update", "host_buffer", "sub_group_ranges"]
