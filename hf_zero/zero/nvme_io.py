"""NVMe offload's files: where they live, how they are read and written, and how a failure becomes one sentence.

The storage half of ZeRO-Infinity (:mod:`hf_zero.zero.nvme` is the half that moves the ZeRO state through it):

- :class:`NvmeSpec`: one offload section's path, buffers and the ``aio`` section, decided once from the config;
- :class:`SwapFolder`: this run's, this rank's folder (``<nvme_path>/hf_zero-<run id>-rank<N>/optimizer`` or
  ``.../params``), checked on every rank before anything is built (missing, not a folder, read-only, full: one
  sentence on every rank), removed when the engine goes;
- :class:`SwapFiles`: whole-file background reads and writes on a pool of ``aio.intra_op_parallelism`` (older name
  ``thread_count``) threads, each request cut into ``aio.block_size`` pieces, at most ``aio.queue_depth`` of them
  queued per thread, with ``O_DIRECT`` where the file system allows it (page-aligned buffers, lengths rounded up to
  4 KiB) and buffered I/O where it does not (a probe at start: tmpfs on older kernels refuses ``O_DIRECT``);
- :func:`pooled_raise`: a failure seen on one rank raised as the same :class:`hf_zero.errors.NvmeError` sentence on
  every rank of the group (one all-reduce of a flag), so none waits in a collective.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.distributed import dist as hz_dist
from hf_zero.errors import NvmeError

logger = logging.getLogger("hf_zero")

ALIGN = 4096  # O_DIRECT wants buffer addresses, offsets and lengths aligned to the device's block; 4 KiB covers them


@dataclass(frozen=True)
class NvmeSpec:
    """Where and how one offload section keeps its state on disk; built once from the config, never changed.

    ``where`` is the section's JSON path, for the messages. ``buffer_count``, ``pin_memory``, ``max_in_cpu`` and
    ``buffer_size`` are the section's (DeepSpeed's meanings); ``block_size``, ``queue_depth``, ``threads``
    (``intra_op_parallelism``) and ``single_submit`` are the top-level ``aio`` section's.
    """

    path: str
    where: str
    buffer_count: int = 4
    pin_memory: bool = True
    max_in_cpu: int = 0
    buffer_size: int = 100_000_000
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    single_submit: bool = False

    def __post_init__(self) -> None:
        if self.buffer_count < 1 or self.threads < 1 or self.queue_depth < 1 or self.block_size < 1:
            raise ValueError(f"NvmeSpec({self.where}): buffer_count, threads, queue_depth and block_size must be positive")


def round_up(n: int) -> int:
    """``n`` bytes rounded up to whole 4 KiB pages (what ``O_DIRECT`` reads and writes)."""
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialized byte tensor of ``nbytes`` (rounded up to 4 KiB) whose address is 4 KiB-aligned (``O_DIRECT``
    reads and writes it as is), page-locked when ``pin`` and CUDA is present."""
    n = round_up(max(nbytes, 1))
    pin = bool(pin) and torch.cuda.is_available()
    raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + n]


def _pwrite(fd: int, view: memoryview, offset: int) -> int:
    """``os.pwrite``: one name for the writer, so a test can make it fail as a full disk does."""
    return os.pwrite(fd, view, offset)


def _pread(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def _sentence(e: OSError, path: str, where: str, doing: str) -> str:
    """The one sentence a failed file operation under ``path`` becomes."""
    code = e.errno
    why = os.strerror(code) if code else str(e)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (f"NVMe offload: {path} is full ({why}) while {doing}; free space there or set {where}.nvme_path to a "
                "disk with room for the offloaded state")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"NVMe offload: {path} is not writable ({why}); make it writable by this user or set {where}.nvme_path "
                "to a writable folder")
    if code in (errno.ENOENT, errno.ENOTDIR):
        return (f"NVMe offload: {path} does not exist or is not a folder ({why}); create it or set {where}.nvme_path to "
                "an existing folder")
    return f"NVMe offload: {doing} under {path} failed ({why}); check the disk, or set {where}.nvme_path to another one"


@dataclass(frozen=True)
class Scope:
    """The ranks one engine's disk failures are raised on: its ZeRO group and, under hybrid sharding, the replicate
    group across it, so every rank of the grid stops at the same step (not only the failing rank's shard group)."""

    group: dist.ProcessGroup | None = None
    replicate: dist.ProcessGroup | None = None


def _group_of(where: Scope | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return where.group if isinstance(where, Scope) else where


def _pool(mine: str | None, group: dist.ProcessGroup | None) -> str | None:
    """The first message any rank of ``group`` has (its own first), or None; collective."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return mine
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return None
    said: list[str | None] = hz_dist.gather_json(mine, group)  # JSON in tensors: nothing in hf_zero unpickles
    if mine:
        return mine
    first = next(i for i, m in enumerate(said) if m)
    theirs = str(said[first])
    if re.match(r"rank \d+: ", theirs):  # learned from another group already: its origin is named
        return theirs
    return f"rank {dist.get_global_rank(group, first) if group is not None else first}: {theirs}"


def pooled_raise(mine: str | None, where: Scope | dist.ProcessGroup | None) -> None:
    """Raise :class:`NvmeError` on every rank of ``where`` (a group, or a :class:`Scope`) when any rank has a message
    (collective; every rank calls it at the same point). One all-reduce of a flag per group; the messages travel only
    when one is set. A rank raises its own sentence, the others the first one, prefixed by the global rank that had it."""
    scope = where if isinstance(where, Scope) else Scope(where)
    said = _pool(mine, scope.group)
    if scope.replicate is not None:
        said = _pool(said, scope.replicate)
    if said:
        raise NvmeError(said)


def new_run_id(where: Scope | dist.ProcessGroup | None) -> str:
    """A run id the group's ranks share (its first rank's; collective): the folders of one engine."""
    group = _group_of(where)
    run = uuid.uuid4().hex[:12]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        run = hz_dist.gather_json(run, group)[0]  # the group's first rank's (JSON in tensors, never pickle)
    return run


class SwapFolder:
    """This run's, this rank's folder under ``spec.path``, checked and made on every rank at once (collective).

    The run id comes from the group's first rank, so the ranks of one run share ``hf_zero-<id>-*`` and a second run on
    the same disk never reads the first one's files. Removed by :meth:`remove` (``engine.destroy()``) and when the
    object is collected or the process exits; a killed run leaves its folder behind, which a later run does not use
    (its id differs) and names in a warning so it can be deleted.
    """

    def __init__(self, spec: NvmeSpec, kind: str, group: Scope | dist.ProcessGroup | None, run: str | None = None) -> None:
        self.spec = spec
        rank = dist.get_rank() if dist.is_initialized() else 0  # the global rank: unique whatever the group
        run = run or new_run_id(group)
        # one folder per rank at the top (no folder shared by the ranks, so none is left behind by their removal race)
        self.rank_folder = os.path.join(spec.path, f"hf_zero-{run}-rank{rank:05d}")
        self.path = os.path.join(self.rank_folder, kind)
        problem = self._make()
        pooled_raise(problem, group)
        self.direct = self._probe_direct()
        if rank == 0 and kind == "optimizer":
            stale = sorted({d.rsplit("-rank", 1)[0] for d in os.listdir(spec.path)
                            if d.startswith("hf_zero-") and not d.startswith(f"hf_zero-{run}-")})
            if stale:
                logger.warning("NVMe offload: %s holds the swap folders of %d earlier run(s) (%s-*); delete them if no "
                               "run uses them", spec.path, len(stale), ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else ""))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)

    def _make(self) -> str | None:
        path, where = self.spec.path, self.spec.where
        if not os.path.isdir(path):
            why = "is not a folder" if os.path.exists(path) else "does not exist"
            return f"NVMe offload: {where}.nvme_path {path} {why}; create it (on a local NVMe disk) or point nvme_path at one"
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, ".probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _pwrite(fd, memoryview(bytes(ALIGN)), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            return _sentence(e, path, where, "making its swap folder")
        return None

    def _probe_direct(self) -> bool:
        """Whether files here open with ``O_DIRECT`` (page cache bypassed); tmpfs and some network file systems refuse."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        probe = os.path.join(self.path, ".direct")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        except OSError:
            return False
        try:
            buf = aligned_buffer(ALIGN, pin=False)
            _pwrite(fd, memoryview(buf.numpy()), 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)

    def remove(self) -> None:
        """Delete this folder (and this rank's, once empty)."""
        self._finalizer()
        with contextlib.suppress(OSError):
            os.rmdir(self.rank_folder)


class SwapFiles:
    """Whole-file background reads and writes in one :class:`SwapFolder`, on a pool of ``spec.threads`` threads.

    A request is cut into pieces of ``block_size`` bytes (whole 4 KiB pages), handed to the pool together, at most
    ``threads * queue_depth`` pieces queued at once (``single_submit``: one piece at a time per request, in order);
    :meth:`write` and :meth:`read` return a :class:`Ticket` to wait on. An ``OSError`` becomes the ticket's one sentence
    (:func:`_sentence`), kept for :func:`pooled_raise`.
    """

    def __init__(self, folder: SwapFolder) -> None:
        self.folder, self.spec = folder, folder.spec
        self.pool = ThreadPoolExecutor(max_workers=self.spec.threads, thread_name_prefix="hf_zero-nvme")
        self.piece = round_up(self.spec.block_size)
        self.in_flight = threading.BoundedSemaphore(self.spec.threads * self.spec.queue_depth)
        self.fds: dict[str, int] = {}

    def _fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is None:
            flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if self.folder.direct else 0)
            fd = os.open(os.path.join(self.folder.path, name), flags, 0o600)
            self.fds[name] = fd
        return fd

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        try:
            done = 0
            while done < len(view):
                n = (_pwrite if write else _pread)(fd, view[done:], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short read" if not write else "short write")
                done += n
        finally:
            self.in_flight.release()

    def _submit(self, name: str, buf: torch.Tensor, nbytes: int, write: bool) -> Ticket:
        nbytes = round_up(nbytes)
        assert buf.dtype == torch.uint8 and buf.numel() >= nbytes and buf.data_ptr() % ALIGN == 0
        doing = f"{'writing' if write else 'reading'} {name}"
        try:
            fd = self._fd(name)
        except OSError as e:
            return Ticket([], _sentence(e, self.spec.path, self.spec.where, doing))
        view = memoryview(buf.numpy())
        futures: list[Future] = []
        for start in range(0, nbytes, self.piece):
            self.in_flight.acquire()
            part = view[start : min(start + self.piece, nbytes)]
            f = self.pool.submit(self._piece, fd, part, start, write)
            futures.append(f)
            if self.spec.single_submit:
                f.exception()
        return Ticket(futures, None, self.spec, doing)

    def write(self, name: str, buf: torch.Tensor, nbytes: int) -> Ticket:
        """Write the first ``nbytes`` of aligned ``buf`` (see :func:`aligned_buffer`) as file ``name``."""
        return self._submit(name, buf, nbytes, write=True)

    def read(self, name: str, buf: torch.Tensor, nbytes: int) -> Ticket:
        """Read ``nbytes`` of file ``name`` into aligned ``buf``."""
        return self._submit(name, buf, nbytes, write=False)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


class Ticket:
    """One request in flight: :meth:`wait` returns None, or the one sentence of its failure."""

    def __init__(self, futures: list[Future], error: str | None, spec: NvmeSpec | None = None, doing: str = "") -> None:
        self.futures, self.error, self.spec, self.doing = futures, error, spec, doing

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> str | None:
        for f in self.futures:
            e = f.exception()
            if e is not None and self.error is None:
                assert self.spec is not None
                self.error = (_sentence(e, self.spec.path, self.spec.where, self.doing) if isinstance(e, OSError)
                              else f"NVMe offload: {self.doing} failed: {e}")
        self.futures = []
        return self.error
