"""A resume checkpoint's weights, whole, in fp32: DeepSpeed's ``zero_to_fp32`` functions (what
``deepspeed.utils.zero_to_fp32`` answers, through :mod:`hf_zero.utils.zero_to_fp32`).

DeepSpeed users turn a ZeRO checkpoint into one state dict with these three functions (or the
``zero_to_fp32.py`` script DeepSpeed copies beside each checkpoint). They read hf_zero's
checkpoints here (any world size, ZeRO stage or pipeline layout, as saved by
``engine.save_checkpoint``), and folders DeepSpeed's ``save_checkpoint`` wrote (``checkpoint/deepspeed.py``'s
reading of them: any ZeRO stage 0-3 layout it converts, AutoEP's expert blocks made the model's fused tensors), on a
CPU, without starting processes. For a ``from_pretrained``
folder, ``hf-zero consolidate`` (or ``engine.save_pretrained``) is the direct way. Files are
written as safetensors unless a script asks for DeepSpeed's pickles (``safe_serialization=False``).
"""

from __future__ import annotations

import os

import torch

from hf_zero.errors import UsageError

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """Every parameter (from the fp32 masters) and buffer of the checkpoint, whole, on the CPU.

    ``checkpoint_dir`` is the folder given to ``save_checkpoint`` (``tag`` defaults to what its
    ``latest`` names) or a tag folder itself.
    """
    from hf_zero.checkpoint.consolidated import read_state_dict

    if lazy_mode:
        raise UsageError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not supported by hf_zero; leave it False")
    if _from_deepspeed(checkpoint_dir, tag):
        from hf_zero.checkpoint import deepspeed as ds_checkpoint

        _, entries, produce = ds_checkpoint.weights(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters)
        return {name: produce(name) for name, _, _ in entries}
    checkpoint_dir, tag = _split(checkpoint_dir, tag)
    state = read_state_dict(checkpoint_dir, tag, dtype=torch.float32, exclude_frozen=exclude_frozen_parameters)
    return _with_shared(state, checkpoint_dir, tag)


def _with_shared(state: dict[str, torch.Tensor], checkpoint_dir: str, tag: str | None) -> dict[str, torch.Tensor]:
    """A tied weight under each of its names, as one tensor (the checkpoint stores it once; DeepSpeed's state dict has
    every name). Only for a state dict kept in memory or pickled: safetensors stores a shared tensor once."""
    from hf_zero.checkpoint.format import read_meta, resolve_tag

    for alias, first in read_meta(resolve_tag(checkpoint_dir, tag)).get("shared", {}).items():
        if first in state:
            state[alias] = state[first]
    return state


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (a plain, unwrapped module) and return it.

    Unlike DeepSpeed's (``strict=False``), names the checkpoint has and the model lacks, or the
    other way round, are an error: a silently half-loaded model is worse than a refusal. The frozen
    parameters a checkpoint saved with ``exclude_frozen_parameters=True`` left out keep the model's values;
    a tied weight (stored once, under its first name) is loaded under every name it has.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        from hf_zero.checkpoint.consolidated import frozen_left_out

        mine = model.state_dict(keep_vars=True)
        loaded = {id(mine[n]) for n in state if n in mine}
        left_out = set() if _from_deepspeed(checkpoint_dir, tag) else frozen_left_out(*_split(checkpoint_dir, tag))
        missing = [n for n in missing if id(mine[n]) not in loaded and n not in left_out]
    if missing or unexpected:
        raise UsageError(
            f"the checkpoint in {checkpoint_dir} does not fit {type(model).__name__}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; load it into the model it was saved from"
        )
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str, output_dir: str, max_shard_size: int | str = "5GB", safe_serialization: bool = True,
    tag: str | None = None, exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the checkpoint's fp32 weights into ``output_dir`` as ``model.safetensors`` (sharded above ``max_shard_size``).

    With ``safe_serialization=False``, as DeepSpeed's function writes then: ``pytorch_model.bin`` (or its shards and
    index), built whole in host memory first, a tied weight under each of its names as one tensor; the safetensors
    path holds one tensor at a time (a tied weight once, under its first name, as transformers saves it). Returns the files
    written. For a transformers model the folder also gets ``config.json``, so it loads with ``from_pretrained``.
    """
    from hf_zero.checkpoint.consolidated import checkpoint_weights, save_pickled_shards, write_weights

    if _from_deepspeed(checkpoint_dir, tag):
        from hf_zero.checkpoint import deepspeed as ds_checkpoint

        if safe_serialization and not exclude_frozen_parameters:
            return ds_checkpoint.consolidate(checkpoint_dir, output_dir, tag, max_shard_size, progress=False)
        _, entries, produce = ds_checkpoint.weights(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters)
        os.makedirs(output_dir, exist_ok=True)
        if safe_serialization:
            return write_weights(output_dir, entries, produce, max_shard_size, writer=True)
        return save_pickled_shards({name: produce(name) for name, _, _ in entries}, output_dir, max_shard_size)
    checkpoint_dir, tag = _split(checkpoint_dir, tag)
    _, entries, produce = checkpoint_weights(checkpoint_dir, tag, torch.float32, exclude_frozen_parameters)  # one tensor at a time
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        files = write_weights(output_dir, entries, produce, max_shard_size, writer=True)
    else:
        state = _with_shared({name: produce(name).to(dt) for name, dt, _ in entries}, checkpoint_dir, tag)
        files = save_pickled_shards(state, output_dir, max_shard_size)
    _copy_config(checkpoint_dir, tag, output_dir)
    return files


def _from_deepspeed(checkpoint_dir: str, tag: str | None) -> bool:
    """Whether the folder is one DeepSpeed wrote (read through ``checkpoint/deepspeed.py``), not hf_zero's."""
    from hf_zero.checkpoint.deepspeed import is_deepspeed_checkpoint

    return os.path.isdir(checkpoint_dir) and is_deepspeed_checkpoint(checkpoint_dir, tag)


def _split(checkpoint_dir: str, tag: str | None) -> tuple[str, str | None]:
    """Accept a tag folder itself (``…/global_step10``) as DeepSpeed's script does, as well as its parent."""
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, "checkpoint.json")):
        parent, leaf = os.path.split(os.path.normpath(checkpoint_dir))
        return parent, leaf
    return checkpoint_dir, tag


def _copy_config(checkpoint_dir: str, tag: str | None, output_dir: str) -> None:
    import shutil

    from hf_zero.checkpoint.format import resolve_tag

    src = resolve_tag(checkpoint_dir, tag)
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(output_dir, name))
