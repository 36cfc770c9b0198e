"""``deepspeed.runtime.dataloader`` under hf_zero: ``RepeatingLoader`` (also ``deepspeed.utils.RepeatingLoader``)."""

from hf_zero.training.data import RepeatingLoader

__all__ = ["RepeatingLoader"]
