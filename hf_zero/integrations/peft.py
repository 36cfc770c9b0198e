"""``hf_zero.integrations.peft``: PEFT adapters with hf_zero, one import for users and tests.

The pieces live in their layers: :mod:`hf_zero.training.peft_model` (detection, adapter configs, which tensors,
the meta twin) and :mod:`hf_zero.checkpoint.adapters` (saving adapters or merged weights from an engine
or a resume checkpoint).
"""

from hf_zero.checkpoint.adapters import (  # noqa: F401
    consolidate,
    gather_full_state_dict,
    is_peft_checkpoint,
    save_adapters,
    save_merged,
)
from hf_zero.training.peft_model import (  # noqa: F401
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEFAULT_ADAPTER,
    adapter_dir,
    adapter_plan,
    base_model_of,
    build_twin,
    is_peft_model,
    read_adapter_configs,
    require_peft,
    write_adapter_configs,
)
