"""Saving a resume checkpoint: each rank writes what it owns, rank 0 publishes the whole.

The order of one save (every rank calls :func:`save`):

1. every rank checks what it will store (client state, the optimizer and parameter table) and
   the ranks agree (:mod:`hf_zero.checkpoint.ranks`) before anything is written;
2. rank 0 makes ``.<tag>.partial`` (removing what crashed saves left);
3. every rank writes its share (:func:`write_share`): the master elements it owns by name and
   range, the matching optimizer state, frozen parameters and buffers (once per replica set),
   its RNG state and its JSON index;
4. rank 0 writes ``checkpoint.json`` and publishes (:func:`hf_zero.checkpoint.atomic.publish`),
   then rotates old checkpoints away.

The format is :mod:`hf_zero.checkpoint.format`'s; a failure anywhere raises the same sentence on
every rank, removes the half-written folder and leaves the previous checkpoints as they were.

The random streams (torch's CPU and CUDA generators, Python's ``random``, NumPy's global RandomState) are
read once, when :func:`save` is called, and are what both paths store; whatever the save itself does
(collectives, the writers' gloo group and pinned host buffers of the first background save, a library's
call that draws from a global stream) comes after that read and is undone when it returns, so a
background save stores the synchronous save's streams, and the run goes on drawing what a resume from
the checkpoint draws.

With ``checkpoint.async_save`` steps 1 and 2 are the same; step 3 copies each rank's share into host
buffers kept between saves, and a thread does the writing and step 4
(:mod:`hf_zero.checkpoint.background`). A share is planned as views of what the rank stores
(:func:`plan_share`) before it is copied, so both paths store the same bytes.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.checkpoint import atomic, consolidated
from hf_zero.checkpoint.background import BackgroundWriter, WriteJob
from hf_zero.checkpoint.fileio import io_threads, nbytes, write_file
from hf_zero.checkpoint.format import (
    FORMAT,
    LATEST,
    MAX_FILE_BYTES,
    META,
    MIN_FILE_BYTES,
    io_pool,
    io_submit,
    moved_streams,
    rank_file_name,
    rank_meta_name,
    rng_state,
    set_rng_state,
    to_json,
)
from hf_zero.checkpoint.ranks import CheckpointLayout, agree, attempt, pool
from hf_zero.checkpoint.state import TrainState
from hf_zero.distributed.dist import gather_json
from hf_zero.errors import CheckpointError, CheckpointTagError
from hf_zero.parallel.tp_split import checkpoint_name, stored_names, table_entry
from hf_zero.zero.group import subgroup_of

logger = logging.getLogger("hf_zero")


def optimizer_table(state: TrainState) -> dict[str, Any]:
    """The parameter table, optimizer param groups (hyper-parameters and names) and scheduler, as JSON.

    A pipeline stage has an optimizer of its own, so a pipeline checkpoint keeps one per stage.
    """
    zo = state.optimizer
    assert zo is not None
    groups_meta = [
        {k: to_json(v, f"optimizer param group '{k}'") for k, v in pg.items() if k != "params"}
        for pg in zo.optimizer.param_groups
    ]
    # A tensor-parallel slice is listed under every rank's name (each rank stores its own; hf_zero/parallel/tp_split.py).
    mine = {checkpoint_name(n, p): (n, p) for n, p in state.module.named_parameters()}
    names_of = lambda key: stored_names(*mine[key]) if key in mine else [key]  # noqa: E731
    group_names = [[m for n in names for m in names_of(n)] for names in zo.group_names]
    group_of = {n: gi for gi, names in enumerate(group_names) for n in names}
    sched = state.lr_scheduler
    return {
        "param_groups": groups_meta,
        "group_names": group_names,
        "lr_scheduler": to_json(sched.state_dict(), "lr_scheduler state")
        if sched is not None and hasattr(sched, "state_dict") else None,
        "params": {
            k: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "trainable": p.requires_grad,
                "group": group_of.get(k), **table_entry(p, k)}
            for n, p in state.module.named_parameters() for k in stored_names(n, p)
        },
        "shared": shared_names(state.module),
    }


def shared_names(module: torch.nn.Module) -> dict[str, str]:
    """A tied parameter's other names -> the name it is stored under (its first), so that an offline reader can give it
    under each name as one tensor (DeepSpeed's ``zero_to_fp32`` does; ``torch.load`` of its ``pytorch_model.bin`` has both)."""
    first: dict[int, str] = {}
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


def agreed_tag(tags: list[str], mode: str, rank: int) -> str:
    """The one tag every rank writes, from every rank's ``tags`` (by rank), as ``checkpoint.tag_validation`` says.

    A checkpoint is one folder that every rank writes into and rank 0 publishes, so ranks cannot each
    keep a tag of their own as DeepSpeed's ranks do (its ``Warn`` and ``Ignore`` then save under
    several tags). ``Fail`` refuses different tags on every rank; ``Warn`` (the default) names them and
    saves under rank 0's; ``Ignore`` saves under rank 0's without a word.
    """
    if all(t == tags[0] for t in tags):
        return tags[0]
    r = next(r for r, t in enumerate(tags) if t != tags[0])
    differ = f"rank 0 passed tag {tags[0]!r} and rank {r} passed {tags[r]!r}"
    if mode == "Fail":
        raise CheckpointTagError(
            f"save_checkpoint: the checkpoint tag is not the same on every rank ({differ}) and the config's "
            'checkpoint.tag_validation is "Fail"; pass one tag on every rank (leave out anything rank-specific)'
        )
    if mode == "Warn" and rank == 0:
        logger.warning("save_checkpoint: the checkpoint tag is not the same on every rank (%s); saving under rank 0's "
                       "tag %r (set checkpoint.tag_validation to \"Fail\" to refuse instead)", differ, tags[0])
    return tags[0]


def _checked_tag(state: TrainState, tag: str | None) -> str:
    """The tag to write (``global_step<N>`` by default), after the checks every rank makes alike."""
    if state.optimizer is None:
        raise CheckpointError("save_checkpoint needs an engine with an optimizer")
    micro, gas = state.progress.micro_steps, state.gradient_accumulation_steps
    if micro % gas != 0 and state.layout.rank == 0:
        # DeepSpeed saves here too (its tutorial's loop saves every N micro-batches); what it writes is the last
        # boundary's state, and so is hf_zero's (checkpoint_meta writes that boundary's micro-step count)
        logger.warning(
            "save_checkpoint in the middle of gradient accumulation (micro step %d, accumulation %d): the checkpoint "
            "holds the weights and optimizer state of global step %d; the %d micro-batches accumulated since are not "
            "in it, and a run resumed from it starts a new accumulation window there, as DeepSpeed's does",
            micro, gas, state.progress.global_steps, micro % gas)
    tag = str(tag) if tag is not None else f"global_step{state.progress.global_steps}"
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"save_checkpoint(tag={tag!r}): a tag must be a plain, non-hidden directory name other than '{LATEST}'")
    return tag


def save(
    state: TrainState, save_dir: str, tag: str | None, client_state: dict | None, save_latest: bool = True,
    keep_last: int | None = None, background: BackgroundWriter | None = None, exclude_frozen: bool = False,
) -> str:
    """Write a resume checkpoint of ``state``; collective (every rank calls it). Returns its path.

    ``exclude_frozen`` leaves the parameters nothing trains out of it (their values: the table still lists
    them, and the checkpoint says they were left out), so that a load keeps the model's own values for them.

    A failure on any rank (a full disk, a state JSON cannot hold) raises on every rank after the
    ranks agree on it, so none is left waiting; the half-written folder is removed and the
    previous checkpoints and ``latest`` stay as they were. With ``background`` (whose previous save
    the caller has waited for) every check and the copy to host memory happen here and a thread
    writes and publishes (:mod:`hf_zero.checkpoint.background`); the path is then where the
    checkpoint will be once that is done.
    """
    streams = rng_state(state.device)  # this step's random streams, before anything the save does (module docstring)
    try:
        return _save(state, save_dir, tag, client_state, save_latest, keep_last, background, exclude_frozen, streams)
    finally:
        moved = moved_streams(*streams, state.device)
        if moved:
            set_rng_state(*streams, state.device)
            if not _moved_warned.intersection(moved):
                logger.warning("save_checkpoint: %s moved while the checkpoint was being saved (a call in the save "
                               "path drew from it); put back to the state the checkpoint stores, so the run goes on "
                               "as a resume from it does", ", ".join(_STREAM_NAMES.get(k, k) for k in moved))
            _moved_warned.update(moved)


#: The streams :func:`save` has warned about moving (once each per process).
_moved_warned: set[str] = set()
_STREAM_NAMES = {"rng.torch_cpu": "torch's CPU generator", "rng.torch_cuda": "torch's CUDA generator",
                 "python": "Python's random", "numpy": "NumPy's global RandomState"}


def _save(
    state: TrainState, save_dir: str, tag: str | None, client_state: dict | None, save_latest: bool,
    keep_last: int | None, background: BackgroundWriter | None, exclude_frozen: bool, streams: tuple[dict, dict],
) -> str:
    """:func:`save` once the random streams are read (``streams``, as :func:`rng_state` returns them)."""
    lay = state.layout
    group, rank = lay.group, lay.rank
    # The tag, the client state and the optimizer and parameter table (one per stage in a pipeline) are
    # made and checked on every rank before anything is written, so a state that cannot be stored (a
    # param group value JSON cannot hold, a scheduler whose state_dict fails) or a tag one rank refuses
    # stops every rank with the same sentence instead of rank 0 alone, after the others are already waiting.
    tag, err = attempt(lambda: _checked_tag(state, tag))
    client: Any = None
    if err is None:
        client, err = attempt(lambda: to_json(client_state or {}, "client_state"))
    mine = None
    if err is None:
        mine, err = attempt(lambda: optimizer_table(state) if lay.pipe_stage is None or lay.dp_rank == 0 else None)
    pooled = gather_json({"table": mine if lay.pipe_stage is not None else None, "error": err, "tag": tag}, group)
    agree([p["error"] for p in pooled], save_dir)
    tag = agreed_tag([p["tag"] for p in pooled], state.config.checkpoint_tag_validation, rank)
    partial = atomic.partial_dir(save_dir, tag)
    stage_tables = [p["table"] for p in pooled if p["table"] is not None]  # rank order is stage order
    table = stage_tables[0] if stage_tables else mine

    err = attempt(lambda: _start(save_dir, partial))[1] if rank == 0 else None
    agree(pool(err, group), save_dir)
    if background is not None:
        _launch(state, background, save_dir, tag,
                lambda: checkpoint_meta(state, table, stage_tables, client, exclude_frozen), save_latest, keep_last,
                exclude_frozen, streams)
        return os.path.join(save_dir, tag)
    errors = pool(attempt(lambda: write_share(state, partial, exclude_frozen, streams))[1], group)
    if any(errors):  # a full disk on one rank must not leave the others waiting
        if rank == 0:  # free the space the half-written checkpoint took, before anyone returns
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier(group)
        agree(errors, save_dir)
    err = None
    if rank == 0:
        meta = lambda: checkpoint_meta(state, table, stage_tables, client, exclude_frozen)  # noqa: E731
        err = attempt(lambda: _finish(state, meta(), save_dir, tag, save_latest, keep_last))[1]
        if err is not None:
            shutil.rmtree(partial, ignore_errors=True)  # not published; a tag moved aside comes back on the next save
    agree(pool(err, group), save_dir)
    return os.path.join(save_dir, tag)


def _launch(
    state: TrainState, background: BackgroundWriter, save_dir: str, tag: str,
    meta: Callable[[], dict], save_latest: bool, keep_last: int | None, exclude_frozen: bool = False,
    streams: tuple[dict, dict] | None = None,
) -> None:
    """A background save, once the partial folder exists: plan, check host memory, copy, then hand over to the thread.

    ``streams``: the random streams as :func:`save` read them on entry (read here when not given)."""
    lay = state.layout
    group, rank, partial = lay.group, lay.rank, atomic.partial_dir(save_dir, tag)

    def refuse(errors: list[str | None]) -> None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if lay.world > 1:
            dist.barrier(group)
        agree(errors, save_dir)

    share, err = attempt(lambda: plan_share(state, exclude_frozen))
    plan = share.pop("tensors") if share is not None else {}
    errors = background.prepare(plan, err, group, lay.world, rank)
    if any(errors):
        refuse(errors)
    assert share is not None

    def copy() -> tuple:
        tensors, event = background.copy(plan)
        # the streams read when save() was called, as a synchronous save stores them: not here, after the writers'
        # group, the host buffers and the memory check, any of which may run a library call that draws
        rng_tensors, rng_meta = streams if streams is not None else rng_state(state.device)
        tensors = {k: (v, v.dtype) for k, v in {**tensors, **rng_tensors}.items()}  # host copies, stored as they are
        return tensors, event, rank_index(state, share, rng_meta), meta() if rank == 0 else None

    copied, err = attempt(copy)
    errors = pool(err, group)
    if any(errors):
        refuse(errors)
    assert copied is not None
    tensors, event, rank_meta, checkpoint_json = copied
    background.start(WriteJob(
        tensors=tensors, rank_meta=rank_meta, event=event, path=os.path.join(save_dir, tag), save_dir=save_dir,
        partial=partial, rank=rank, write=lambda: write_rank(tensors, rank_meta, partial, rank),
        finish=(lambda: _finish(state, checkpoint_json, save_dir, tag, save_latest, keep_last)) if rank == 0 else None,
    ))


def _start(save_dir: str, partial: str) -> None:
    """Rank 0: the folder, cleared of crashed earlier saves (at this tag or any other), and an empty partial."""
    os.makedirs(save_dir, exist_ok=True)
    atomic.clean_leftovers(save_dir)
    os.makedirs(partial)


# ------------------------------------------------------------------- one rank's share
#
# A share is planned first as views of what this rank stores (device or host tensors, with the dtype
# each is stored in) and copied out after: a synchronous save copies each view into a fresh host
# tensor, a background one (hf_zero/checkpoint/background.py) into host buffers it keeps between saves.

Plan = dict[str, tuple[torch.Tensor, torch.dtype]]


def _group_tensors(g: Any, opt_state: dict, lay: CheckpointLayout, out: dict[str, Any], exclude_frozen: bool) -> None:
    """The elements of one shard group this rank owns: master and optimizer state (or a frozen shard), by name and range."""
    values = g.owned_values()
    state = opt_state.get(g.master, {}) if g.master is not None else {}
    tensors, ranges, scalars = out["tensors"], out["ranges"], out["scalars"]
    for r in g.owned():
        name, a, b, m = r.slot.name, r.lo, r.hi, r.at
        if id(r.slot.param) in lay.others:
            continue  # a tied weight: the first stage holding it stores it
        n = b - a
        if g.master is None:  # a frozen stage-3 group: its shard holds the values
            if exclude_frozen:
                continue
            view = values.detach()[m : m + n]
            tensors[f"frozen|{name}"] = (view, view.dtype)
            ranges[f"frozen|{name}"] = [name, a, b]
            continue
        tensors[f"master|{name}"] = (values.detach()[m : m + n], torch.float32)
        ranges[f"master|{name}"] = [name, a, b]
        for k, v in state.items():
            if torch.is_tensor(v) and v.numel() == values.numel() and v.numel() > 1:
                tensors[f"optim.{k}|{name}"] = (v.detach()[m : m + n], v.dtype)
                ranges[f"optim.{k}|{name}"] = [name, a, b]
            elif torch.is_tensor(v) and v.numel() <= 1:
                scalars.setdefault(name, {})[k] = {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch."),
                                                   **({"shape": list(v.shape)} if v.dim() else {})}
            else:
                scalars.setdefault(name, {})[k] = {"value": to_json(v, f"optimizer state '{k}'")}


def plan_share(state: TrainState, exclude_frozen: bool = False) -> dict[str, Any]:
    """What this rank stores, as views (``tensors``: key -> (view, stored dtype)), with its ranges and scalar state.

    ``exclude_frozen``: no ``frozen`` values (``save_checkpoint(exclude_frozen_parameters=True)``)."""
    zo, lay = state.optimizer, state.layout
    assert zo is not None
    out: dict[str, Any] = {"tensors": {}, "ranges": {}, "scalars": {}}
    for g in zo.groups:
        # stage 0: every rank holds the same values, the first stores them; hybrid sharding: replica 0's ranks store;
        # an expert-parallel group: the first rank of its expert-data-parallel group (each EP rank's experts differ)
        sub = subgroup_of(g.slots[0].param) if g.slots else None
        first_of_sub = sub is not None and g.place.rank == 0
        if (g.partitioned and lay.stores_shards) or lay.dp_rank == 0 or (not g.partitioned and first_of_sub):
            _group_tensors(g, zo.optimizer.state, lay, out, exclude_frozen)
    grouped = {id(s.param) for g in zo.groups for s in g.slots} | lay.others
    for name, p in () if exclude_frozen else state.module.named_parameters():
        # frozen and whole on every rank (of the stage), stored by the first; an EP rank's frozen experts by the first
        # rank of its expert-data-parallel group
        if id(p) not in grouped and (lay.dp_rank == 0 or _first_of_subgroup(p)):
            key = checkpoint_name(name, p)
            out["tensors"][f"frozen|{key}"] = (p.detach().reshape(-1), p.dtype)
            out["ranges"][f"frozen|{key}"] = [key, 0, p.numel()]
    if lay.dp_rank == 0:
        for name, b in state.module.state_dict(keep_vars=True).items() if lay.tp_rank == 0 else ():
            if not isinstance(b, torch.nn.Parameter) and torch.is_tensor(b):
                out["tensors"][f"buffer|{name}"] = (b.detach(), b.dtype)
    return out


def _first_of_subgroup(p: torch.Tensor) -> bool:
    """Whether ``p`` is sharded over a sub-group (an EP rank's experts) of which this rank is the first."""
    sub = subgroup_of(p)
    return sub is not None and dist.get_rank(sub.group) == 0


def plan_bytes(plan: Plan) -> int:
    """Host bytes the copy of a planned share takes."""
    return sum(v.numel() * torch.empty((), dtype=d).element_size() for v, d in plan.values())


def split_files(sizes: list[int], threads: int) -> list[list[int]]:
    """Indices of ``sizes`` (bytes, in order) cut into consecutive files of near-equal size, written side by side.

    As many files as there are I/O threads, while each keeps at least :data:`MIN_FILE_BYTES` (a small share is one
    file), and never over :data:`MAX_FILE_BYTES` unless one tensor alone is larger.
    """
    total = sum(sizes)
    n = max(-(-total // MAX_FILE_BYTES), min(threads, total // MIN_FILE_BYTES), 1)
    target = -(-total // n)
    files: list[list[int]] = [[]]
    size = 0
    for i, b in enumerate(sizes):
        if files[-1] and (size + b > MAX_FILE_BYTES or size >= target):
            files.append([])
            size = 0
        files[-1].append(i)
        size += b
    return files


def write_files(tensors: dict[str, tuple[torch.Tensor, torch.dtype]], partial: str,
                 rank: int) -> tuple[dict[str, str], dict[str, str]]:
    """Write (key -> (tensor, stored dtype)) as this rank's files, side by side on :func:`io_threads` threads.

    Each file streams its tensors from where they are (device tensors through a small host buffer, never a host
    copy of the whole share), hashes the bytes it writes and is fsynced (:func:`hf_zero.checkpoint.fileio.write_file`).
    Returns which file holds each key and each file's sha256.
    """
    keys = list(tensors)
    if any(t.device.type == "cuda" for t, _ in tensors.values()):
        torch.cuda.synchronize()  # the writing threads copy on their own (default) streams
    threads = io_threads()
    parts = split_files([nbytes(*tensors[k]) for k in keys], threads)
    files: dict[str, str] = {}
    pending = {}
    with io_pool(len(parts)) as io:
        for index, part in enumerate(parts):
            fname = rank_file_name(rank, index)
            items = [(keys[i], *tensors[keys[i]]) for i in part]
            pending[fname] = io_submit(io, write_file, os.path.join(partial, fname), items, {"format": FORMAT})
            files.update({keys[i]: fname for i in part})
        digests = {fname: done.result() for fname, done in pending.items()}
    return files, digests


def rank_index(state: TrainState, share: dict[str, Any], rng_meta: dict) -> dict[str, Any]:
    """This rank's JSON index, less the files and their digests (known once they are written)."""
    sampler = state.sampler
    rank_meta = {
        "ranges": share["ranges"],
        "scalars": share["scalars"],
        "rng": rng_meta,
        "sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else None,
    }
    if state.layout.pipe_stage is not None:
        rank_meta["stage"] = state.layout.pipe_stage  # the format's key (hf_zero/checkpoint/format.py)
    return rank_meta


def write_rank(tensors: dict[str, tuple[torch.Tensor, torch.dtype]], rank_meta: dict[str, Any], partial: str, rank: int) -> None:
    """Write one rank's tensors (key -> (tensor, stored dtype)), then its index (which names the files and their sha256)."""
    files, digests = write_files(tensors, partial, rank)
    atomic.write_json(os.path.join(partial, rank_meta_name(rank)), {"files": files, "sha256": digests, **rank_meta})


def write_share(state: TrainState, partial: str, exclude_frozen: bool = False,
                streams: tuple[dict, dict] | None = None) -> None:
    """This rank's part of a checkpoint: its shards, optimizer state and RNG in safetensors, and its index.

    ``streams``: the random streams as :func:`save` read them on entry (read here when not given)."""
    share = plan_share(state, exclude_frozen)
    tensors = share.pop("tensors")  # written from where they are, a file's worth of chunks at a time
    rng_tensors, rng_meta = streams if streams is not None else rng_state(state.device)
    tensors.update({k: (v, v.dtype) for k, v in rng_tensors.items()})
    write_rank(tensors, rank_index(state, share, rng_meta), partial, state.layout.rank)


# ----------------------------------------------------------------------- publishing


def checkpoint_meta(state: TrainState, table: dict, stage_tables: list[dict], client: Any,
                    exclude_frozen: bool = False) -> dict:
    """``checkpoint.json``: the counters, scaler and tables (a pipeline's per stage) and the client state."""
    lay, progress = state.layout, state.progress
    meta = {
        "format": FORMAT,
        "world_size": lay.world,
        "zero_stage": state.zero_stage,
        "compute_dtype": str(state.compute_dtype).removeprefix("torch."),
        "global_steps": progress.global_steps,
        # the last accumulation boundary's count: a save between boundaries holds that boundary's state
        "micro_steps": progress.micro_steps - progress.micro_steps % state.gradient_accumulation_steps,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        "global_samples": progress.global_samples,
        "skipped_steps": progress.skipped_steps,
        "loss_scaler": state.loss_scaler.state_dict() if state.loss_scaler is not None else None,
        "lr_scheduler": table["lr_scheduler"],
        "optimizer": {"type": type(state.torch_optimizer).__name__, "param_groups": table["param_groups"]},
        "params": table["params"],
        "client_state": client,
    }
    if table.get("shared") and not stage_tables:  # a pipeline's ties across stages are its own (format.py)
        meta["shared"] = table["shared"]
    if exclude_frozen:
        meta["frozen_excluded"] = True  # the frozen parameters' values are not in it (hf_zero/checkpoint/format.py)
    if stage_tables:
        params: dict[str, Any] = {}
        for s, t in enumerate(stage_tables):
            for n, info in t["params"].items():
                params.setdefault(n, {**info, "stage": s})  # a tied weight: recorded at its first stage
        meta["params"] = params
        meta["pipeline"] = {
            "num_stages": lay.num_stages,
            "data_parallel": lay.dp,
            "stages": [{k: t[k] for k in ("param_groups", "group_names", "lr_scheduler")} for t in stage_tables],
        }
    return meta


def _finish(state: TrainState, meta: dict, save_dir: str, tag: str, save_latest: bool, keep_last: int | None) -> None:
    """Rank 0, once every rank's share is on disk: the checkpoint's index, then the renames that publish it."""
    partial = atomic.partial_dir(save_dir, tag)
    consolidated.save_model_config(state.module, partial, None)  # so `hf-zero consolidate` can write config.json
    atomic.write_json(os.path.join(partial, META), meta)
    atomic.publish(save_dir, tag, save_latest)
    if keep_last is not None:
        atomic.rotate(save_dir, keep_last, tag)
