"""Every exception hf_zero raises on purpose, in one module that imports nothing of hf_zero.

They live on the ground floor so that any layer can raise them without importing the layer that
used to define them (``ops/`` and ``utils/`` imported the whole engine for ``UsageError``). Each
message is one sentence naming the offending thing and what to do instead. The classes derive
from the builtin a caller would already catch (``ValueError`` for bad input, ``RuntimeError`` for
a failure of the environment, ``FloatingPointError`` for a training run that went non-finite), so
``except ValueError`` around a DeepSpeed script keeps working.

The old import paths (``hf_zero.engine.UsageError``, ``hf_zero.config.ConfigError``,
``hf_zero.checkpoint.CheckpointError``, ...) still name these same classes.
"""

from __future__ import annotations

__all__ = [
    "BatchSizeError", "CheckpointError", "CheckpointTagError", "ConfigError", "HostMemoryError", "HubError", "InitializeArgumentError", "LaunchError", "LossScaleFloorError", "NoSyncAtStage3Error", "NonFiniteLossError",
    "NvmeError",
    "OptimizerConfigError", "PeerFailureError", "PipelineError", "ReleasedParameterError", "StepInNoSyncError", "UnusedParameterError",
    "UsageError",
]


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be run: one sentence with the JSON path, the value and what is allowed."""


class BatchSizeError(ConfigError, AssertionError):
    """``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` that cannot agree.

    Also an ``AssertionError``: DeepSpeed checks the batch triple with asserts, and code written for it (its own
    tests among them) catches ``AssertionError`` there.
    """


class OptimizerConfigError(ConfigError):
    """A bad ``optimizer`` or ``scheduler`` section; the message starts with its JSON path."""


class UsageError(ValueError):
    """The engine's API was called in a way that cannot mean anything."""


class PipelineError(ValueError):
    """A pipeline that cannot be built: one sentence naming the offending argument."""


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked."""


class ReleasedParameterError(UsageError, RuntimeError):
    """An op read a stage-3 parameter between gathers, when it has no values (``hf_zero/zero/released.py``).

    A ``RuntimeError`` too, because PyTorch's storage error is what such a read raised before (code that
    catches it keeps working); ``param`` is the parameter, so the engine can say where in the forward it was read.
    """

    def __init__(self, message: str, param: object = None) -> None:
        super().__init__(message)
        self.param = param


class InitializeArgumentError(UsageError, AssertionError):
    """``initialize`` got no model, or the model in the place of ``args`` (its first positional parameter).

    An ``AssertionError`` too, because that is what DeepSpeed raises there (its own tests catch it).
    """


class NoSyncAtStage3Error(UsageError, AssertionError):
    """``engine.no_sync()`` under ZeRO stage 3, which reduce-scatters gradients on every micro-step.

    An ``AssertionError`` too, because DeepSpeed refuses it with one (its own tests catch that type and its words).
    """


class StepInNoSyncError(UsageError, AssertionError):
    """``engine.step()`` was called inside ``engine.no_sync()``.

    An ``AssertionError`` too, because that is what DeepSpeed raises there (its own tests catch it).
    """


class UnusedParameterError(UsageError, AssertionError):
    """``zero_optimization.ignore_unused_parameters`` is false and a trainable parameter got no gradient in a step.

    An ``AssertionError`` too, because that is what DeepSpeed raises there (its own tests catch it).
    """


class CheckpointTagError(CheckpointError, AssertionError):
    """Ranks passed different tags to ``save_checkpoint`` under ``"checkpoint": {"tag_validation": "Fail"}``.

    An ``AssertionError`` too, because that is what DeepSpeed raises there (scripts and its tests catch it).
    """


class LaunchError(ValueError):
    """A launch that cannot be translated into a torchrun command; the message is one sentence."""


class HubError(RuntimeError):
    """A push or pull that cannot be done as asked; the message is one sentence, fit for a terminal."""


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died, hung, or dropped its connection."""


class LossScaleFloorError(FloatingPointError):
    """fp16 gradients overflowed with the loss scale already at ``min_loss_scale``."""


class NonFiniteLossError(FloatingPointError):
    """A bf16/fp32 step had an inf/nan loss or gradient and the config says ``"nonfinite_loss": "stop"``."""


class HostMemoryError(MemoryError):
    """Offloading would need more host memory than the machine has available (checked before allocating any)."""


class NvmeError(OSError):
    """NVMe offload (``"device": "nvme"``) cannot use its ``nvme_path``: missing, read-only, full, or a failed read or
    write; one sentence naming the path and what to do, raised on every rank of the group."""
