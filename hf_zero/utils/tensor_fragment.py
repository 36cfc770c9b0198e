"""DeepSpeed's module path ``deepspeed.utils.tensor_fragment``: re-exports hf_zero.zero.accessors' accessors.

The per-parameter accessors (``safe_get_full_fp32_param`` and the like) read a parameter's shard group, so they
live in :mod:`hf_zero.zero.accessors`; this path and :mod:`hf_zero.utils` are where DeepSpeed's users import them.
"""

from hf_zero.zero.accessors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

__all__ = [
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
    "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized",
]
