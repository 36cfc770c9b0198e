"""DeepSpeed's module path ``deepspeed.runtime.engine``: re-exports hf_zero's engine class as ``DeepSpeedEngine``.

``isinstance(engine, DeepSpeedEngine)`` holds for every engine ``initialize`` returns (a
``PipelineEngine`` is one too, as DeepSpeed's subclasses its engine), so Accelerate's and TRL's checks
and type hints written against DeepSpeed's name work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hf_zero.engine import ZeroEngine

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]

DeepSpeedEngine = ZeroEngine

# DeepSpeed's type names for the callables initialize(optimizer=..., lr_scheduler=...) accepts
DeepSpeedOptimizerCallable = Callable[[Iterable[Any]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Any]
