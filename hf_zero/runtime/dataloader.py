"""DeepSpeed's module path ``deepspeed.runtime.dataloader``: re-exports ``RepeatingLoader`` (also ``deepspeed.utils.RepeatingLoader``)."""

from hf_zero.training.data import RepeatingLoader

__all__ = ["RepeatingLoader"]
