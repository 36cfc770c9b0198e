"""DeepSpeed's module path ``deepspeed.runtime.zero.stage3``: holds ``DeepSpeedZeroOptimizer_Stage3`` for ``isinstance``, and
``unwrap_model_for_generation``.

``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`` holds for hf_zero's wrapper at stage 3
(see :mod:`hf_zero.runtime.base_optimizer`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_zero.runtime.base_optimizer import ZeROOptimizer
from hf_zero.zero.gathered import GatheredParameters

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]


class DeepSpeedZeroOptimizer_Stage3(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's stage-3 optimizer class; an hf_zero wrapper at stage 3 is one."""

    _stages = (3,)


@contextlib.contextmanager
def unwrap_model_for_generation(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """DeepSpeed's ``unwrap_model_for_generation``: every parameter whole for the block, for fast generation.

    ``model`` is an engine (or a module built under ``zero.Init``). Under ZeRO-3 a forward gathers each block
    before it runs and releases it after, which ``generate`` would repeat for every token; inside this block
    all the parameters are gathered once (``GatheredParameters``) and the engine's stage-3 forward hooks stand
    aside, as DeepSpeed removes them, so decoding reads the whole weights directly. On exit the parameters go
    back to their shards (edits made inside are discarded, as with ``GatheredParameters(modifier_rank=None)``)
    and training continues as before. It yields ``model`` itself; every rank must enter it (the gather is a
    collective). Outside stage 3 the parameters are already whole and it only yields the model. Needs the
    memory of the whole model on every rank while it is held; it is for forwards (no ``engine.backward``).
    """
    optimizer = getattr(model, "zero_optimizer", None)
    runtime = getattr(optimizer, "runtime", None)
    with GatheredParameters(list(model.parameters())):
        with runtime.standing_aside() if runtime is not None else contextlib.nullcontext():
            yield model
