"""PEFT adapters (LoRA and the other ``peft`` tuners) of an engine, saved the way ``peft`` saves them.

A ``peft.PeftModel`` trains in the engine like any module: its frozen base is sharded at stage 3
with the rest, only the adapter parameters are trainable. Saving is where it differs:

- **Adapters** (the default): ``adapter_model.safetensors`` and ``adapter_config.json``, names
  without the adapter name, exactly what ``PeftModel.save_pretrained`` writes and
  ``PeftModel.from_pretrained`` reads (adapters other than ``default`` go to a sub-folder named
  after them, as peft does). peft's own ``get_peft_model_state_dict`` decides which tensors
  belong to an adapter (``modules_to_save`` heads and resized embeddings included), on rank 0,
  and only those are gathered, so stage 3 never assembles a base weight.
- **Merged** (``merge_adapters=True``, ``hf-zero consolidate --merge-adapters``): full weights
  that ``AutoModelFor*.from_pretrained`` loads, computed by peft's ``merge_and_unload`` on a
  copy of the model rebuilt on the meta device and filled with the gathered weights, so the
  result is peft's by construction and the live model is untouched. The copy holds the whole
  model once, in rank 0's CPU memory.

Resume checkpoints of a PEFT model also hold its adapter configs (written next to the base
model's ``config.json``), so a checkpoint can be turned into either layout offline.

What hf_zero knows of peft models outside the engine (detection, configs, the meta twin) is
:mod:`hf_zero.training.peft_model`, which every layer may import.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_zero.checkpoint.consolidated import (
    OneUnitAtATime,
    checkpoint_weights,
    engine_entries,
    save_model_config,
    write_weights,
)
from hf_zero.checkpoint.format import resolve_tag
from hf_zero.distributed import dist as hz_dist
from hf_zero.errors import UsageError
from hf_zero.training.peft_model import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_dir,
    adapter_plan,
    build_twin,
    copy_adapter_config,
    is_peft_model,
    peft_values,
    read_adapter_configs,
    require_peft,
    twin_from_folder,
    write_adapter_configs,
)

if TYPE_CHECKING:
    from hf_zero.checkpoint.state import TrainState


def save_adapters(state: TrainState, save_directory: str, dtype: torch.dtype | None = None) -> list[str]:
    """Write every adapter of the trained ``PeftModel`` in peft's layout (collective; rank 0 writes).

    Only the adapters' tensors are gathered (one stage-3 parameter group at a time, the base
    never); rank 0 decides what they are and tells the others, since peft may consult the Hub to
    decide whether embeddings are saved. The values are the module's (the compute dtype, as
    DeepSpeed's 16-bit save gives them) unless ``dtype`` says otherwise. Returns the weight files written.
    """

    model = state.module
    rank = dist.get_rank(state.group)
    live = model.state_dict(keep_vars=True)
    plan = adapter_plan(model, live) if rank == 0 else None
    if state.world_size > 1:
        plan = hz_dist.gather_json(plan, state.group)[0]
    assert plan is not None
    order = {name: i for i, name in enumerate(live)}
    computed = [key for pairs in plan.values() for key, src in pairs if not src]
    if computed and state.zero_stage == 3:
        raise UsageError(
            f"cannot save adapter tensor {computed[0]!r} under ZeRO stage 3: peft computes it from the model "
            "rather than storing it (a prompt-learning method); train it at stage 0-2"
        )
    if rank == 0:
        os.makedirs(save_directory, exist_ok=True)
    units = OneUnitAtATime(state)
    files = []
    with torch.no_grad():
        for adapter, pairs in plan.items():
            values: dict[str, torch.Tensor] = {}
            fallback = peft_values(model, adapter) if computed and rank == 0 else {}
            for key, src in sorted(pairs, key=lambda p: order.get(p[1], -1)):  # module order: each unit once
                if not src:
                    if rank == 0:
                        values[key] = fallback[key].detach().to("cpu", copy=True)
                    continue
                t = units.full(live[src])
                if rank == 0:
                    values[key] = t.detach().to("cpu", copy=True)
            if rank == 0:
                if dtype is not None:
                    values = {k: v.to(dtype) if v.is_floating_point() else v for k, v in values.items()}
                out = adapter_dir(save_directory, adapter)
                os.makedirs(out, exist_ok=True)
                files.append(_write_safetensors(values, os.path.join(out, ADAPTER_WEIGHTS)))
    units.release()
    if rank == 0:
        write_adapter_configs(model, save_directory)
    dist.barrier(state.group)
    return files


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str) -> str:
    """One safetensors file, written under a temporary name and renamed when whole (tied copies cloned apart)."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    clean = {}
    for k, v in tensors.items():
        v = v.contiguous()
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        clean[k] = v.clone() if key in seen and v.numel() else v
        seen.add(key)
    tmp = path + ".tmp"
    save_file(clean, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return os.path.basename(path)


def gather_full_state_dict(state: TrainState) -> dict[str, torch.Tensor] | None:
    """The whole module's state dict on rank 0's CPU (None elsewhere), gathered one stage-3 group at a time.

    Tied names share one tensor, as in the model.
    """

    rank = state.layout.rank
    units = OneUnitAtATime(state)
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in state.module.state_dict(keep_vars=True).items():
            full = units.full(t)
            if rank == 0:
                if id(t) not in copies:
                    copies[id(t)] = full.detach().to("cpu", copy=True)
                out[name] = copies[id(t)]
    units.release()
    return out if rank == 0 else None


def save_merged(state: TrainState, save_directory: str, max_shard_size: int | str = "5GB",
                dtype: torch.dtype | None = None) -> list[str]:
    """Full weights with the adapters merged in, as peft's ``merge_and_unload`` computes them (collective; rank 0 writes).

    The live model is not touched: rank 0 merges a copy rebuilt from the gathered weights.
    """
    model = state.module
    if not is_peft_model(model):
        raise UsageError(
            f"merge_adapters=True: the model is a {type(model).__name__}, not a peft PeftModel, so it has no "
            "adapters to merge; save without merge_adapters"
        )
    require_peft("merge_adapters=True")
    weights = gather_full_state_dict(state)
    files: list[str] = []
    error = None
    if weights is not None:
        try:
            base = model.get_base_model()
            twin = build_twin(type(base), base.config, dict(model.peft_config))
            files = _merge_and_write(twin, weights, save_directory, max_shard_size, dtype, list(model.active_adapters))
        except Exception as e:  # the other ranks wait in the barrier below: tell them rather than hang
            error = e
    if state.world_size > 1:

        failed = hz_dist.gather_json(None if error is None else f"{type(error).__name__}: {error}", state.group)[0]
        if failed is not None and error is None:
            raise UsageError(f"rank 0 could not write the merged model: {failed}")
    if error is not None:
        raise error
    return files


def _merge_and_write(twin: Any, state: dict[str, torch.Tensor], save_directory: str, max_shard_size: int | str,
                     dtype: torch.dtype | None, adapter_names: list[str] | None = None) -> list[str]:
    """Fill the meta twin with ``state``, let peft merge the adapters, and write the base model it returns.

    ``adapter_names`` as ``merge_and_unload`` takes them: None merges the active one (the first, in a twin).
    """
    expected = set(twin.state_dict())
    unknown = sorted(set(state) - expected)
    if unknown:
        raise UsageError(f"the saved weights do not fit the model rebuilt from its config: {unknown[0]!r} has no place in it")
    twin.load_state_dict(state, strict=False, assign=True)
    twin.get_base_model().tie_weights()
    merged = twin.merge_and_unload(adapter_names=adapter_names)
    missing = [n for n, t in merged.state_dict().items() if t.is_meta]
    if missing:
        raise UsageError(f"the saved weights do not fill the model rebuilt from its config: {missing[0]!r} is missing")
    entries, tensors = engine_entries(merged, dtype)  # tied duplicates dropped, as save_pretrained does
    tensors = {name: t.detach() for name, t in tensors.items()}
    os.makedirs(save_directory, exist_ok=True)
    files = write_weights(save_directory, entries, tensors.__getitem__, max_shard_size, writer=True)
    floats = [dt for _, dt, _ in entries if dt.is_floating_point]
    save_model_config(merged, save_directory, floats[0] if floats else None)
    return files


# ----------------------------------------------------------------------------- offline


def consolidate(checkpoint_dir: str, out_dir: str, tag: str | None = None, merge: bool = False,
                max_shard_size: int | str = "5GB", dtype: torch.dtype | None = torch.float32) -> list[str]:
    """A PEFT model's resume checkpoint as an adapter folder, or (``merge``) as merged full weights.

    Offline, on a CPU. The adapter folder reads only the adapters' tensors from the checkpoint;
    the merged one reads all of them into memory once, for peft to merge.
    """
    what = "--merge-adapters" if merge else "consolidating a PEFT checkpoint"
    require_peft(what)
    path = resolve_tag(checkpoint_dir, tag)
    adapters = read_adapter_configs(path)
    if not adapters:
        raise UsageError(f"{path} holds no adapter_config.json: it is not a PEFT model's checkpoint; drop --merge-adapters")
    twin = twin_from_folder(path, adapters)
    _, entries, produce = checkpoint_weights(checkpoint_dir, tag, dtype)
    if merge:
        state = {name: produce(name) for name, _, _ in entries}
        return _merge_and_write(twin, state, out_dir, max_shard_size, dtype)
    have = {name for name, _, _ in entries}
    plan = adapter_plan(twin, twin.state_dict(keep_vars=True))
    files = []
    for adapter, pairs in plan.items():
        lost = [src or key for key, src in pairs if src not in have]
        if lost:
            raise UsageError(f"{path} has no tensor {lost[0]!r} of adapter {adapter!r}; was it saved from this model?")
        out = adapter_dir(out_dir, adapter)
        os.makedirs(out, exist_ok=True)
        files.append(_write_safetensors({key: produce(src) for key, src in pairs}, os.path.join(out, ADAPTER_WEIGHTS)))
        copy_adapter_config(adapter_dir(path, adapter), out)
    return files


def is_peft_checkpoint(checkpoint_dir: str, tag: str | None = None) -> bool:
    """Whether a resume checkpoint (its ``latest`` tag, or ``tag``) was saved from a ``PeftModel``."""
    try:
        path = resolve_tag(checkpoint_dir, tag)
    except Exception:
        return False
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
