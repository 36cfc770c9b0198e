"""DeepSpeed's module path ``deepspeed.runtime.config``: re-exports hf_zero.config.deepspeed_view's names.

``DeepSpeedConfig`` (a view of :class:`hf_zero.config.ZeroConfig` under DeepSpeed's attribute names) and
``DeepSpeedConfigError`` live in :mod:`hf_zero.config.deepspeed_view`; this path is where DeepSpeed's users
and tests import them from.
"""

from hf_zero.config.deepspeed_view import (
    ADAM_OPTIMIZER,
    BatchSizeError,
    DeepSpeedConfig,
    DeepSpeedConfigError,
)

__all__ = ["ADAM_OPTIMIZER", "BatchSizeError", "DeepSpeedConfig", "DeepSpeedConfigError"]
