"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (the ones the config's ``scheduler.type`` names)."""

from hf_zero.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
