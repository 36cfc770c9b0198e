"""``deepspeed.ops`` under hf_zero: the optimizers DeepSpeed scripts construct by name (``ops.adam``)."""

from hf_zero.ops import adam

__all__ = ["adam"]
