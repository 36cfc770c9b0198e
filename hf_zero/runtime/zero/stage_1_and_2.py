"""DeepSpeed's module path ``deepspeed.runtime.zero.stage_1_and_2``: holds ``DeepSpeedZeroOptimizer`` for ``isinstance``.

``isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`` holds for hf_zero's wrapper at stages 1 and 2
(see :mod:`hf_zero.runtime.base_optimizer`)."""

from hf_zero.runtime.base_optimizer import ZeROOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]


class DeepSpeedZeroOptimizer(ZeROOptimizer):
    """DeepSpeed's stage 1-2 optimizer class; an hf_zero wrapper at stage 1 or 2 is one."""

    _stages = (1, 2)
