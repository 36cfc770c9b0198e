"""DeepSpeed's module path ``deepspeed.runtime.pipe.module``: re-exports ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec``
(:mod:`hf_zero.pipe.module`), with the topology names DeepSpeed's module imports."""

from __future__ import annotations

from hf_zero.parallel.topology import PipeDataParallelTopology, PipelineParallelGrid
from hf_zero.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineModule", "PipelineParallelGrid", "TiedLayerSpec"]
