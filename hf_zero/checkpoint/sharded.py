"""Resume checkpoints: what each rank owns, by parameter name, in safetensors + JSON.

Layout of ``<save_dir>/<tag>/``::

    checkpoint.json            written by rank 0: counters, scaler, scheduler, optimizer hyper-
                               parameters, the parameter table (name, shape, dtype, group) and
                               the client state
    rank00000.json             per rank: which elements of which parameter each tensor holds,
                               RNG states, data-loader position
    rank00000-000.safetensors  per rank: the fp32 master elements this rank owns, the matching
                               optimizer state, frozen parameters, buffers (rank 0), RNG tensors

Nothing is stored by flat-buffer position: every tensor is "elements [a, b) of parameter
``name`` (flattened)". A run with any world size and any ZeRO stage computes which elements it
owns and reads exactly those from whichever files hold them, so resharding needs no conversion
step, and a pipeline layout (which only changes who owns what) fits the same format.

Pipelines (a ``PipelineEngine``): every rank of the world writes its own ``rankNNNNN`` files (by
global rank), holding its stage's parameters under the model's own names; ``checkpoint.json``
carries the parameter table of every stage and, under ``"pipeline"``, each stage's optimizer
param groups and scheduler state (stages have optimizers of their own). A tied weight (held by
several stages under one name) is stored once, by the first stage holding it, and read back by
every stage holding it. Since nothing is stored by stage either, a pipeline checkpoint loads at
another data-parallel degree or number of stages, and into a plain ``ZeroEngine`` of the same
model (and the other way round): each rank reads the names and ranges it owns.

Atomic: every rank writes into ``.<tag>.partial/``; after a barrier rank 0 writes
``checkpoint.json`` last, fsyncs, renames the directory to ``<tag>`` and only then replaces
``latest``. A crash at any point leaves the previous checkpoint and ``latest`` untouched; the
next save into the folder removes what the crash left (``.<tag>.partial`` and friends).

Rotation (``keep_last=N``): only after the new checkpoint is complete and ``latest`` points at it,
rank 0 removes all but the N newest checkpoints (by ``global_steps``, then time), never the one
``latest`` names. A removed checkpoint is first renamed to a hidden ``.<tag>.deleting``, so a
crash halfway through a deletion never leaves a half-deleted folder that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hf_zero.errors import CheckpointError

FORMAT = "hf_zero.resume/1"
LATEST = "latest"
MAX_FILE_BYTES = 2 * 2**30
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


@dataclass
class _Layout:
    """Which ranks write one checkpoint together, and what this rank stores of what it holds.

    Without a pipeline: the engine's group, ranks numbered within it. With one: the whole world
    (each stage holds other parameters), files numbered by global rank; replicated values (ZeRO
    stage 0, frozen parameters, buffers) are stored by data-parallel rank 0 of each stage, and a
    tied weight only by the first stage holding it.
    """

    group: Any
    rank: int
    world: int
    dp_rank: int
    stage: int | None = None
    num_stages: int | None = None
    dp: int = 1
    others: set[int] = field(default_factory=set)  # ids of tied parameters another stage stores


def _layout(engine: Any) -> _Layout:
    from hf_zero.pipe.module import PipelineModule

    module = engine.module
    dp_rank = dist.get_rank(engine.group)
    if isinstance(module, PipelineModule):
        others = {id(w) for w, _, first in module.tied_weights() if not first}
        return _Layout(None, dist.get_rank(), dist.get_world_size(), dp_rank, module.stage_id, module.num_stages,
                       module.topology.dp, others)
    world = dist.get_world_size(engine.group)
    return _Layout(engine.group, dp_rank, world, dp_rank, dp=world)


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonable(obj: Any, where: str) -> Any:
    """Scheduler and client state as JSON; tensors become lists; anything else is an error."""
    if isinstance(obj, (str, bool, int, float)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, f"{where}.{k}") for k, v in obj.items()}
    raise CheckpointError(
        f"{where} is of type {type(obj).__name__}, which a checkpoint cannot store without pickle; "
        "keep it to numbers, strings, lists, dicts and tensors"
    )


def _unjson(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        return {k: _unjson(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unjson(v) for v in obj]
    return obj


def _rng_state(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.torch_cuda"] = torch.cuda.get_rng_state(device)
    py = random.getstate()
    npst = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
    }
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if device.type == "cuda" and "rng.torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.torch_cuda"], device)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# ---------------------------------------------------------------------- save


_LEFTOVERS = (".partial", ".old", ".deleting")


def _clean_leftovers(save_dir: str) -> None:
    """Remove what a crashed save or rotation left; put back a tag caught between its two renames."""
    for name in os.listdir(save_dir):
        full = os.path.join(save_dir, name)
        if not (name.startswith(".") and name.endswith(_LEFTOVERS) and os.path.isdir(full)):
            continue
        if name.endswith(".old"):
            tag = name[1 : -len(".old")]
            if tag and not os.path.exists(os.path.join(save_dir, tag)):
                os.replace(full, os.path.join(save_dir, tag))  # the crash came before its replacement arrived
                continue
        shutil.rmtree(full, ignore_errors=True)


def _read_latest(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


def rotate(save_dir: str, keep_last: int, current: str) -> list[str]:
    """Remove all but the ``keep_last`` newest checkpoints of ``save_dir``; returns the tags removed.

    Never removes ``current`` or the tag ``latest`` names; folders that are not hf_zero
    checkpoints (no readable ``checkpoint.json`` of this format) are not touched.
    """
    found = []
    for name in os.listdir(save_dir):
        meta_path = os.path.join(save_dir, name, "checkpoint.json")
        if name.startswith(".") or not os.path.isfile(meta_path):
            continue
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("format") != FORMAT:
                continue
            found.append((int(meta["global_steps"]), os.path.getmtime(meta_path), name))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    found.sort(reverse=True)
    keep = {name for _, _, name in found[:keep_last]} | {current, _read_latest(save_dir)}
    removed = []
    for _, _, name in found:
        if name in keep:
            continue
        hidden = os.path.join(save_dir, f".{name}.deleting")
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(os.path.join(save_dir, name), hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(name)
    if removed:
        _fsync_dir(save_dir)
    return removed


def _optimizer_table(engine: Any) -> dict[str, Any]:
    """This engine's parameter table, optimizer param groups (hyper-parameters and names) and scheduler, as JSON.

    A pipeline stage has an optimizer of its own, so a pipeline checkpoint keeps one per stage.
    """
    zo = engine.zero_optimizer
    groups_meta = []
    for pg in zo.optimizer.param_groups:
        hyper = {k: _jsonable(v, f"optimizer param group '{k}'") for k, v in pg.items() if k != "params"}
        groups_meta.append(hyper)
    group_of = {}
    for gi, names in enumerate(zo.group_names):
        for n in names:
            group_of[n] = gi
    sched = engine.lr_scheduler
    return {
        "param_groups": groups_meta,
        "group_names": [list(names) for names in zo.group_names],
        "lr_scheduler": _jsonable(sched.state_dict(), "lr_scheduler state")
        if sched is not None and hasattr(sched, "state_dict") else None,
        "params": {
            n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "trainable": p.requires_grad,
                "group": group_of.get(n)}
            for n, p in engine.module.named_parameters()
        },
    }


def save(
    engine: Any, save_dir: str, tag: str | None, client_state: dict | None, save_latest: bool = True,
    keep_last: int | None = None,
) -> str:
    """Write a resume checkpoint of ``engine``; collective (every rank calls it). Returns its path.

    A failure on any rank (a full disk, a state JSON cannot hold) raises on every rank after the
    ranks agree on it, so none is left waiting; the half-written folder is removed and the
    previous checkpoints and ``latest`` stay as they were.
    """
    zo = engine.zero_optimizer
    if zo is None:
        raise CheckpointError("save_checkpoint needs an engine with an optimizer")
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise CheckpointError(
            f"save_checkpoint was called in the middle of gradient accumulation (micro step {engine.micro_steps}, "
            f"accumulation {engine.gradient_accumulation_steps()}); call it after the boundary's engine.step()"
        )
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"save_checkpoint(tag={tag!r}): a tag must be a plain, non-hidden directory name other than '{LATEST}'")
    lay = _layout(engine)
    group, rank = lay.group, lay.rank
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    client = _jsonable(client_state or {}, "client_state")  # every rank checks before anything is written
    # The optimizer and parameter table (one per stage in a pipeline) is made and checked on
    # every rank before anything is written, so a state that cannot be stored (a param group
    # value JSON cannot hold, a scheduler whose state_dict fails) stops every rank with the same
    # sentence instead of rank 0 alone, after the others are already waiting for it.
    try:
        mine, err = (_optimizer_table(engine) if lay.stage is None or lay.dp_rank == 0 else None), None
    except Exception as e:  # noqa: BLE001 - any failure must reach every rank
        mine, err = None, _reason(e)
    from hf_zero.dist import gather_json

    pooled = gather_json({"table": mine if lay.stage is not None else None, "error": err}, group)
    _agree([p["error"] for p in pooled], save_dir)
    stage_tables = [p["table"] for p in pooled if p["table"] is not None]  # rank order is stage order
    table = stage_tables[0] if stage_tables else mine
    err = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _clean_leftovers(save_dir)  # crashed earlier saves (at this tag or any other)
            os.makedirs(partial)
        except Exception as e:  # noqa: BLE001
            err = _reason(e)
    _agree(gather_json(err, group), save_dir)
    try:
        _write_share(engine, lay, zo, partial)
    except Exception as e:  # noqa: BLE001 - a full disk on one rank must not leave the others waiting
        err = _reason(e)
    errors = gather_json(err, group)
    if any(errors):
        if rank == 0:  # free the space the half-written checkpoint took, before anyone returns
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier(group)
        _agree(errors, save_dir)

    if rank == 0:
        try:
            _finish(engine, lay, zo, table, stage_tables, client, save_dir, partial, final, tag, save_latest, keep_last)
        except Exception as e:  # noqa: BLE001
            err = _reason(e)
            shutil.rmtree(partial, ignore_errors=True)  # not published; a tag moved aside comes back on the next save
    _agree(gather_json(err, group), save_dir)
    return final


def _reason(e: BaseException) -> str:
    """An exception as the clause of one sentence: a CheckpointError's own words, others with their type."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _agree(errors: list[str | None], save_dir: str) -> None:
    """Raise the first failing rank's error on every rank; all ranks call this with the pooled errors.

    One sentence everywhere: a failure every rank found (a state JSON cannot hold) in its own words,
    one rank's (its disk is full) naming that rank.
    """
    for r, e in enumerate(errors):
        if e:
            if all(x == e for x in errors):
                raise CheckpointError(e)
            raise CheckpointError(f"save_checkpoint failed on rank {r} ({e}); the checkpoints already in {save_dir} are kept")


def _write_share(engine: Any, lay: _Layout, zo: Any, partial: str) -> None:
    """This rank's part of a checkpoint: its shards, optimizer state and RNG in safetensors, and its index."""
    from safetensors.torch import save_file

    rank = lay.rank

    # Host copies (one per tensor: a device-to-host copy on GPU, a clone on CPU) of what this rank owns.
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    opt_state = zo.optimizer.state
    for g in zo.groups:
        if not (g.partitioned or lay.dp_rank == 0):
            continue  # stage 0: every rank holds the same values; the first stores them
        values = g.owned_values()
        state = opt_state.get(g.master, {}) if g.master is not None else {}
        for r in g.owned():
            name, a, b, m = r.slot.name, r.lo, r.hi, r.at
            if id(r.slot.param) in lay.others:
                continue  # a tied weight: the first stage holding it stores it
            n = b - a
            if g.master is not None:
                key = f"master|{name}"
                tensors[key] = values.detach()[m : m + n].to("cpu", torch.float32, copy=True)
                ranges[key] = [name, a, b]
                for k, v in state.items():
                    if torch.is_tensor(v) and v.numel() == values.numel() and v.numel() > 1:
                        key = f"optim.{k}|{name}"
                        tensors[key] = v.detach()[m : m + n].to("cpu", copy=True)
                        ranges[key] = [name, a, b]
                    elif torch.is_tensor(v) and v.numel() <= 1:
                        scalars.setdefault(name, {})[k] = {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
                    else:
                        scalars.setdefault(name, {})[k] = {"value": _jsonable(v, f"optimizer state '{k}'")}
            else:  # a frozen stage-3 group: its shard holds the values
                key = f"frozen|{name}"
                tensors[key] = values.detach()[m : m + n].to("cpu", copy=True)
                ranges[key] = [name, a, b]
    grouped = {id(s.param) for g in zo.groups for s in g.slots} | lay.others
    if lay.dp_rank == 0:
        for name, p in engine.module.named_parameters():
            if id(p) not in grouped:  # frozen and whole on every rank (of the stage)
                key = f"frozen|{name}"
                tensors[key] = p.detach().reshape(-1).to("cpu", copy=True)
                ranges[key] = [name, 0, p.numel()]
        for name, b in engine.module.state_dict(keep_vars=True).items():
            if not isinstance(b, torch.nn.Parameter) and torch.is_tensor(b):
                tensors[f"buffer|{name}"] = b.detach().to("cpu", copy=True)
    rng_tensors, rng_meta = _rng_state(engine.device)
    tensors.update(rng_tensors)

    # Split into files of at most MAX_FILE_BYTES so no rank stages everything in one buffer.
    files: dict[str, str] = {}
    digests: dict[str, str] = {}
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    index = 0

    def flush() -> None:
        nonlocal chunk, size, index
        if not chunk:
            return
        fname = f"rank{rank:05d}-{index:03d}.safetensors"
        path = os.path.join(partial, fname)
        save_file(chunk, path, metadata={"format": FORMAT})
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        digests[fname] = _sha256(path)
        for k in chunk:
            files[k] = fname
        chunk, size, index = {}, 0, index + 1

    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > MAX_FILE_BYTES:
            flush()
        chunk[key] = t.contiguous()
        size += nbytes
    flush()
    del tensors, chunk
    sampler = getattr(getattr(engine, "training_dataloader", None), "sampler", None)
    rank_meta = {
        "files": files,
        "sha256": digests,
        "ranges": ranges,
        "scalars": scalars,
        "rng": rng_meta,
        "sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else None,
    }
    if lay.stage is not None:
        rank_meta["stage"] = lay.stage
    _write_json(os.path.join(partial, f"rank{rank:05d}.json"), rank_meta)


def _finish(
    engine: Any, lay: _Layout, zo: Any, table: dict, stage_tables: list[dict], client: Any, save_dir: str, partial: str,
    final: str, tag: str, save_latest: bool, keep_last: int | None,
) -> None:
    """Rank 0, once every rank's share is on disk: the checkpoint's index, then the renames that publish it."""
    world = lay.world
    meta = {
        "format": FORMAT,
        "world_size": world,
        "zero_stage": engine.zero_optimization_stage(),
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": table["lr_scheduler"],
        "optimizer": {"type": type(zo.optimizer).__name__, "param_groups": table["param_groups"]},
        "params": table["params"],
        "client_state": client,
    }
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
    from hf_zero.checkpoint.consolidated import save_model_config

    save_model_config(engine.module, partial, None)  # so `hf-zero consolidate` can write config.json
    _write_json(os.path.join(partial, "checkpoint.json"), meta)
    _fsync_dir(partial)
    if os.path.exists(final):  # overwriting a tag: the old one goes only once the new one is whole
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    _fsync_dir(save_dir)
    if save_latest:
        tmp = os.path.join(save_dir, f".{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST))
        _fsync_dir(save_dir)
    if keep_last is not None:
        rotate(save_dir, keep_last, tag)


# ---------------------------------------------------------------------- load


class _Reader:
    """Every tensor of a checkpoint by what it holds: (kind, parameter) -> [(file, key, a, b)]."""

    def __init__(self, path: str, world: int) -> None:
        from safetensors import safe_open

        self.path = path
        self._open = safe_open
        self.handles: dict[str, Any] = {}
        self.index: dict[tuple[str, str], list[tuple[str, str, int, int]]] = defaultdict(list)
        self.scalars: dict[str, dict[str, Any]] = {}
        self.rank_meta: list[dict] = []
        self.digests: dict[str, str] = {}
        self.buffers: dict[str, tuple[int, str]] = {}  # name -> (rank, key): rank 0 or, in a pipeline, its stage's
        for r in range(world):
            meta_path = os.path.join(path, f"rank{r:05d}.json")
            if not os.path.isfile(meta_path):
                raise CheckpointError(f"{path} is incomplete: {os.path.basename(meta_path)} is missing")
            try:
                with open(meta_path) as f:
                    rm = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{meta_path} is not valid JSON ({e}); the checkpoint is damaged") from None
            for fname in {*rm["files"].values(), *rm.get("sha256", {})}:
                if os.path.basename(fname) != fname or fname.startswith("."):
                    raise CheckpointError(f"{meta_path} names the file {fname!r} outside its checkpoint folder; refusing to read it")
            self.digests.update(rm.get("sha256", {}))
            self.rank_meta.append(rm)
            for key, (name, a, b) in rm["ranges"].items():
                kind = key.split("|", 1)[0]
                self.index[(kind, name)].append((rm["files"][key], key, a, b))
            for name, vals in rm["scalars"].items():
                self.scalars.setdefault(name, {}).update(vals)
            for key in rm["files"]:
                if key.startswith("buffer|"):
                    self.buffers.setdefault(key.split("|", 1)[1], (r, key))
        self.files0 = self.rank_meta[0]["files"]

    def damaged(self, share: int = 0, shares: int = 1) -> list[str]:
        """Files (every ``shares``-th, from ``share``) missing or not matching their saved sha256.

        Ranks split the hashing between them and pool the findings, so a checkpoint is read once
        for verification, not once per rank.
        """
        errors = []
        for fname in sorted(self.digests)[share::shares]:
            full = os.path.join(self.path, fname)
            if not os.path.isfile(full):
                errors.append(f"{self.path} is incomplete: {fname} is missing")
            elif _sha256(full) != self.digests[fname]:
                errors.append(f"{full} does not match the checksum recorded when it was saved; the file is damaged")
        return errors

    def handle(self, fname: str) -> Any:
        if fname not in self.handles:
            self.handles[fname] = self._open(os.path.join(self.path, fname), framework="pt", device="cpu")
        return self.handles[fname]

    def read(self, kind: str, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` (``hi - lo`` elements) with elements ``[lo, hi)`` of ``name``'s ``kind`` tensor."""
        pieces = self.index.get((kind, name))
        if not pieces:
            raise CheckpointError(f"{self.path} has no '{kind}' values for parameter '{name}'")
        covered = 0
        for fname, key, a, b in pieces:
            x, y = max(a, lo), min(b, hi)
            if x < y:
                sl = self.handle(fname).get_slice(key)
                out[x - lo : y - lo].copy_(sl[x - a : y - a])
                covered += y - x
        if covered != hi - lo:
            raise CheckpointError(f"{self.path} covers {covered} of elements [{lo}, {hi}) of '{name}' ({kind}); it is damaged")

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        return self.handle(self.rank_meta[rank]["files"][key]).get_tensor(key)


def resolve_tag(load_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"{load_dir} has no '{LATEST}' file; pass tag= or a directory written by save_checkpoint")
        with open(latest) as f:
            tag = f.read().strip()
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag:
        raise CheckpointError(
            f"{load_dir}: the tag {tag!r} is not a plain folder name inside {load_dir}; refusing to read outside it"
        )
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, "checkpoint.json")):
        raise CheckpointError(f"{path} is not a complete hf_zero checkpoint (no checkpoint.json)")
    return path


def load(
    engine: Any,
    load_dir: str,
    tag: str | None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str, dict]:
    """Restore ``engine`` from a checkpoint of any world size and stage. Returns ``(path, client_state)``.

    Every check (names, shapes, optimizer groups, file checksums) runs on every rank and the
    findings are pooled before anything is touched, so a refused checkpoint raises the same
    sentence on every rank and leaves the engine as it was; in a pipeline each stage checks what
    it holds.
    """
    path = resolve_tag(load_dir, tag)
    try:
        with open(os.path.join(path, "checkpoint.json")) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}/checkpoint.json is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    lay = _layout(engine)
    saved_params = meta["params"]
    here = dict(engine.module.named_parameters())
    problems: list[str] = []  # this rank's reasons to refuse
    missing = sorted(set(here) - set(saved_params))
    extra = sorted(set(saved_params) - set(here))
    if lay.stage is not None:
        extra = []  # a stage holds part of the model: what no stage holds is known once the names are pooled
    if missing or extra:
        problems.append(_different_model(path, missing, extra))
    for n, p in here.items():
        if n in saved_params and list(p.shape) != saved_params[n]["shape"]:
            problems.append(f"{path}: parameter '{n}' has shape {saved_params[n]['shape']} there and {list(p.shape)} here")
            break
    if lay.stage is None and problems:  # every rank holds the whole model: every rank finds the same
        raise CheckpointError(problems[0])
    zo = engine.zero_optimizer
    if zo is None:
        raise CheckpointError("load_checkpoint needs an engine with an optimizer")
    hypers: list[dict | None] | None = None
    sched_state: Any = None
    if not load_module_only and not problems and (load_optimizer_states or load_lr_scheduler_states):
        try:
            hypers, sched_state = _optimizer_plan(engine, meta, path, lay)
        except CheckpointError as e:
            if load_optimizer_states:
                problems.append(str(e))
            else:  # only the scheduler is wanted: this stage's (or the one) as saved
                saved = _saved_optimizers(meta)
                sched_state = saved[lay.stage if lay.stage is not None and lay.stage < len(saved) else 0]["lr_scheduler"]
    reader = _Reader(path, int(meta["world_size"]))
    found = problems + reader.damaged(lay.rank, lay.world)
    from hf_zero.dist import gather_json

    # JSON in tensors: loading a checkpoint never unpickles
    pooled = gather_json({"errors": found, "names": sorted(here) if lay.stage is not None and lay.dp_rank == 0 else None},
                         lay.group)
    errors = [e for part in pooled for e in part["errors"]]
    if lay.stage is not None and not errors:
        held = {n for part in pooled for n in (part["names"] or [])}
        extra = sorted(set(saved_params) - held)
        if extra:
            errors.append(_different_model(path, [], extra))
    if errors:  # every rank raises the same sentence, before anything was loaded
        raise CheckpointError(errors[0])
    zo.release_inference()
    with torch.no_grad():
        grouped = set()
        for g in zo.groups:
            values = g.owned_values()
            for r in g.owned():
                n = r.hi - r.lo
                buf = torch.empty(n, dtype=values.dtype)
                kind = "master" if g.trainable or ("frozen", r.slot.name) not in reader.index else "frozen"
                reader.read(kind, r.slot.name, r.lo, r.hi, buf)
                values[r.at : r.at + n].copy_(buf)
            for s in g.slots:
                grouped.add(id(s.param))
        for name, p in engine.module.named_parameters():
            if id(p) in grouped:
                continue
            buf = torch.empty(p.numel(), dtype=p.dtype)
            kind = "frozen" if ("frozen", name) in reader.index else "master"
            reader.read(kind, name, 0, p.numel(), buf)
            p.data.copy_(buf.view(p.shape))
        state = engine.module.state_dict(keep_vars=True)
        for name, b in state.items():
            if not isinstance(b, torch.nn.Parameter) and torch.is_tensor(b) and name in reader.buffers:
                b.copy_(reader.tensor(*reader.buffers[name]))
        for g in zo.groups:
            g.publish_master(None)
    if hypers is not None and load_optimizer_states:
        _load_optimizer(engine, reader, hypers)
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and sched_state is not None:
            engine.lr_scheduler.load_state_dict(_unjson(sched_state))
        if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])
        engine.global_steps = int(meta["global_steps"])
        # Saved on an accumulation boundary; with a different accumulation count (another world size
        # keeping the global batch) the micro-step counter restarts from that boundary.
        same_gas = int(meta.get("gradient_accumulation_steps", 1)) == engine.gradient_accumulation_steps()
        engine.micro_steps = int(meta["micro_steps"]) if same_gas else engine.global_steps * engine.gradient_accumulation_steps()
        engine.global_samples = int(meta["global_samples"])
        engine.skipped_steps = int(meta["skipped_steps"])
        # Each rank's random streams come back to the rank that had them only in the same layout.
        same_layout = (meta.get("pipeline") or {}).get("num_stages") == lay.num_stages
        src = lay.rank if int(meta["world_size"]) == lay.world and same_layout else 0
        rng_keys = [k for k in reader.rank_meta[src]["files"] if k.startswith("rng.")]
        _set_rng_state({k: reader.tensor(src, k) for k in rng_keys}, reader.rank_meta[src]["rng"], engine.device)
        sampler = getattr(getattr(engine, "training_dataloader", None), "sampler", None)
        saved_sampler = reader.rank_meta[0]["sampler"]
        if saved_sampler is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(saved_sampler)
    return path, _unjson(meta["client_state"])


def _different_model(path: str, missing: list[str], extra: list[str]) -> str:
    return (f"{path} was saved from a different model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "load it into the same architecture")


def _saved_optimizers(meta: dict) -> list[dict]:
    """The saved optimizers as ``{param_groups, group_names, lr_scheduler}``: one per pipeline stage, or the one."""
    if meta.get("pipeline"):
        return list(meta["pipeline"]["stages"])
    groups = meta["optimizer"]["param_groups"]
    names: list[list[str]] = [[] for _ in groups]
    for n, info in meta["params"].items():
        gi = info.get("group")
        if gi is not None and 0 <= gi < len(names):
            names[gi].append(n)
    return [{"param_groups": groups, "group_names": names, "lr_scheduler": meta["lr_scheduler"]}]


def _optimizer_plan(engine: Any, meta: dict, path: str, lay: _Layout) -> tuple[list[dict | None], Any]:
    """The saved hyper-parameters for each of this run's param groups, and the scheduler state to load.

    Where this run's optimizer has the saved one's groups (no pipeline on either side, or this
    stage of the same pipeline) they match by position, as the optimizer's own state dict does.
    Across layouts (another number of stages, a pipeline into a plain engine or back) a group
    takes the hyper-parameters of the saved group that held its parameters, found by name; a
    group without trainable parameters keeps its own (``None``).
    """
    zo = engine.zero_optimizer
    here = [set(names) for names in zo.group_names]
    saved = _saved_optimizers(meta)
    first = [saved[lay.stage]] if lay.stage is not None and lay.stage < len(saved) else []
    for v in first + saved:
        if len(v["param_groups"]) == len(here) and all(set(a) == b for a, b in zip(v["group_names"], here)):
            return list(v["param_groups"]), v["lr_scheduler"]
    if lay.stage is None and not meta.get("pipeline"):  # the same layout, other names: by position, as always
        if len(saved[0]["param_groups"]) != len(here):
            raise CheckpointError(
                f"{path} has {len(saved[0]['param_groups'])} optimizer param groups and this run has {len(here)}; "
                "build the optimizer the same way, or pass load_optimizer_states=False"
            )
        return list(saved[0]["param_groups"]), saved[0]["lr_scheduler"]
    where = {n: (vi, gi) for vi, v in enumerate(saved) for gi, names in enumerate(v["group_names"]) for n in names}
    hypers: list[dict | None] = []
    picks: list[tuple[int, int] | None] = []
    for i, names in enumerate(zo.group_names):
        hits = sorted({where[n] for n in names if n in where})
        lost = [n for n in names if n not in where]
        if lost:
            raise CheckpointError(
                f"{path}: parameter '{lost[0]}' is trainable here but was not in any optimizer param group when saved; "
                "train the same parameters, or pass load_optimizer_states=False"
            )
        if not hits:
            hypers.append(None)
            picks.append(None)
            continue
        values = [_plain(saved[vi]["param_groups"][gi]) for vi, gi in hits]
        if any(v != values[0] for v in values[1:]):
            raise CheckpointError(
                f"{path}: optimizer param group {i} here holds parameters that were saved in param groups with "
                "different hyper-parameters; split the param groups as they were, or pass load_optimizer_states=False"
            )
        vi, gi = hits[0]
        hypers.append(saved[vi]["param_groups"][gi])
        picks.append((vi, gi))
    # A scheduler's per-group lists (base_lrs, _last_lr) follow the groups they belong to.
    source = next((p[0] for p in picks if p is not None), lay.stage if lay.stage is not None and lay.stage < len(saved) else 0)
    state = saved[source]["lr_scheduler"]
    count = len(saved[source]["param_groups"])
    index = [p[1] if p is not None and p[0] == source else 0 for p in picks]
    if isinstance(state, dict):
        state = {k: [v[j] for j in index] if isinstance(v, list) and len(v) == count else v for k, v in state.items()}
    return hypers, state


def _plain(hyper: dict) -> dict:
    """Hyper-parameters without the keys that only say how the step runs (compared across groups)."""
    return {k: v for k, v in hyper.items() if k not in _KERNEL_KEYS}


def _load_optimizer(engine: Any, reader: _Reader, hypers: list[dict | None]) -> None:
    """Rebuild torch's optimizer state for this rank's masters, then let torch place it."""
    zo = engine.zero_optimizer
    opt = zo.optimizer
    master_index = {id(m): i for i, m in enumerate(m for pg in opt.param_groups for m in pg["params"])}
    state_keys = sorted({kind.removeprefix("optim.") for kind, _ in reader.index if kind.startswith("optim.")})
    new_state: dict[int, dict[str, Any]] = {}
    for g in zo.groups:
        if g.master is None:
            continue
        st: dict[str, Any] = {}
        for k in state_keys:
            full = torch.zeros(g.master.numel(), dtype=torch.float32)
            any_part = False
            for r in g.owned():
                if (f"optim.{k}", r.slot.name) in reader.index:
                    reader.read(f"optim.{k}", r.slot.name, r.lo, r.hi, full[r.at : r.at + r.hi - r.lo])
                    any_part = True
            if any_part:
                st[k] = full
        scal: dict[str, Any] = {}
        for r in g.owned():
            for k, v in reader.scalars.get(r.slot.name, {}).items():
                prev = scal.get(k)
                if prev is not None and prev["value"] != v["value"]:
                    # Parameters stepped a different number of times share this master now: keep the most.
                    v = v if v["value"] > prev["value"] else prev
                scal[k] = v
        for k, v in scal.items():
            st[k] = torch.tensor(v["value"], dtype=getattr(torch, v["dtype"])) if "dtype" in v else _unjson(v["value"])
        if st:
            new_state[master_index[id(g.master)]] = st
    groups = []
    for pg, saved in zip(opt.param_groups, hypers):
        d = dict(_unjson(saved)) if saved is not None else {k: v for k, v in pg.items() if k != "params"}
        for k in _KERNEL_KEYS:  # how this run's optimizer steps (fused on GPU, loops on CPU) stays its own
            if k in pg:
                d[k] = pg[k]
            else:
                d.pop(k, None)
        d["params"] = [master_index[id(m)] for m in pg["params"]]
        groups.append(d)
    opt.load_state_dict({"state": new_state, "param_groups": groups})
