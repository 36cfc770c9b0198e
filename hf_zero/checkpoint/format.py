"""The resume checkpoint's on-disk format, and a reader for it (public: converters write against this).

Layout of ``<save_dir>/<tag>/``::

    checkpoint.json            written by rank 0, last: counters, scaler, scheduler, optimizer hyper-
                               parameters, the parameter table (name, shape, dtype, group) and
                               the client state
    rank00000.json             per rank: which elements of which parameter each tensor holds,
                               RNG states, data-loader position, the sha256 of each of its files
    rank00000-000.safetensors  per rank: the fp32 master elements this rank owns, the matching
                               optimizer state, frozen parameters, buffers (rank 0), RNG tensors
    config.json                the model's config, when it is a transformers model
    <save_dir>/latest          the tag of the newest complete checkpoint

Nothing is stored by flat-buffer position: every tensor is "elements [a, b) of parameter
``name`` (flattened)". A tensor's key in its safetensors file is ``<kind>|<name>`` with kind
``master`` (fp32), ``optim.<state>`` (e.g. ``optim.exp_avg``), ``frozen`` (a parameter nothing
trains, in its own dtype) or ``buffer`` (a rank holding several ranges of one parameter keys the others
``<kind>|<name>|<a>``: a converted DeepSpeed AutoEP checkpoint, whose expert ranges interleave in the fused
tensors); the rank's JSON maps each key to its file and to ``[name, a, b]`` (``ranges``), and holds each parameter's scalar optimizer state (``scalars``:
Adam's ``step``; a one-element tensor's ``value`` and ``dtype``, with its ``shape`` unless it is 0-d). RNG tensors are ``rng.torch_cpu`` / ``rng.torch_cuda``. A run with any world
size and any ZeRO stage computes which elements it owns and reads exactly those from whichever
files hold them, so resharding needs no conversion step, and a pipeline layout (which only
changes who owns what) fits the same format.

A checkpoint saved with ``exclude_frozen_parameters=True`` has ``"frozen_excluded": true`` in
``checkpoint.json`` and no ``frozen`` tensors: the parameter table still lists the frozen parameters
(``"trainable": false``), and a load leaves their values as the model has them (the PEFT case: the
base weights come from the pretrained model, the checkpoint holds what was trained).

A weight tied under several names in one module is stored once, under its first name; ``"shared"`` in
``checkpoint.json`` maps each other name to it (absent when nothing is tied; older checkpoints lack it).

Pipelines: every rank of the world writes its own ``rankNNNNN`` files (by global rank), holding
its stage's parameters under the model's own names; ``checkpoint.json`` carries the parameter
table of every stage (each entry with its ``stage``) and, under ``"pipeline"``, each stage's
optimizer param groups and scheduler state (stages have optimizers of their own). A tied weight
(held by several stages under one name) is stored once, by the first stage holding it. A pipeline
checkpoint loads at another data-parallel degree or number of stages, and into a plain engine of
the same model (and the other way round): each rank reads the names and ranges it owns.

JSON holds what is not a tensor (scheduler and client state: tensors inside become
``{"__tensor__": [...], "dtype": ...}``); nothing is pickled, so loading never runs code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hf_zero.checkpoint.fileio import Piece, io_threads, read_file_pieces, read_header
from hf_zero.errors import CheckpointError

FORMAT = "hf_zero.resume/1"
LATEST = "latest"
META = "checkpoint.json"
MAX_FILE_BYTES = 2 * 2**30  # a rank's tensors are split into files of at most this size


def rank_meta_name(rank: int) -> str:
    """The JSON index of one rank's share."""
    return f"rank{rank:05d}.json"


def rank_file_name(rank: int, index: int) -> str:
    """The ``index``-th safetensors file of one rank's share."""
    return f"rank{rank:05d}-{index:03d}.safetensors"


def sha256(path: str) -> str:
    """The file's sha256, as recorded in its rank's JSON when it was saved."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


MIN_FILE_BYTES = 256 * 2**20  # a rank's share is cut into as many files as it has I/O threads, none smaller than this


def io_pool(jobs: int) -> ThreadPoolExecutor:
    """A thread pool for ``jobs`` file writes or hashes of one rank (at most :func:`io_threads` at once: file I/O,
    sha256 and device copies release the GIL, so files of one rank move side by side); give it work through
    :func:`io_submit`."""
    return ThreadPoolExecutor(max_workers=max(1, min(jobs, io_threads())), thread_name_prefix="hf_zero-ckpt-io")


def io_submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit(fn, *args)``, or ``fn`` run here when no thread may start: a background checkpoint write that
    the process's end waits for runs while the interpreter shuts down, when executors refuse new work."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown" (or no new thread then)
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result, as a pool would
            done.set_exception(e)
        return done


# ------------------------------------------------------------------------ JSON


def to_json(obj: Any, where: str) -> Any:
    """Scheduler and client state as JSON; tensors become lists; anything else is an error naming ``where``."""
    if isinstance(obj, (str, bool, int, float)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return {str(k): to_json(v, f"{where}.{k}") for k, v in obj.items()}
    raise CheckpointError(
        f"{where} is of type {type(obj).__name__}, which a checkpoint cannot store without pickle; "
        "keep it to numbers, strings, lists, dicts and tensors"
    )


def from_json(obj: Any) -> Any:
    """The inverse of :func:`to_json` (tensors come back as tensors)."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


def rng_state(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's random streams: torch's as tensors, Python's and NumPy's as JSON."""
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


def moved_streams(tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device) -> list[str]:
    """The streams whose state now differs from what :func:`rng_state` returned as ``tensors`` and ``meta``."""
    now_tensors, now_meta = rng_state(device)
    moved = [k for k, v in tensors.items() if not torch.equal(v, now_tensors[k])]
    return moved + [k for k, v in meta.items() if v != now_meta[k]]


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if device.type == "cuda" and "rng.torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.torch_cuda"], device)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# ---------------------------------------------------------------------- finding


def read_latest(save_dir: str) -> str | None:
    """The tag ``latest`` names, or None."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


def resolve_tag(load_dir: str, tag: str | None) -> str:
    """The folder of checkpoint ``tag`` in ``load_dir`` (``latest``'s when None), checked to be complete."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise CheckpointError(f"{load_dir} has no '{LATEST}' file; pass tag= or a directory written by save_checkpoint")
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag:
        raise CheckpointError(
            f"{load_dir}: the tag {tag!r} is not a plain folder name inside {load_dir}; refusing to read outside it"
        )
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, META)):
        raise CheckpointError(f"{path} is not a complete hf_zero checkpoint (no {META})")
    return path


def read_meta(path: str) -> dict[str, Any]:
    """A checkpoint folder's ``checkpoint.json``, refused unless it is valid JSON of this format."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}/{META} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: format {found!r} is not {FORMAT!r}")
    return meta


def saved_optimizers(meta: dict) -> list[dict]:
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


# ---------------------------------------------------------------------- reading


class CheckpointReader:
    """Every tensor of a checkpoint by what it holds: ``(kind, parameter) -> [(file, key, a, b)]``.

    ``read(kind, name, lo, hi, out)`` assembles any element range of a parameter from whichever
    ranks' files hold its pieces, reading only those slices (safetensors' lazy slices).
    """

    def __init__(self, path: str, world: int) -> None:
        from safetensors import safe_open

        self.path = path
        self._open = safe_open
        self.handles: dict[str, Any] = {}
        self.headers: dict[str, tuple[int, dict[str, Any]]] = {}
        self.index: dict[tuple[str, str], list[tuple[str, str, int, int]]] = defaultdict(list)
        self.scalars: dict[str, dict[str, Any]] = {}
        self.rank_meta: list[dict] = []
        self.digests: dict[str, str] = {}
        self.buffers: dict[str, tuple[int, str]] = {}  # name -> (rank, key): rank 0 or, in a pipeline, its stage's
        # (kind, name) -> a value made from other stored names (another tensor-parallel split: checkpoint/tp_reshard.py)
        self.derived: dict[tuple[str, str], Any] = {}
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None
        for r in range(world):
            self._add_rank(r)
        self.files0 = self.rank_meta[0]["files"]

    def _add_rank(self, r: int) -> None:
        meta_path = os.path.join(self.path, rank_meta_name(r))
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"{self.path} is incomplete: {os.path.basename(meta_path)} is missing")
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

    def damaged(self, share: int = 0, shares: int = 1) -> list[str]:
        """Files (every ``shares``-th, from ``share``) missing or not matching their saved sha256.

        Ranks split the hashing between them and pool the findings, so a checkpoint is read once
        for verification, not once per rank.
        """
        mine = sorted(self.digests)[share::shares]
        errors = [f"{self.path} is incomplete: {f} is missing" for f in mine
                  if not os.path.isfile(os.path.join(self.path, f))]
        present = [f for f in mine if os.path.isfile(os.path.join(self.path, f))]
        with io_pool(len(present)) as pool:  # this rank's files hashed side by side
            digests = [d.result() for d in [io_submit(pool, sha256, os.path.join(self.path, f)) for f in present]]
        errors += [f"{os.path.join(self.path, f)} does not match the checksum recorded when it was saved; the file is "
                   "damaged" for f, d in zip(present, digests) if d != self.digests[f]]
        return errors

    def handle(self, fname: str) -> Any:
        """An open safetensors handle of one of the checkpoint's files (opened once)."""
        if fname not in self.handles:
            self.handles[fname] = self._open(os.path.join(self.path, fname), framework="pt", device="cpu")
        return self.handles[fname]

    def read(self, kind: str, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` (``hi - lo`` elements) with elements ``[lo, hi)`` of ``name``'s ``kind`` tensor."""
        self.read_many([(kind, name, lo, hi, out)])

    def read_many(self, requests: list[tuple[str, str, int, int, torch.Tensor]]) -> None:
        """Fill each ``out`` of ``(kind, name, lo, hi, out)`` with elements ``[lo, hi)`` of ``name``'s ``kind`` tensor
        from whichever files hold them: every request's coverage checked first, then the files read side by side
        (one per thread, ``preadv`` into a reused buffer, copied to ``out`` wherever it lives). How a load reads a
        rank's share."""
        by_file: dict[str, list[Piece]] = defaultdict(list)
        derived, strided = [], []
        for kind, name, lo, hi, out in requests:
            if (kind, name) in self.derived:
                derived.append((kind, name, lo, hi, out))
                continue
            flat = out.reshape(-1) if out.is_contiguous() else torch.empty(hi - lo, dtype=out.dtype, device=out.device)
            if not out.is_contiguous():
                strided.append((out, flat))
            pieces = self.index.get((kind, name))
            if not pieces:
                raise CheckpointError(f"{self.path} has no '{kind}' values for parameter '{name}'")
            covered = 0
            for fname, key, a, b in pieces:
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    by_file[fname].append(Piece(key, x - a, y - a, flat[x - lo : y - lo]))
                    covered += y - x
            if covered != hi - lo:
                raise CheckpointError(f"{self.path} covers {covered} of elements [{lo}, {hi}) of '{name}' ({kind}); it is damaged")
        for kind, name, lo, hi, out in derived:  # a re-cut tensor-parallel slice: made whole once, then its ranges
            if self._last is None or self._last[0] != (kind, name):
                self._last = None
                self._last = ((kind, name), self.derived[(kind, name)].value())
            out.copy_(self._last[1][lo:hi].view(out.shape))
        headers = {f: self.header(f) for f in by_file}
        with io_pool(len(by_file)) as pool:
            done = [io_submit(pool, read_file_pieces, os.path.join(self.path, f), ps, headers[f]) for f, ps in by_file.items()]
            for d in done:
                d.result()
        for out, flat in strided:
            out.copy_(flat.view(out.shape))
        if any(out.is_cuda for _, _, _, _, out in requests):
            torch.cuda.synchronize()  # a copy from pageable memory may still be in flight when it returns

    def header(self, fname: str) -> tuple[int, dict[str, Any]]:
        """One file's data offset and safetensors header (read once)."""
        if fname not in self.headers:
            self.headers[fname] = read_header(os.path.join(self.path, fname))
        return self.headers[fname]

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        """A whole tensor of one rank's share (a buffer, an RNG state)."""
        return self.handle(self.rank_meta[rank]["files"][key]).get_tensor(key)
