"""DeepSpeed's module path ``deepspeed.runtime``: the module paths scripts and libraries import DeepSpeed's names from.

``runtime.lr_schedules`` (the learning-rate schedules), ``runtime.engine.DeepSpeedEngine``,
``runtime.config.DeepSpeedConfigError``, ``runtime.dataloader.RepeatingLoader``,
``runtime.base_optimizer``, ``runtime.zero`` (``partition_parameters.ZeroParamStatus``, the ZeRO
optimizer classes for ``isinstance``) and ``runtime.pipe`` (``topology``'s ``PipelineParallelGrid`` and topology
classes, ``module``, ``engine``). Each is a thin name over hf_zero's own object.
"""

from __future__ import annotations

import importlib
from typing import Any

from hf_zero.runtime import lr_schedules

__all__ = ["lr_schedules", "engine", "config", "dataloader", "base_optimizer", "zero", "pipe"]

_SUBMODULES = ("engine", "config", "dataloader", "base_optimizer", "zero", "pipe")


def __getattr__(name: str) -> Any:
    """``deepspeed.runtime.engine`` and the others as attributes too, loaded on first use."""
    if name in _SUBMODULES:
        return importlib.import_module(f"hf_zero.runtime.{name}")
    raise AttributeError(f"module 'hf_zero.runtime' has no attribute {name!r}")
