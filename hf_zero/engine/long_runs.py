"""What a long run needs of its engine besides the step: stopping cleanly when the cluster takes the job back.

``checkpoint.save_on_signal`` (``hf_zero/training/preemption.py``) records a signal and has the ranks agree on it
with one all-reduce per accumulation boundary, read at the next. :class:`LongRuns` owns that agreement
for one engine: the engine calls :meth:`LongRuns.at_boundary` once per counted boundary, and once the
ranks have agreed it either saves a resume checkpoint and exits (the engine's default) or leaves the
decision to an owner that saves its own way (hf_zero's ``Trainer`` reads ``preemption_signal()``).
The save goes through the engine's :class:`~hf_zero.engine.persistence.Persistence`, which also owns
the background write a preemption must finish or give up first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hf_zero.checkpoint.ranks import CheckpointLayout
from hf_zero.config import ZeroConfig
from hf_zero.distributed import dist as hz_dist
from hf_zero.engine.persistence import Persistence
from hf_zero.errors import CheckpointError
from hf_zero.training import preemption as hz_preemption

logger = logging.getLogger("hf_zero")

_NOT_YET: Any = ()  # the preemption group before the first boundary reads it (None is the default world group)


class LongRuns:
    """One engine's preemption watch: the ranks' agreement on a signal, and the save and exit it leads to."""

    def __init__(self, config: ZeroConfig, persistence: Persistence, device: torch.device, rank: int,
                 trains: bool) -> None:
        """``trains``: the engine has an optimizer (an engine that only runs forward has nothing to save)."""
        self.config = config
        self.persistence = persistence
        self.device = device
        self.rank = rank
        self.preemption: hz_preemption.Agreement | None = None
        """The ranks' agreement on a signal (``checkpoint.save_on_signal``); None when no signal is watched."""
        self.group: Any = _NOT_YET
        """The ranks that save, and so stop, together (the checkpoint layout's group), read at the first boundary."""
        signals = hz_preemption.signal_numbers(config.checkpoint_save_on_signal or ())
        if signals and trains:
            self.preemption = hz_preemption.Agreement(signals, config.checkpoint_grace_seconds)

    def at_boundary(self, step: int, layout: Callable[[], CheckpointLayout], save: bool) -> None:
        """On an accumulation boundary, once counted: has every rank agreed on a signal? Then, with ``save``,
        save and exit (``step``: the engine's ``global_steps``, for the messages)."""
        p = self.preemption
        if p is None or p.decided is not None:
            return
        if self.group is _NOT_YET:
            self.group = layout().group
        with hz_dist.peer_failure_guard(f"the preemption check of step {step}"):
            signum = p.poll(self.group, self.device)
        if signum is not None and save:
            self.save_and_exit(signum, step)

    def signal(self) -> int | None:
        """The signal every rank agreed to stop on, or None (the engine's ``preemption_signal``)."""
        return self.preemption.decided if self.preemption is not None else None

    def save_and_exit(self, signum: int, step: int) -> None:
        """Save a resume checkpoint into ``checkpoint.save_dir`` (or the last save's folder) and exit with 128 + signum."""
        assert self.preemption is not None
        hz_preemption.acting()
        status, name = hz_preemption.exit_status(signum), hz_preemption.signal_name(signum)
        try:
            self.persistence.wait()
        except CheckpointError as e:  # that save is lost; the one below is what the restart needs
            logger.error("%s", e)
        save_dir = self.config.checkpoint_save_dir or self.persistence.last_save_dir
        if save_dir is None:
            if self.rank == 0:
                logger.warning("%s: no folder to save a resume checkpoint into (set checkpoint.save_dir, or call "
                               "save_checkpoint once); exiting with status %d without saving", name, status)
        else:
            path = self.persistence.save(save_dir, keep_last=self.config.checkpoint_keep_last, background=False)
            if self.rank == 0:
                logger.warning("%s: every rank stopped after step %d and saved the resume checkpoint %s; exiting with "
                               "status %d", name, step, path, status)
        raise SystemExit(status)

    def close(self) -> None:
        """Put back the signal handlers ``checkpoint.save_on_signal`` replaced (the engine's ``destroy``)."""
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None
