"""DeepSpeed's module path ``deepspeed.utils.zero_to_fp32``: re-exports hf_zero.checkpoint.zero_to_fp32's functions.

Reading a resume checkpoint's weights whole in fp32 is checkpoint work, so the three functions live in
:mod:`hf_zero.checkpoint.zero_to_fp32`; this path is where DeepSpeed's users import them from.
"""

from typing import Any

from hf_zero.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
]


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'hf_zero.utils.zero_to_fp32' has no attribute {name!r}")
