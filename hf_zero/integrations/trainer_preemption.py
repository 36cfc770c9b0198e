"""hf_zero's Trainer under preemption: the signals it asks the engine to watch, and what it does on one.

A preemption is decided by the engine on every rank at the same optimizer step (:mod:`hf_zero.training.preemption`); the
Trainer's part is a transformers callback that turns that decision into its own ``checkpoint-<step>`` (with the
trainer state, scheduler and data position) and an exit. Apart from :mod:`hf_zero.integrations.transformers`
because it is a collaborator the Trainer adds, talking to it only through the callback interface.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import transformers

from hf_zero.training import preemption as hz_preemption

logger = logging.getLogger("hf_zero")


class SaveOnPreemption(transformers.TrainerCallback):
    """A preemption under hf_zero's Trainer: ``checkpoint-<step>`` with the trainer state, then exit 128 + signum.

    The engine watches the signals (``checkpoint.save_on_signal``; the Trainer turns SIGTERM and SIGUSR1
    on unless the config says otherwise) and every rank learns of the decision at the same optimizer step
    (hf_zero/training/preemption.py). The Trainer then saves the checkpoint itself, so that it has its
    ``trainer_state.json``, scheduler and data position; the engine does not save on its own. A signal
    during evaluation is decided at the end of a later training step (evaluation has no optimizer step).
    """

    def __init__(self, trainer: Any) -> None:  # hf_zero's Trainer (not imported: it imports this module)
        self.trainer = trainer
        self.signum: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.engine is not None:
            self.trainer.engine.save_on_preemption = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine = self.trainer.engine
        signum = engine.preemption_signal() if engine is not None else None
        if signum is None or self.signum is not None:
            return
        self.signum = signum
        hz_preemption.acting()
        control.should_save, control.should_training_stop, control.should_evaluate = True, True, False
        if args.save_only_model and self.trainer.is_world_process_zero():
            logger.warning("save_only_model is on: the preemption checkpoint holds the weights only and cannot "
                           "be resumed from")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.signum is None:
            return
        engine = self.trainer.engine
        engine.wait_for_checkpoint()
        status = hz_preemption.exit_status(self.signum)
        if self.trainer.is_world_process_zero():
            logger.warning("%s: every rank stopped after step %d and saved %s; exiting with status %d",
                           hz_preemption.signal_name(self.signum), state.global_step,
                           os.path.join(self.trainer._get_output_dir(None), f"checkpoint-{state.global_step}"), status)
        raise SystemExit(status)


def watch_signals(config: dict) -> dict:
    """The engine's config with ``checkpoint.save_on_signal`` SIGTERM and SIGUSR1 unless the config names its own."""
    section = config.get("checkpoint")
    if isinstance(section, dict) and section.get("save_on_signal") is not None:
        return config
    section = dict(section) if isinstance(section, dict) else {}
    section["save_on_signal"] = list(hz_preemption.TRAINER_DEFAULT)
    return {**config, "checkpoint": section}
