"""``deepspeed.runtime`` under hf_zero: the learning-rate schedules scripts import from ``runtime.lr_schedules``."""

from hf_zero.runtime import lr_schedules

__all__ = ["lr_schedules"]
