"""hf_zero: ZeRO sharding, pipeline and data parallelism for the Hugging Face stack.

``import hf_zero as deepspeed`` is meant to just work: the names below are DeepSpeed's.
"""

from hf_zero import zero
from hf_zero.api import initialize
from hf_zero.config import ConfigError, ZeroConfig
from hf_zero.dist import init_distributed
from hf_zero.engine import UsageError, ZeroEngine

__version__ = "0.1.0"

__all__ = ["zero", "ConfigError", "UsageError", "ZeroConfig", "ZeroEngine", "init_distributed", "initialize", "__version__"]
