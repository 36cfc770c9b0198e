"""Loading a resume checkpoint at any world size, ZeRO stage, pipeline layout or tensor-parallel degree.

Every rank computes what it owns (its shard groups' ranges, by parameter name) and reads exactly
that from whichever files hold it (:class:`hf_zero.checkpoint.format.CheckpointReader`). Before
anything is touched, every check (names, shapes, optimizer groups, file checksums) runs on every
rank and the findings are pooled, so a refused checkpoint raises the same sentence on every rank
and leaves the engine as it was; in a pipeline each stage checks what it holds.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_zero.checkpoint.format import (
    CheckpointReader,
    from_json,
    read_meta,
    resolve_tag,
    saved_optimizers,
    set_rng_state,
)
from hf_zero.checkpoint.optim_state import load_optimizer, optimizer_plan
from hf_zero.checkpoint.ranks import gather_findings
from hf_zero.checkpoint.state import Progress, TrainState
from hf_zero.checkpoint.tp_reshard import base_name, install, whole_shapes
from hf_zero.errors import CheckpointError
from hf_zero.parallel.tp_split import checkpoint_name, parse_slice_name, slice_kind, stored_cut, stored_names


def _different_model(path: str, missing: list[str], extra: list[str]) -> str:
    return (f"{path} was saved from a different model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "load it into the same architecture")


def _model_problems(state: TrainState, meta: dict, path: str) -> list[str]:
    """This rank's reasons to refuse the checkpoint's parameter table (names, shapes)."""
    saved_params = meta["params"]
    here = {checkpoint_name(n, p): p for n, p in state.module.named_parameters()}
    problems: list[str] = []
    if _other_split(state, meta):  # another tensor-parallel degree: compared by parameter and whole shape
        saved_whole = whole_shapes(saved_params)
        here_whole = {base_name(k): tuple(_whole_shape(p)) for k, p in here.items()}
        missing = sorted(set(here_whole) - set(saved_whole))
        extra = [] if state.layout.pipe_stage is not None else sorted(set(saved_whole) - set(here_whole))
        if missing or extra:
            return [_different_model(path, missing, extra)]
        for n, shape in here_whole.items():
            if shape != saved_whole[n]:
                return [f"{path}: parameter '{n}' has shape {list(saved_whole[n])} there and {list(shape)} here"]
        return []
    missing = sorted(set(here) - set(saved_params))
    if meta.get("frozen_excluded"):  # saved without its frozen parameters: those frozen here keep the model's values
        missing = [n for n in missing if here[n].requires_grad]
    # the other ranks of this rank's tensor-parallel group hold the other slices
    others = {m for n, p in state.module.named_parameters() for m in stored_names(n, p)}
    extra = sorted(set(saved_params) - others)
    if state.layout.pipe_stage is not None:
        extra = []  # a stage holds part of the model: what no stage holds is known once the names are pooled
    if missing or extra:
        problems.append(_different_model(path, missing, extra))
    if meta.get("frozen_excluded"):
        thawed = [n for n, p in here.items() if p.requires_grad and not saved_params.get(n, {}).get("trainable", True)]
        if thawed:
            problems.append(
                f"{path} was saved with save_checkpoint(exclude_frozen_parameters=True) and holds no values for the "
                f"parameters that were frozen then, but '{thawed[0]}' is trainable here; freeze it as it was before "
                "loading (its value then stays the model's own)")
    for n, p in here.items():
        if n in saved_params and list(p.shape) != saved_params[n]["shape"]:
            problems.append(f"{path}: parameter '{n}' has shape {saved_params[n]['shape']} there and {list(p.shape)} here")
            break
    return problems


def _whole_shape(p: torch.Tensor) -> tuple[int, ...]:
    c = stored_cut(p)
    return c[1].full_shape if c is not None else tuple(p.shape)


def _degrees(names: Any) -> dict[str, int]:
    """The tensor- and expert-parallel degrees a set of stored names was cut at (``{"tp": 2}``; empty: none)."""
    out: dict[str, int] = {}
    for key in names:
        cut = parse_slice_name(key)
        if cut:
            kind = slice_kind(key)
            assert kind is not None
            out[kind] = max(out.get(kind, 1), cut[2])
    return out


def _other_split(state: TrainState, meta: dict) -> bool:
    """Whether the checkpoint's tensor-parallel or expert-parallel degree differs from this run's (its slices are then
    re-cut: EP 2 saved and EP 4 or no EP resumed, tp 2 and dp only, and back)."""
    here = _degrees(checkpoint_name(n, p) for n, p in state.module.named_parameters())
    return _degrees(meta["params"]) != here


def _optimizer_problems(
    state: TrainState, meta: dict, path: str, want_optimizer: bool
) -> tuple[list[dict | None] | None, Any, list[str]]:
    """The saved hyper-parameters per param group, the scheduler state, and a reason to refuse (if any)."""
    stage = state.layout.pipe_stage
    try:
        hypers, sched_state = optimizer_plan(state, meta, path)
        return hypers, sched_state, []
    except CheckpointError as e:
        if want_optimizer:
            return None, None, [str(e)]
        saved = saved_optimizers(meta)  # only the scheduler is wanted: this stage's (or the one) as saved
        return None, saved[stage if stage is not None and stage < len(saved) else 0]["lr_scheduler"], []


def optimizer_state_file(path: str, optimizer: Any) -> str | None:
    """The file of checkpoint folder ``path`` this rank reads its optimizer state from, or None if it reads none.

    The one holding the first element range of the masters this rank owns: in the layout of the save (world
    size, ZeRO stage) all of the rank's optimizer state is there (its own file, at stage 0 the first rank's);
    in another the ranges come from whichever ranks' files hold them, this the first of them.
    """
    reader = CheckpointReader(path, int(read_meta(path)["world_size"]))
    kinds = sorted({kind for kind, _ in reader.index if kind.startswith("optim.")})
    for g in optimizer.groups:
        for r in g.owned() if g.master is not None else ():
            for kind in kinds:
                for fname, _key, a, b in reader.index.get((kind, r.slot.name), ()):
                    if max(a, r.lo) < min(b, r.hi):
                        return os.path.join(path, fname)
    return None


def _held(reader: CheckpointReader, name: str) -> bool:
    """Whether the checkpoint holds values of parameter ``name`` (frozen or trained)."""
    return ("frozen", name) in reader.index or ("master", name) in reader.index


def _restore_weights(state: TrainState, reader: CheckpointReader, frozen_excluded: bool = False) -> None:
    """Masters (and frozen shards) of every shard group, whole frozen parameters, buffers; then publish.

    ``frozen_excluded`` (a checkpoint saved with ``exclude_frozen_parameters=True``): the frozen parameters
    keep the values they have (the model's own), the checkpoint holding none for them."""
    zo = state.optimizer
    assert zo is not None
    zo.release_inference()
    grouped: set[int] = set()
    requests: list[tuple[str, str, int, int, torch.Tensor]] = []  # read into place, the files side by side
    for g in zo.groups:
        values = g.owned_values()
        for r in g.owned():
            if frozen_excluded and not g.trainable and not _held(reader, r.slot.name):
                continue
            kind = "master" if g.trainable or ("frozen", r.slot.name) not in reader.index else "frozen"
            requests.append((kind, r.slot.name, r.lo, r.hi, values[r.at : r.at + r.hi - r.lo]))
        grouped.update(id(s.param) for s in g.slots)
    for name, p in state.module.named_parameters():
        if id(p) in grouped:
            continue
        name = checkpoint_name(name, p)
        if frozen_excluded and not p.requires_grad and not _held(reader, name):
            continue
        kind = "frozen" if ("frozen", name) in reader.index else "master"
        requests.append((kind, name, 0, p.numel(), p.data))
    reader.read_many(requests)
    for name, b in state.module.state_dict(keep_vars=True).items():
        if not isinstance(b, torch.nn.Parameter) and torch.is_tensor(b) and name in reader.buffers:
            b.copy_(reader.tensor(*reader.buffers[name]))
    for g in zo.groups:
        g.publish_master(None)


def _restore_progress(state: TrainState, meta: dict, reader: CheckpointReader) -> Progress:
    """The loss scaler, RNG streams and the data position, restored in place; the counters, returned."""
    if state.loss_scaler is not None and meta["loss_scaler"] is not None:
        state.loss_scaler.load_state_dict(meta["loss_scaler"])
    global_steps = int(meta["global_steps"])
    # Saved on an accumulation boundary; with a different accumulation count (another world size
    # keeping the global batch) the micro-step counter restarts from that boundary.
    gas = state.gradient_accumulation_steps
    same_gas = int(meta.get("gradient_accumulation_steps", 1)) == gas
    progress = Progress(
        global_steps=global_steps,
        micro_steps=int(meta["micro_steps"]) if same_gas else global_steps * gas,
        global_samples=int(meta["global_samples"]),
        skipped_steps=int(meta["skipped_steps"]),
    )
    # Each rank's random streams come back to the rank that had them only in the same layout.
    lay = state.layout
    same_layout = (meta.get("pipeline") or {}).get("num_stages") == lay.num_stages
    src = lay.rank if int(meta["world_size"]) == lay.world and same_layout else 0
    rng_keys = [k for k in reader.rank_meta[src]["files"] if k.startswith("rng.")]
    set_rng_state({k: reader.tensor(src, k) for k in rng_keys}, reader.rank_meta[src]["rng"], state.device)
    sampler = state.sampler
    saved_sampler = reader.rank_meta[0]["sampler"]
    if saved_sampler is not None and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(saved_sampler)
    return progress


def load(
    state: TrainState,
    load_dir: str,
    tag: str | None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str, dict, Progress | None]:
    """Restore ``state`` from a checkpoint of any world size and stage; collective.

    The weights, optimizer state, scheduler, loss scaler, RNG streams and sampler are restored in
    place (they are the engine's own objects); returns ``(path, client_state, progress)``, the
    counters for the engine to take (None with ``load_module_only``).
    """
    path = resolve_tag(load_dir, tag)
    meta = read_meta(path)
    lay = state.layout
    problems = _model_problems(state, meta, path)
    if lay.pipe_stage is None and problems:  # every rank holds the whole model: every rank finds the same
        raise CheckpointError(problems[0])
    if state.optimizer is None:
        raise CheckpointError("load_checkpoint needs an engine with an optimizer")
    hypers: list[dict | None] | None = None
    sched_state: Any = None
    if not load_module_only and not problems and (load_optimizer_states or load_lr_scheduler_states):
        hypers, sched_state, refused = _optimizer_problems(state, meta, path, load_optimizer_states)
        problems += refused
    reader = CheckpointReader(path, int(meta["world_size"]))
    # a pipeline stage's stored names (a tensor-parallel slice: every rank's of its group), pooled to find what no
    # stage holds
    names = (sorted({m for n, p in state.module.named_parameters() for m in stored_names(n, p)})
             if lay.pipe_stage is not None and lay.dp_rank == 0 else None)
    # JSON in tensors: loading a checkpoint never unpickles
    errors, held = gather_findings(problems + reader.damaged(lay.rank, lay.world), names, lay.group)
    if lay.pipe_stage is not None and not errors:
        pooled = {base_name(n) for part in held for n in (part or [])}
        extra = sorted({base_name(n) for n in meta["params"]} - pooled)
        if extra:
            errors.append(_different_model(path, [], extra))
    if errors:  # every rank raises the same sentence, before anything was loaded
        raise CheckpointError(errors[0])
    if _other_split(state, meta):  # each rank's slices re-cut from the saved ones (or whole from the slices)
        install(reader, meta["params"], {checkpoint_name(n, p): (c[1] if (c := stored_cut(p)) else None)
                                         for n, p in state.module.named_parameters()})
    with torch.no_grad():
        _restore_weights(state, reader, bool(meta.get("frozen_excluded")))
    if hypers is not None and load_optimizer_states:
        load_optimizer(state, reader, hypers)
    progress = None
    if not load_module_only:
        if load_lr_scheduler_states and state.lr_scheduler is not None and sched_state is not None:
            state.lr_scheduler.load_state_dict(from_json(sched_state))
        progress = _restore_progress(state, meta, reader)
    return path, from_json(meta["client_state"]), progress
