"""DeepSpeed's module path ``deepspeed.runtime.pipe.engine``: re-exports ``PipelineEngine`` (:mod:`hf_zero.pipe.engine`), what
``initialize(model=PipelineModule)`` returns, for ``isinstance`` checks written against DeepSpeed's path."""

from __future__ import annotations

from hf_zero.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
