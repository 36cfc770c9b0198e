"""DeepSpeed's module path ``deepspeed.runtime.pipe.topology``: re-exports DeepSpeed's topology classes and ``PipelineParallelGrid``,
answered from hf_zero's grid (:mod:`hf_zero.parallel.topology` says how the axes correspond)."""

from __future__ import annotations

from hf_zero.parallel.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]
