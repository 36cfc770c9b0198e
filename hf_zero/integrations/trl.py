"""TRL's trainers on hf_zero's engine: ``from hf_zero.integrations.trl import SFTTrainer, SFTConfig, DPOTrainer, DPOConfig``.

Each is TRL's own class made an hf_zero one by :func:`hf_zero.zero_trainer` / :func:`hf_zero.zero_args`
(the same two calls turn any other Trainer subclass, TRL's or a user's, into one): the configs take
``zero_config=`` (or ``deepspeed=``), everything else is TRL's. DPO's reference model goes through the
accelerator's ``prepare_model(..., evaluation_mode=True)``, which hf_zero answers as DeepSpeed's
integration does: at stage 3 a ZeRO-3 engine without optimizer (its weights sharded like the
policy's, gathered block by block for the forward), at stages 0-2 a frozen copy on each rank.
"""

from __future__ import annotations

try:
    import trl as _trl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("hf_zero.integrations.trl needs the trl package, which is not installed; install it with "
                      "pip install 'hf_zero[trl]'") from e

from hf_zero.integrations.transformers import zero_args, zero_trainer

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]

SFTConfig = zero_args(_trl.SFTConfig)
SFTTrainer = zero_trainer(_trl.SFTTrainer)
DPOConfig = zero_args(_trl.DPOConfig)
DPOTrainer = zero_trainer(_trl.DPOTrainer)
