"""Pipeline parallelism (``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``): not built yet.

The names exist so that a DeepSpeed script that imports them fails at the point of use with a
sentence saying so, rather than with an ImportError that looks like a broken install.
"""

from __future__ import annotations

from typing import Any

_MESSAGE = (
    "hf_zero does not support pipeline parallelism yet ({name}); train the model unsplit with "
    "ZeRO stage 1-3 (zero_optimization.stage), which needs no PipelineModule"
)


class _NotYet:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE.format(name=type(self).__name__))


class LayerSpec(_NotYet):
    """DeepSpeed's lazily built layer; not supported yet."""


class TiedLayerSpec(_NotYet):
    """DeepSpeed's tied layer; not supported yet."""


class PipelineModule(_NotYet):
    """DeepSpeed's pipeline container; not supported yet."""


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
