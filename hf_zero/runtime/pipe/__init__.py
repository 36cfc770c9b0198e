"""DeepSpeed's module path ``deepspeed.runtime.pipe``: re-exports ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` and
``ProcessTopology`` as DeepSpeed's package exports them, and its submodules ``topology`` (the grid and topology
classes, :mod:`hf_zero.parallel.topology`), ``module`` and ``engine``. Thin names over hf_zero's own objects."""

from __future__ import annotations

import importlib
from typing import Any

from hf_zero.parallel.topology import ProcessTopology
from hf_zero.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "engine", "module", "topology"]


def __getattr__(name: str) -> Any:
    """``deepspeed.runtime.pipe.topology`` and the others as attributes too, loaded on first use."""
    if name in ("topology", "module", "engine"):
        return importlib.import_module(f"hf_zero.runtime.pipe.{name}")
    raise AttributeError(f"module 'hf_zero.runtime.pipe' has no attribute {name!r}")
