"""DeepSpeed's module path ``deepspeed.runtime.base_optimizer``: holds DeepSpeed's optimizer base classes, for ``isinstance``.

DeepSpeed's ZeRO optimizers derive from ``ZeROOptimizer`` (itself a ``DeepSpeedOptimizer``), and its
tests and scripts ask ``isinstance(engine.optimizer, ZeROOptimizer)``. hf_zero has one wrapper for
every stage (:class:`hf_zero.zero.optimizer.ShardedOptimizer`), so these classes answer by its stage:

- ``DeepSpeedOptimizer``: any hf_zero wrapper (DeepSpeed wraps stage 0 under fp16/bf16 too);
- ``ZeROOptimizer``: a wrapper at ZeRO stage 1, 2 or 3;
- ``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer``: stage 1 or 2;
- ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3``: stage 3;
- ``deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer``: stage 0 (in fp16 or bf16: in fp32 there is no wrapper).

Each wrapper answers DeepSpeed's attribute for its masters (``single_partition_of_fp32_groups``,
``fp32_partitioned_groups_flat``, ``fp32_groups_flat``) at those stages only; see ``ShardedOptimizer``.

At stage 0 without mixed precision ``initialize`` returns the client's own optimizer, as DeepSpeed does,
so none of them holds there.
"""

from __future__ import annotations

from typing import Any

from hf_zero.zero.optimizer import ShardedOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]


class _ByStage(type):
    """``isinstance(x, cls)``: a subclass instance, or an hf_zero wrapper at one of ``cls._stages``."""

    _stages: tuple[int, ...]

    def __instancecheck__(cls, obj: Any) -> bool:
        if isinstance(obj, ShardedOptimizer) and obj.stage in cls._stages:
            return True
        return type.__instancecheck__(cls, obj)


class DeepSpeedOptimizer(metaclass=_ByStage):
    """DeepSpeed's base of every optimizer wrapper; an hf_zero wrapper at any stage is one."""

    _stages = (0, 1, 2, 3)


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's base of its ZeRO optimizers; an hf_zero wrapper at stage 1, 2 or 3 is one."""

    _stages = (1, 2, 3)
