"""hf_zero: ZeRO sharding, pipeline and data parallelism for the Hugging Face stack.

``import hf_zero as deepspeed`` is meant to just work: the names below are DeepSpeed's.
"""

from hf_zero import pipe, zero
from hf_zero.api import add_config_arguments, initialize
from hf_zero.config import ConfigError, ZeroConfig
from hf_zero.distributed.dist import init_distributed
from hf_zero.engine import ZeroEngine
from hf_zero.errors import UsageError

__version__ = "0.1.0"
# DeepSpeed's version attributes, which scripts read beside __version__ (no git build info here, as in its wheels)
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in __version__.split("."))
__git_hash__ = __git_branch__ = "unknown"

__all__ = [
    "pipe", "zero", "Accelerator", "Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments", "zero_trainer", "zero_args", "DummyOptim", "DummyScheduler", "ConfigError", "UsageError", "ZeroConfig", "ZeroEngine", "init_distributed", "initialize",
    "add_config_arguments", "comm", "accelerator", "checkpointing", "ops", "utils", "runtime", "__version__",
    "DeepSpeedEngine", "DeepSpeedConfigError",
]

_LAZY = {
    "Accelerator": "hf_zero.integrations.accelerate",
    "Trainer": "hf_zero.integrations.transformers",
    "TrainingArguments": "hf_zero.integrations.transformers",
    "Seq2SeqTrainer": "hf_zero.integrations.transformers",
    "Seq2SeqTrainingArguments": "hf_zero.integrations.transformers",
    "zero_trainer": "hf_zero.integrations.transformers",
    "zero_args": "hf_zero.integrations.transformers",
    # Accelerate's stand-ins for an optimizer / scheduler that the config's sections build; Accelerate
    # exports them from accelerate.utils only when the deepspeed package is installed.
    "DummyOptim": "hf_zero.integrations.accelerate",
    "DummyScheduler": "hf_zero.integrations.accelerate",
    # DeepSpeed's names for isinstance and except: hf_zero's engine class and config error
    "DeepSpeedEngine": "hf_zero.runtime.engine",
    "DeepSpeedConfigError": "hf_zero.runtime.config",
}


# DeepSpeed's submodules, reachable as attributes (``deepspeed.comm.get_rank()``) as well as by import.
_SUBMODULES = ("comm", "accelerator", "checkpointing", "ops", "utils", "runtime")


def __getattr__(name: str) -> object:
    """Integrations and DeepSpeed's submodules load on first use, so ``import hf_zero`` does not import Accelerate."""
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"hf_zero.{name}")
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
