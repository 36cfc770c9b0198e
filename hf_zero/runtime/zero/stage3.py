"""``deepspeed.runtime.zero.stage3`` under hf_zero: ``DeepSpeedZeroOptimizer_Stage3`` for ``isinstance``.

``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`` holds for hf_zero's wrapper at stage 3
(see :mod:`hf_zero.runtime.base_optimizer`)."""

from hf_zero.runtime.base_optimizer import ZeROOptimizer

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]


class DeepSpeedZeroOptimizer_Stage3(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's stage-3 optimizer class; an hf_zero wrapper at stage 3 is one."""

    _stages = (3,)
