"""``deepspeed.runtime.pipe.engine`` under hf_zero: ``PipelineEngine`` (:mod:`hf_zero.pipe.engine`), what
``initialize(model=PipelineModule)`` returns, for ``isinstance`` checks written against DeepSpeed's path."""

from __future__ import annotations

from hf_zero.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
