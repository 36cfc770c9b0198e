"""What an engine writes and reads back: resume checkpoints, 16-bit and Hugging Face saves, the Hub.

:class:`Persistence` is the engine's collaborator for everything that outlives the process. It holds the
state of that job alone (the background writer of ``checkpoint.async_save``, the folder of the last save)
and reaches its engine only through :class:`Owner`, the few calls it needs: the engine's ``TrainState``
(what ``hf_zero/checkpoint/`` and ``hf_zero/hub/model_cards/`` read, since they never see the engine), its
counters' write-back, and the waits that make the parameters and the optimizer state current. The
engine's public methods (``save_checkpoint``, ``load_checkpoint``, ``save_16bit_model``,
``save_pretrained``, ``push_to_hub``, DeepSpeed's names) are one-line calls into this object, so a
subclass (``PipelineEngine``) still overrides them on the engine.

It keeps a weak reference to its engine, so that an engine nobody holds is freed at once, as it was
before the collaborator existed (its GPU memory with it), rather than at the next garbage collection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hf_zero.checkpoint.ranks import CheckpointLayout
from hf_zero.checkpoint.state import Progress, TrainState
from hf_zero.distributed import dist as hz_dist
from hf_zero.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from hf_zero.checkpoint.background import BackgroundWriter
    from hf_zero.config import ZeroConfig
    from hf_zero.zero.optimizer import ShardedOptimizer

logger = logging.getLogger("hf_zero")


class Owner(Protocol):
    """What :class:`Persistence` reads of its engine (``ZeroEngine`` answers all of it)."""

    config: ZeroConfig
    global_rank: int
    device: torch.device
    zero_optimizer: ShardedOptimizer | None

    def train_state(self) -> TrainState: ...
    def restore_progress(self, progress: Progress | None) -> None: ...
    def checkpoint_layout(self) -> CheckpointLayout: ...
    def wait_params(self) -> None: ...
    def resident_state(self) -> contextlib.AbstractContextManager[None]: ...
    def save_pretrained(self, save_directory: str) -> list[str]: ...
    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: str | int, expp_rank: int | None = None) -> str: ...


class Persistence:
    """An engine's saves and loads, and the background write in flight (``checkpoint.async_save``)."""

    def __init__(self, owner: Owner) -> None:
        self._owner = weakref.ref(owner)
        self.background: BackgroundWriter | None = None
        """Made at the first background save and kept: its host buffers are reused by every later one."""
        self.last_save_dir: str | None = None
        """The folder of the last resume checkpoint, where a preemption saves without ``checkpoint.save_dir``."""

    @property
    def owner(self) -> Owner:
        owner = self._owner()
        if owner is None:  # only reachable by holding this object past its engine
            raise UsageError("the engine these saves belong to no longer exists; call save/load on a live engine")
        return owner

    def wait(self) -> str | None:
        """The engine's ``wait_for_checkpoint``: the background write's path (None if none was in flight); its
        error, if the write failed on any rank, is raised here on every rank."""
        return self.background.wait() if self.background is not None else None

    # ------------------------------------------------------ resume checkpoints

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        keep_last: int | None = None) -> str:
        """Write a resume checkpoint (every rank calls this); ``tag`` defaults to ``global_step<N>``.

        The checkpoint loads at any world size and ZeRO stage; its format is :mod:`hf_zero.checkpoint.format`.
        ``keep_last=N`` (default: the config's ``checkpoint.keep_last``; None keeps all) deletes
        all but the N newest checkpoints in ``save_dir`` once this one is complete and ``latest``
        points at it; the one ``latest`` names is never deleted. With ``checkpoint.async_save`` it
        returns once this rank's share is in host memory, and the returned path exists once every
        rank's background write is done (``engine.wait_for_checkpoint``). ``exclude_frozen_parameters=True``
        leaves the values of the parameters nothing trains out (a PEFT model's base weights); loading
        it keeps the values the model has for them.
        """
        config = self.owner.config
        if not save_dir:
            raise UsageError(f"save_checkpoint(save_dir={save_dir!r}): name the folder to save the checkpoint in")
        if keep_last is None:
            keep_last = config.checkpoint_keep_last
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise UsageError(f"save_checkpoint(keep_last=...): got {keep_last!r}, expected an integer >= 1 (or None to keep all)")
        return self.save(save_dir, tag, client_state, save_latest, keep_last, background=config.checkpoint_async_save,
                         exclude_frozen=bool(exclude_frozen_parameters))

    def save(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
             keep_last: int | None = None, background: bool = False, exclude_frozen: bool = False) -> str:
        """``save_checkpoint`` once its arguments are checked; ``background``: return once the share is in host memory."""
        from hf_zero.checkpoint.background import BackgroundWriter
        from hf_zero.checkpoint.save import save

        owner = self.owner
        self.wait()  # at most one save in flight; its host buffers are the ones reused
        owner.wait_params()
        writer = None
        if background:
            if self.background is None:
                self.background = BackgroundWriter(pin=owner.device.type == "cuda")
            writer = self.background
        with hz_dist.peer_failure_guard("save_checkpoint"), owner.resident_state():
            path = save(owner.train_state(), save_dir, tag, client_state, save_latest=save_latest, keep_last=keep_last,
                        background=writer, exclude_frozen=exclude_frozen)
        self.last_save_dir = save_dir
        return path

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str, dict]:
        """Restore a checkpoint written by ``save_checkpoint`` at any world size and stage.

        A DeepSpeed checkpoint folder (ZeRO 0-3) is recognised and read as it is
        (``checkpoint/deepspeed.py``). Returns ``(path, client_state)`` as DeepSpeed does; with no
        ``tag`` and no ``latest`` file in ``load_dir`` (nothing saved there yet) it warns and returns
        ``(None, None)`` without touching anything, as DeepSpeed does, so "resume if there is a
        checkpoint" start-up code runs unchanged.
        """
        from hf_zero.checkpoint import deepspeed as ds_checkpoint
        from hf_zero.checkpoint.format import read_latest
        from hf_zero.checkpoint.load import load

        owner = self.owner
        if tag is None and not self._has_latest(load_dir):
            logger.warning(
                "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file exists "
                "or pass an explicit checkpoint tag when loading a checkpoint.", os.path.join(load_dir, "latest"))
            return None, None

        if not load_module_strict:
            raise UsageError("load_checkpoint(load_module_strict=False) is not supported yet; the model must match the checkpoint")
        if custom_load_fn is not None:
            raise UsageError("load_checkpoint(custom_load_fn=...) is not supported; checkpoints are read as safetensors")
        self.wait()  # (async_save) the checkpoint being written may be the one asked for
        owner.wait_params()  # the load writes the masters, which in fp32 are the gathered buffers
        with hz_dist.peer_failure_guard("load_checkpoint"), owner.resident_state():
            theirs = ds_checkpoint.is_deepspeed_checkpoint(load_dir, tag)
            reader = ds_checkpoint.load if theirs else load
            if load_optimizer_states and not load_module_only and not theirs:
                # through the engine's method: DeepSpeed's tests patch it there to see that it was asked
                logger.debug("rank %d loads its optimizer state from %s", owner.global_rank,
                             owner._get_optimizer_ckpt_name(load_dir, tag if tag is not None else read_latest(load_dir)))
            path, client, progress = reader(
                owner.train_state(), load_dir, tag, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            )
        owner.restore_progress(progress)
        return path, client

    def optimizer_ckpt_name(self, checkpoints_path: str, tag: str | int, expp_rank: int | None = None) -> str:
        """The file holding a rank's optimizer state in checkpoint ``tag`` of ``checkpoints_path`` (DeepSpeed's name).

        hf_zero keeps optimizer state beside the masters, by parameter name and element range, in each saving
        rank's ``rankNNNNN-000.safetensors`` (a share over 2 GiB goes on in ``-001``, ...; see
        ``hf_zero/checkpoint/format.py``). For this rank: the file it reads its optimizer state from, as
        :func:`hf_zero.checkpoint.load.optimizer_state_file` finds it in the checkpoint (in the layout of the save
        its own file, at stage 0 the first rank's); where the checkpoint is not there yet or holds none for this
        rank, and for ``expp_rank`` (DeepSpeed's argument: the expert-parallel rank of its MoE optimizer files;
        hf_zero keeps no per-EP-rank optimizer files, an EP rank's experts being named apart inside every rank's
        share, so it names a rank), the file that rank writes. ``load_checkpoint``
        asks for it only when it loads optimizer states, and logs it at debug level.
        """
        from hf_zero.checkpoint.format import META, rank_file_name
        from hf_zero.checkpoint.load import optimizer_state_file

        owner = self.owner
        path = os.path.join(checkpoints_path, str(tag))
        found = None
        if expp_rank is None and owner.zero_optimizer is not None and os.path.isfile(os.path.join(path, META)):
            found = optimizer_state_file(path, owner.zero_optimizer)
        return found or os.path.join(path, rank_file_name(owner.global_rank if expp_rank is None else int(expp_rank), 0))

    def _has_latest(self, load_dir: str) -> bool:
        """Whether ``load_dir`` names a checkpoint to load without a tag: its ``latest`` file (or the folder is a
        DeepSpeed checkpoint itself), the same answer on every rank (a rank that sees none while another does,
        a folder on a disk not shared by all, is refused on every rank rather than left waiting in the load)."""
        from hf_zero.checkpoint import deepspeed as ds_checkpoint

        lay = self.owner.checkpoint_layout()
        mine = os.path.isfile(os.path.join(load_dir, "latest")) or ds_checkpoint.is_deepspeed_checkpoint(load_dir, None)
        every = [v[0] for v in hz_dist.gather_ints([int(mine)], lay.group)] if lay.world > 1 else [int(mine)]
        if any(every) and not all(every):
            raise CheckpointError(
                f"load_checkpoint({load_dir!r}): rank {every.index(1)} finds a 'latest' file there but rank "
                f"{every.index(0)} does not; put the checkpoint where every rank reads it"
            )
        return mine

    # ------------------------------------------------------ whole weights

    def save_pretrained(self, save_directory: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                        merge_adapters: bool = False) -> list[str]:
        """The model's full weights in Hugging Face's layout (every rank calls this; rank 0 writes).

        ``dtype`` defaults to the dtype the module holds (the compute dtype); stage-3 units are
        gathered one at a time. The folder loads with ``from_pretrained``. A peft ``PeftModel``
        is saved as peft saves it (``adapter_model.safetensors`` + ``adapter_config.json``, only
        the adapters gathered), or with ``merge_adapters=True`` as full weights with the adapters
        merged in (see :mod:`hf_zero.integrations.peft`). The folder also records how the model
        was trained, for its model card (:mod:`hf_zero.hub.model_cards`).
        """
        from hf_zero.checkpoint import adapters as hz_peft
        from hf_zero.hub.model_cards import record

        owner = self.owner
        owner.wait_params()
        state = owner.train_state()
        if merge_adapters:
            files = hz_peft.save_merged(state, save_directory, max_shard_size=max_shard_size, dtype=dtype)
        elif hz_peft.is_peft_model(state.module):
            files = hz_peft.save_adapters(state, save_directory, dtype=dtype)
        else:
            from hf_zero.checkpoint import consolidated

            files = consolidated.save_pretrained(state, save_directory, max_shard_size=max_shard_size, dtype=dtype)
        record.write_engine_record(state, save_directory, merged=merge_adapters)
        return files

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's state dict in its compute dtype, in one file (every rank calls this; rank 0 writes).

        The default name is ``model.safetensors``: a safetensors file, tied weights written once under
        their first name, streamed so rank 0 never holds the whole model. A name a DeepSpeed script
        passes, such as ``pytorch_model.bin`` (DeepSpeed's default), gets what DeepSpeed writes there:
        ``torch.save`` of the state dict, tied weights under each name (``torch.load(weights_only=True)``
        and ``from_pretrained`` read it). Stage-3 blocks are gathered one at a time (no
        ``stage3_gather_16bit_weights_on_model_save`` needed). Returns True, as DeepSpeed does.
        """
        from hf_zero.checkpoint import consolidated

        owner = self.owner
        owner.wait_params()
        consolidated.save_single_file(owner.train_state(), save_dir, save_filename, exclude_frozen=exclude_frozen_parameters)
        return True

    def push_to_hub(self, repo_id: str, save_directory: str, *, revision: str | None = None, private: bool | None = None,
                    commit_message: str | None = None, token: str | None = None, include_resume_state: bool = False,
                    card_kwargs: dict | None = None) -> str | None:
        """Consolidate into ``save_directory`` and upload it (every rank calls this; rank 0 uploads).

        The folder is written by the engine's own ``save_pretrained`` (a pipeline's assembles its stages).
        The model card records this engine's resolved ZeRO config and hardware (from what
        ``save_pretrained`` wrote in the folder); with ``include_resume_state`` the resume
        checkpoints saved in the same folder (``save_checkpoint(save_directory)``) go too, so a run
        can be picked up elsewhere with ``hf-zero pull`` and ``load_checkpoint``. Returns the commit
        URL on rank 0.
        """
        from hf_zero.hub import transfer as hub

        owner = self.owner
        owner.save_pretrained(save_directory)
        url, failure, error = None, None, None
        if owner.global_rank == 0:
            kwargs = dict(card_kwargs or {})
            from hf_zero.hub.model_cards import record

            if not record.read_record(save_directory):  # a save that records nothing (a pipeline's): show the config
                kwargs.setdefault("zero_config", owner.config.raw)
            try:
                url = hub.push_to_hub(
                    save_directory, repo_id, revision=revision, private=private, commit_message=commit_message,
                    token=token, include_resume_state=include_resume_state, card_kwargs=kwargs,
                )
            except Exception as e:  # every rank learns of it, instead of waiting for rank 0 in a barrier
                failure, error = e, str(e) if isinstance(e, hub.HubError) else f"{type(e).__name__}: {e}"
        lay = owner.checkpoint_layout()
        if lay.world > 1:
            error = hz_dist.gather_json(error, lay.group)[0]
        if failure is not None:
            raise failure
        if error is not None:
            raise hub.HubError(f"rank 0 could not push: {error}")
        return url
