"""DeepSpeed's module path ``deepspeed.runtime.fp16.fused_optimizer``: holds ``FP16_Optimizer`` for ``isinstance``.

DeepSpeed wraps the client's optimizer in ``FP16_Optimizer`` at ZeRO stage 0 with fp16 or bf16 (its
``fp32_groups_flat`` are the masters); hf_zero's wrapper at stage 0 is one (at stage 0 in fp32 ``initialize``
returns the client's optimizer, as DeepSpeed does). See :mod:`hf_zero.runtime.base_optimizer`."""

from hf_zero.runtime.base_optimizer import DeepSpeedOptimizer

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(DeepSpeedOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's stage-0 fp16/bf16 optimizer wrapper; an hf_zero wrapper at stage 0 is one."""

    _stages = (0,)
