"""ZeRO-Infinity: the offloaded state in files under ``nvme_path`` instead of host memory.

DeepSpeed's ``"device": "nvme"`` in ``offload_optimizer`` (the fp32 masters and the optimizer state of every
trainable shard group) and in stage 3's ``offload_param`` (the 16-bit shards the all-gathers read). The CPU
offload of :mod:`hf_zero.zero.offload` stays what runs the step; this module moves what it keeps in host memory
to disk and back:

- the files themselves (the per-run, per-rank :class:`~hf_zero.zero.nvme_io.SwapFolder`, the threaded ``O_DIRECT``
  reads and writes of :class:`~hf_zero.zero.nvme_io.SwapFiles`, the pooled failures) are :mod:`hf_zero.zero.nvme_io`;
- :class:`OptimizerSwap` takes each trainable group as it is built (:meth:`OptimizerSwap.adopt`: its master is
  written out at once, so host memory never holds the masters together) and keeps each trainable group's master
  and its full-size optimizer state tensors (Adam's two moments) in one file; during the step (:class:`hf_zero.zero.runner.NvmeRunner`) group ``i+1`` is read into a
  pinned buffer while the CPU steps group ``i`` and group ``i-1`` is written back, through ``buffer_count``
  buffers of the largest group; between steps the tensors keep their identity (the optimizer's ``state`` is keyed by
  them) with no storage (``numel() == 0``). A save, a load or DeepSpeed's fp32 accessors bring every group back
  for their duration (:meth:`OptimizerSwap.resident`);
- :class:`ParamStore` keeps stage 3's host shards beyond ``max_in_cpu`` elements in files; a gather reads its
  group's file (the next groups in the last pass's order are read ahead, ``buffer_count`` at most), a step writes
  the recast shard back.

Failures: a write error (a full disk) or a read error is recorded where it happens and raised as one
:class:`hf_zero.errors.NvmeError` sentence on every rank at the next step boundary (:func:`pooled_raise`, one
all-reduce of a flag), before the optimizer touches anything, so no rank is left waiting in a collective and no
checkpoint is written from a half-read state (the swap refuses :meth:`OptimizerSwap.resident` once broken).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.errors import NvmeError
from hf_zero.zero.group import ShardGroup
from hf_zero.zero.nvme_io import (
    NvmeSpec,
    SwapFiles,
    SwapFolder,
    Ticket,
    aligned_buffer,
    new_run_id,
    pooled_raise,
    round_up,
)

__all__ = ["NvmeSpec", "NvmeStores", "OptimizerSwap", "ParamStore", "open_stores", "pooled_raise"]

logger = logging.getLogger("hf_zero")

_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _release(t: torch.Tensor) -> None:
    """Drop ``t``'s values, keeping the object (optimizers and their ``state`` hold it by identity)."""
    empty = _EMPTY.setdefault(t.dtype, torch.empty(0, dtype=t.dtype))
    t.data = empty


@dataclass
class _Layout:
    """What one group's file holds: the master, then each full-size optimizer state tensor (by key), each section
    starting on a 4 KiB boundary."""

    numel: int
    keys: tuple[tuple[str, torch.dtype], ...] = ()
    written: bool = False

    def sections(self) -> list[tuple[str, torch.dtype, int]]:
        out, at = [], 0
        for k, dt in (("master", torch.float32), *self.keys):
            out.append((k, dt, at))
            at += round_up(self.numel * dt.itemsize)
        return out

    def nbytes(self, keys: tuple[tuple[str, torch.dtype], ...] | None = None) -> int:
        ks = self.keys if keys is None else keys
        return sum(round_up(self.numel * dt.itemsize) for _, dt in (("master", torch.float32), *ks))


def _full_size_state(st: dict, numel: int) -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((k, v.dtype) for k, v in st.items()
                 if torch.is_tensor(v) and v.numel() == numel and numel > 1 and v.is_floating_point())


class OptimizerSwap:
    """The masters and optimizer state of the trainable groups in files (see the module docstring); made by
    :class:`hf_zero.zero.optimizer.ShardedOptimizer` before its groups, each group :meth:`adopt`-ed as it is built,
    then driven by :class:`hf_zero.zero.runner.NvmeRunner`.

    During a step the runner calls :meth:`begin` with the groups in the order it steps them, then, per group,
    :meth:`attach` (wait for its read, point the master and the state at a pooled buffer; the reads of the next
    ``buffer_count - 2`` groups start) and :meth:`detach` (start writing it back; the buffer returns to the pool once
    written and once the copy to the device that read it is done), and :meth:`end` (wait for every write; returns the
    first failure's sentence, for :func:`pooled_raise`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, spec: NvmeSpec, state_slots: int,
                 group: dist.ProcessGroup | None, stream: torch.cuda.Stream | None, run: str | None = None) -> None:
        self.optimizer, self.spec, self.stream, self.state_slots = optimizer, spec, stream, state_slots
        self.groups: list[ShardGroup] = []
        self.folder = SwapFolder(spec, "optimizer", group, run)
        self.files = SwapFiles(self.folder)
        self.layout: dict[int, _Layout] = {}
        self.names: dict[int, str] = {}
        self.largest = 0
        self.buffer_bytes = 0
        self.pool: list[torch.Tensor] = []
        self.free: collections.deque[int] = collections.deque()
        self.busy: dict[int, tuple[Ticket | None, torch.cuda.Event | None]] = {}  # buffer -> its write, its last reader
        self.broken: str | None = None
        self.error: str | None = None
        self.io_seconds = 0.0  # the step's waits for reads and buffers
        self._order: list[ShardGroup] = []
        self._reads: dict[int, tuple[int, Ticket | None]] = {}  # group -> (buffer, read)
        self._attached: dict[int, int | None] = {}  # group -> its pooled buffer (None: a buffer of its own)
        self._oneoff: dict[int, torch.Tensor] = {}  # group -> a buffer of its own (more state than the pool planned)
        self._next = 0
        self._depth = max(1, spec.buffer_count - 2)

    def adopt(self, g: ShardGroup) -> None:
        """Take trainable group ``g`` as it is built: its master goes to disk at once (host memory never holds more
        than one group's), its memory is released. A failure is kept for :meth:`adopted`."""
        assert g.master is not None
        n = g.master.numel()
        self.groups.append(g)
        g.nvme_swap = self  # type: ignore[attr-defined]  # a write-back outside the step (GatheredParameters) reads it
        self.layout[id(g)] = lay = _Layout(n)
        self.names[id(g)] = f"group{len(self.groups) - 1:05d}.bin"
        self.largest = max(self.largest, n)
        # Each pooled buffer holds a group's master and ``state_slots`` fp32 state tensors (Adam: 2), as planned
        self.buffer_bytes = _Layout(self.largest, tuple(("s", torch.float32) for _ in range(self.state_slots))).nbytes()
        if self.error is None:
            buf = aligned_buffer(lay.nbytes(), pin=False)
            self._fill(g, buf, ())
            self.error = self.files.write(self.names[id(g)], buf, lay.nbytes()).wait()
            lay.written = self.error is None
        _release(g.master)

    def adopted(self, group: dist.ProcessGroup | None) -> None:
        """Every group is built and written (collective: a failure stops every rank in one sentence)."""
        err, self.error = self.error, None
        pooled_raise(err, group)

    # ------------------------------------------------------------ buffers

    def _acquire(self) -> int:
        """A free pooled buffer, waiting for the oldest write in flight when there is none."""
        if not self.pool:
            n = max(2, self.spec.buffer_count)
            self.pool = [aligned_buffer(self.buffer_bytes, self.spec.pin_memory) for _ in range(n)]
            self.free.extend(range(n))
        while not self.free:
            b = next(iter(self.busy))
            self._settle(b)
        return self.free.popleft()

    def _settle(self, b: int) -> None:
        ticket, event = self.busy.pop(b)
        if ticket is not None:
            err = ticket.wait()
            self.error = self.error or err
        if event is not None:
            event.synchronize()
        self.free.append(b)

    def _buffer(self, g: ShardGroup, b: int | None, keys: tuple[tuple[str, torch.dtype], ...]) -> torch.Tensor:
        need = self.layout[id(g)].nbytes(keys)
        if b is not None and need <= self.pool[b].numel():
            return self.pool[b]
        return aligned_buffer(need, pin=False)  # an optimizer with more state than planned: a buffer of its own

    # ------------------------------------------------------------ views

    def _views(self, g: ShardGroup, buf: torch.Tensor, keys: tuple[tuple[str, torch.dtype], ...]) -> dict[str, torch.Tensor]:
        lay = _Layout(self.layout[id(g)].numel, keys)
        n = lay.numel
        return {k: buf[at : at + n * dt.itemsize].view(dt) for k, dt, at in lay.sections()}

    def _fill(self, g: ShardGroup, buf: torch.Tensor, keys: tuple[tuple[str, torch.dtype], ...]) -> None:
        """Copy the group's master and state tensors into ``buf`` where they are not views of it already."""
        st = self.optimizer.state.get(g.master, {})  # type: ignore[arg-type]
        for k, view in self._views(g, buf, keys).items():
            t = g.master if k == "master" else st[k]
            assert t is not None
            if t.data_ptr() != view.data_ptr():
                view.copy_(t.reshape(-1))

    def _point(self, g: ShardGroup, buf: torch.Tensor) -> None:
        """The master and state tensors become views of ``buf`` (their objects unchanged)."""
        st = self.optimizer.state.get(g.master, {})  # type: ignore[arg-type]
        shape = self.layout[id(g)].numel
        for k, view in self._views(g, buf, self.layout[id(g)].keys).items():
            t = g.master if k == "master" else st.get(k)
            if t is None:  # a state the optimizer lost (a load without optimizer states): it makes it again
                continue
            t.data = view.view(shape)

    # ------------------------------------------------------------ the step

    def begin(self, order: list[ShardGroup]) -> None:
        """A step will attach ``order``'s groups in this order: start the first reads."""
        if self.broken:
            self.error = self.broken
        self._order, self._next = list(order), 0
        self.io_seconds = 0.0
        self._prefetch()

    def _prefetch(self) -> None:
        while self._next < len(self._order) and len(self._reads) < self._depth:
            g = self._order[self._next]
            self._next += 1
            self._reads[id(g)] = self._start_read(g)

    def _start_read(self, g: ShardGroup) -> tuple[int, Ticket | None]:
        b = self._acquire()
        lay = self.layout[id(g)]
        buf = self._buffer(g, b, lay.keys)
        if buf is not self.pool[b]:
            self._oneoff[id(g)] = buf
        ticket = self.files.read(self.names[id(g)], buf, lay.nbytes()) if lay.written else None
        return b, ticket

    def _buf_of(self, g: ShardGroup, b: int) -> torch.Tensor:
        own = self._oneoff.pop(id(g), None)
        return own if own is not None else self.pool[b]

    def attach(self, g: ShardGroup) -> None:
        """Group ``g``'s master and state in host memory, ready to step (its read waited for); starts later reads."""
        start = time.perf_counter()
        if id(g) not in self._reads:  # not in the begin() order: read it now
            self._reads[id(g)] = self._start_read(g)
        b, ticket = self._reads.pop(id(g))
        buf = self._buf_of(g, b)
        err = ticket.wait() if ticket is not None else None
        if err:
            self.error = self.error or err
            buf.zero_()  # the step goes on with zeros (every rank's collectives stay matched); the boundary raises
        self._point(g, buf)
        self._attached[id(g)] = b if buf is self.pool[b] else None
        if buf is not self.pool[b]:
            self.free.append(b)
        self._prefetch()
        self.io_seconds += time.perf_counter() - start

    def detach(self, g: ShardGroup) -> None:
        """Write group ``g`` back (in the background) and drop its values from host memory."""
        b = self._attached.pop(id(g))
        st = self.optimizer.state.get(g.master, {})  # type: ignore[arg-type]
        lay = self.layout[id(g)]
        keys = _full_size_state(st, lay.numel)
        buf = self.pool[b] if b is not None else None
        if buf is None or lay.nbytes(keys) > buf.numel():
            buf = self._buffer(g, None, keys)
        self._fill(g, buf, keys)  # the first step's new state, or a buffer of another size
        event = None
        if self.stream is not None:  # the publish's copy to the device reads the buffer: reuse it only after that
            event = torch.cuda.Event()
            event.record(self.stream)
        ticket = None
        if self.error is None:
            ticket = self.files.write(self.names[id(g)], buf, lay.nbytes(keys))
            lay.keys, lay.written = keys, True
        for _, t in [("master", g.master), *((k, st[k]) for k, _ in keys)]:
            _release(t)  # type: ignore[arg-type]
        if b is not None and buf is self.pool[b]:
            self.busy[b] = (ticket, event)
            return
        if ticket is not None:
            err = ticket.wait()  # a buffer of its own: finish now, it goes with this call
            self.error = self.error or err
        if b is not None:
            if event is not None:
                event.synchronize()
            self.free.append(b)  # the pooled buffer it was read into is free again

    def end(self) -> str | None:
        """Wait for every write of the step; the first failure's sentence (None when all went well)."""
        for b in list(self.busy):
            self._settle(b)
        for g_id, (b, ticket) in list(self._reads.items()):  # reads begun for groups the step did not reach
            if ticket is not None:
                ticket.wait()
            self._oneoff.pop(g_id, None)
            self.free.append(b)
        self._reads.clear()
        err, self.error = self.error, None
        return err

    def fail(self, sentence: str) -> None:
        """Every rank learned of a failure (:func:`pooled_raise`): the files may be stale, so nothing reads them again."""
        self.broken = sentence

    # ------------------------------------------------------------ outside the step

    @contextlib.contextmanager
    def resident(self, group: dist.ProcessGroup | None) -> Iterator[None]:
        """Every group's master and state in host memory, in buffers of their own, for the block (a save, a load);
        then written back and released (collective: a failure is raised on every rank)."""
        problem = self.broken
        bufs: dict[int, torch.Tensor] = {}
        if problem is None:
            for g in self.groups:
                lay = self.layout[id(g)]
                buf = aligned_buffer(lay.nbytes(), pin=False)
                err = self.files.read(self.names[id(g)], buf, lay.nbytes()).wait() if lay.written else None
                if err:
                    problem = err
                    break
                bufs[id(g)] = buf
                self._point(g, buf)
        pooled_raise(problem, group)
        failed: BaseException | None = None
        try:
            yield
        except BaseException as e:
            failed = e
            raise
        finally:
            err = None
            for g in self.groups:
                st = self.optimizer.state.get(g.master, {})  # type: ignore[arg-type]
                lay = self.layout[id(g)]
                if g.master.numel() == lay.numel:  # type: ignore[union-attr]
                    keys = _full_size_state(st, lay.numel)
                    buf = bufs.get(id(g))
                    if buf is None or buf.numel() < lay.nbytes(keys):
                        buf = aligned_buffer(lay.nbytes(keys), pin=False)
                    self._fill(g, buf, keys)
                    if err is None:
                        err = self.files.write(self.names[id(g)], buf, lay.nbytes(keys)).wait()
                        lay.keys, lay.written = keys, True
                    for t in [g.master, *(st[k] for k, _ in keys)]:
                        _release(t)  # type: ignore[arg-type]
                bufs.pop(id(g), None)
            if err:
                self.broken = err
            if failed is None:
                pooled_raise(err, group)

    @contextlib.contextmanager
    def group_resident(self, g: ShardGroup, write: bool) -> Iterator[None]:
        """One group's master and state in host memory for the block (``deepspeed.utils``' per-parameter accessors,
        between steps), written back after it when ``write``; local, no collective."""
        if self.broken:
            raise NvmeError(self.broken)
        lay = self.layout[id(g)]
        buf = aligned_buffer(lay.nbytes(), pin=False)
        err = self.files.read(self.names[id(g)], buf, lay.nbytes()).wait() if lay.written else None
        if err:
            raise NvmeError(err)
        self._point(g, buf)
        try:
            yield
        finally:
            st = self.optimizer.state.get(g.master, {})  # type: ignore[arg-type]
            keys = _full_size_state(st, lay.numel)
            if write:
                if buf.numel() < lay.nbytes(keys):
                    buf = aligned_buffer(lay.nbytes(keys), pin=False)
                self._fill(g, buf, keys)
                err = self.files.write(self.names[id(g)], buf, lay.nbytes(keys)).wait()
                lay.keys, lay.written = keys, err is None
            for t in [g.master, *(st[k] for k, _ in keys)]:
                _release(t)  # type: ignore[arg-type]
            if err:
                self.broken = err
                raise NvmeError(err)

    def close(self) -> None:
        """Stop the threads and delete the files (``engine.destroy()``)."""
        self.files.close()
        self.folder.remove()
        self.pool = []


@dataclass
class NvmeStores:
    """An engine's files: the optimizer's (``offload_optimizer``) and the parameters' (``offload_param``), either None
    when that section is not on NVMe. Made before the groups (:func:`open_stores`), which are adopted as built."""

    swap: OptimizerSwap | None = None
    params: ParamStore | None = None

    def adopted(self, group: dist.ProcessGroup | None) -> None:
        for store in (self.params, self.swap):
            if store is not None:
                store.adopted(group)


def open_stores(optimizer: torch.optim.Optimizer, optimizer_spec: NvmeSpec | None, params_spec: NvmeSpec | None,
                state_slots: int, group: dist.ProcessGroup | None, stream: torch.cuda.Stream | None) -> NvmeStores:
    """The folders of one engine (one run id for both; collective), before any group is built."""
    run = new_run_id(group)
    return NvmeStores(
        swap=OptimizerSwap(optimizer, optimizer_spec, state_slots, group, stream, run) if optimizer_spec else None,
        params=ParamStore(params_spec, group, run) if params_spec else None,
    )


class ParamStore:
    """Stage 3's offloaded 16-bit shards beyond ``max_in_cpu`` elements in files (``offload_param.device: "nvme"``).

    Each group whose shard waits in host memory (:class:`hf_zero.zero.offload._HostParamShard`) is :meth:`adopt`-ed
    as it is built; the first ones keep their host shard while their elements add up to ``max_in_cpu``, the others'
    shards are written out and released, and their ``shard_store`` is this object: a gather calls :meth:`fetch`, a
    step's recast :meth:`put`. Reads run ahead along the order of the earlier fetches (the same every step), ``buffer_count`` at most.
    """

    def __init__(self, spec: NvmeSpec, group: dist.ProcessGroup | None, run: str | None = None) -> None:
        self.spec = spec
        self.folder = SwapFolder(spec, "params", group, run)
        self.files = SwapFiles(self.folder)
        self.names: dict[int, str] = {}
        self.numel: dict[int, int] = {}
        self.dtype: dict[int, torch.dtype] = {}
        self.on_disk: list[ShardGroup] = []
        self.error: str | None = None
        self._pending: dict[int, tuple[Ticket, torch.Tensor]] = {}  # group -> its write in flight (and its buffer)
        self._ahead: dict[int, tuple[Ticket, torch.Tensor]] = {}  # group -> its read in flight
        self._after: dict[int, int] = {}  # group -> the group fetched after it last time (reads run ahead along it)
        self._last: int | None = None
        self._by_id: dict[int, ShardGroup] = {}
        self.kept = 0  # elements of the shards kept in host memory (max_in_cpu at most)
        self._count = 0

    def adopt(self, g: ShardGroup) -> None:
        """Take group ``g`` (its 16-bit shard in host memory) as it is built: kept there while ``max_in_cpu`` allows,
        else written to disk at once and released. A failure is kept for :meth:`adopted`."""
        shard = g.param_shard  # type: ignore[attr-defined]
        assert shard is not None
        self._count += 1
        if self.kept + shard.numel() <= self.spec.max_in_cpu:
            self.kept += shard.numel()
            return
        self.names[id(g)] = f"shard{self._count - 1:05d}.bin"
        self.numel[id(g)], self.dtype[id(g)] = shard.numel(), shard.dtype
        self._by_id[id(g)] = g
        if self.error is None:
            self.error = self._write(g, shard).wait()
            self._pending.pop(id(g), None)
        _release(shard)
        g.shard_store = self  # type: ignore[attr-defined]
        self.on_disk.append(g)

    def adopted(self, group: dist.ProcessGroup | None) -> None:
        """Every group is built and written (collective: a failure stops every rank in one sentence)."""
        err, self.error = self.error, None
        pooled_raise(err, group)

    def _nbytes(self, g: ShardGroup) -> int:
        return self.numel[id(g)] * self.dtype[id(g)].itemsize

    def _write(self, g: ShardGroup, values: torch.Tensor) -> Ticket:
        buf = aligned_buffer(self._nbytes(g), pin=False)
        buf[: self._nbytes(g)].view(values.dtype).copy_(values.reshape(-1))
        ticket = self.files.write(self.names[id(g)], buf, self._nbytes(g))
        self._pending[id(g)] = (ticket, buf)
        return ticket

    def _read(self, g: ShardGroup) -> tuple[Ticket, torch.Tensor]:
        pending = self._pending.pop(id(g), None)
        if pending is not None:  # its write is in flight: the values are in its buffer already
            err = pending[0].wait()
            self.error = self.error or err
            return Ticket([], None), pending[1]
        buf = aligned_buffer(self._nbytes(g), pin=self.spec.pin_memory)
        return self.files.read(self.names[id(g)], buf, self._nbytes(g)), buf

    def fetch(self, g: ShardGroup) -> torch.Tensor:
        """Group ``g``'s shard in host memory (its read waited for); the next groups' reads start."""
        got = self._ahead.pop(id(g), None) or self._read(g)
        ticket, buf = got
        err = ticket.wait()
        if err:
            self.error = self.error or err
            logger.error("%s (rank raises it at the next step)", err)
            buf.zero_()  # the gathers go on with zeros, every rank's collectives matched; the step boundary raises
        if self._last is not None:
            self._after[self._last] = id(g)  # what followed the last fetch, for the reads ahead of the next pass
        self._last = id(g)
        nxt = id(g)
        for _ in range(max(1, self.spec.buffer_count)):
            nxt = self._after.get(nxt, -1)
            if nxt == id(g) or nxt not in self._by_id:
                break
            if nxt not in self._ahead:
                self._ahead[nxt] = self._read(self._by_id[nxt])
        return buf[: self._nbytes(g)].view(self.dtype[id(g)])

    def put(self, g: ShardGroup, values: torch.Tensor) -> None:
        """The step recast ``g``'s shard: write it back in the background (a fetch before it lands reads the buffer)."""
        old = self._ahead.pop(id(g), None)
        if old is not None:
            old[0].wait()
        prev = self._pending.pop(id(g), None)
        if prev is not None:
            self.error = self.error or prev[0].wait()
        self._write(g, values.to(self.dtype[id(g)]))

    def end(self) -> str | None:
        """Wait for every write in flight; the first failure's sentence since the last call (None: none)."""
        for gid, (ticket, _) in list(self._pending.items()):
            err = ticket.wait()
            self.error = self.error or err
            self._pending.pop(gid, None)
        err, self.error = self.error, None
        return err

    @contextlib.contextmanager
    def resident(self, group: dist.ProcessGroup | None) -> Iterator[None]:
        """Every offloaded shard in host memory as ``param_shard`` for the block (a save reads a frozen group's
        shard; a load's publish writes the trainable ones), then written back (collective)."""
        problem = None
        for g in self.on_disk:
            values = self.fetch(g).clone()
            g.param_shard.data = values  # type: ignore[attr-defined,union-attr]
            g.shard_store = None  # type: ignore[attr-defined]
        problem = self.error
        self.error = None
        pooled_raise(problem, group)
        try:
            yield
        finally:
            for g in self.on_disk:
                self._write(g, g.param_shard)  # type: ignore[attr-defined,arg-type]
                _release(g.param_shard)  # type: ignore[attr-defined,arg-type]
                g.shard_store = self  # type: ignore[attr-defined]
            err = self.end()
            pooled_raise(err, group)

    def close(self) -> None:
        self.files.close()
        self.folder.remove()
