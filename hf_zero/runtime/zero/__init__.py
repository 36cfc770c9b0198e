"""DeepSpeed's module path ``deepspeed.runtime.zero``: re-exports ``hf_zero.zero``'s names (DeepSpeed's ``deepspeed.zero`` is this
package too), ``unwrap_model_for_generation`` (from ``stage3``, as in DeepSpeed), and its submodules
``partition_parameters``, ``stage3`` and ``stage_1_and_2``."""

from __future__ import annotations

import importlib
from typing import Any

from hf_zero import zero as _zero
from hf_zero.runtime.zero.stage3 import unwrap_model_for_generation
from hf_zero.zero import *  # noqa: F403 - every name of hf_zero.zero, under DeepSpeed's path

__all__ = [*_zero.__all__, "unwrap_model_for_generation"]


def __getattr__(name: str) -> Any:
    if name in ("partition_parameters", "stage3", "stage_1_and_2"):
        return importlib.import_module(f"hf_zero.runtime.zero.{name}")
    return getattr(_zero, name)
