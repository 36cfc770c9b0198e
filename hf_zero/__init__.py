"""hf_zero: ZeRO sharding, pipeline and data parallelism for the Hugging Face stack.

``import hf_zero as deepspeed`` is meant to just work: the names below are DeepSpeed's.
"""

from hf_zero import pipe, zero
from hf_zero.api import initialize
from hf_zero.config import ConfigError, ZeroConfig
from hf_zero.dist import init_distributed
from hf_zero.engine import UsageError, ZeroEngine

__version__ = "0.1.0"

__all__ = [
    "pipe", "zero", "Accelerator", "Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments", "ConfigError", "UsageError", "ZeroConfig", "ZeroEngine", "init_distributed", "initialize",
    "__version__",
]

_LAZY = {
    "Accelerator": "hf_zero.integrations.accelerate",
    "Trainer": "hf_zero.integrations.transformers",
    "TrainingArguments": "hf_zero.integrations.transformers",
    "Seq2SeqTrainer": "hf_zero.integrations.transformers",
    "Seq2SeqTrainingArguments": "hf_zero.integrations.transformers",
}


def __getattr__(name: str) -> object:
    """Integrations load on first use, so ``import hf_zero`` does not import Accelerate."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
