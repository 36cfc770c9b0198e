"""Checkpoints written in the background (``"checkpoint": {"async_save": true}``).

[Note: one background save]

On the main thread, inside ``save_checkpoint`` (what training waits for):

1. the previous background save is waited for: at most one is in flight, and its host buffers are
   the ones this save reuses;
2. every check and agreement of a synchronous save runs as before (``checkpoint/save.py``), and rank 0
   creates ``.<tag>.partial``;
3. the host memory the copy still needs is checked, every machine's ranks added up, and the first time
   a gloo process group for the writers is made (collective, over the ranks that save together);
4. every rank copies its share into host buffers it keeps between saves (pinned on a GPU, so the copies
   are asynchronous and queue behind the step's kernels on the current stream); its RNG state, its index
   and, on rank 0, the content of ``checkpoint.json`` are taken now, so they describe this step.

Then a thread (:class:`BackgroundWriter`):

5. waits for the copies (an event recorded after them), writes the files and the rank's index;
6. pools every rank's outcome over the writers' gloo group — never the training group, on which the main
   thread keeps issuing collectives: collectives of two threads on one group would be matched in different
   orders on different ranks;
7. rank 0 writes ``checkpoint.json``, publishes and rotates only when every rank's write is complete, and
   the outcome is pooled again.

An error in the thread is raised on every rank, in one sentence, at the next wait point: the next
``save_checkpoint``, ``load_checkpoint``, ``engine.destroy()``, ``engine.wait_for_checkpoint()`` or a
preemption. At the process's end the thread (not a daemon) is joined before ``atexit`` handlers run, so
before ``hf_zero.distributed.dist``'s exit barrier; a failure found only then is printed.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.checkpoint.ranks import attempt, reason
from hf_zero.distributed.dist import comm_timeout, describe_peer_failure, gather_json
from hf_zero.errors import CheckpointError
from hf_zero.zero.offload import HOST_RESERVE_FRACTION, available_host_bytes, host_buffer

logger = logging.getLogger("hf_zero")

# The writers' group waits for a slow peer's write (a rank with more to write, a slower disk) as long as
# this at least; a peer that died is seen at once (its connection closes).
WRITER_TIMEOUT = datetime.timedelta(minutes=30)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@dataclass
class WriteJob:
    """One background save: the host copies, what describes them, and where they go."""

    tensors: dict[str, tuple[torch.Tensor, torch.dtype]]  # host copies and the dtype each is stored in
    rank_meta: dict[str, Any]
    write: Callable[[], None]  # this rank's files and index
    finish: Callable[[], None] | None  # rank 0: checkpoint.json, publish, rotate
    event: Any  # a CUDA event recorded after the copies, or None
    path: str
    save_dir: str
    partial: str
    rank: int
    thread: threading.Thread | None = None
    errors: list[str | None] = field(default_factory=list)
    local: str | None = None  # this rank could not pool (a peer died): its own account


class BackgroundWriter:
    """One engine's background saves: its reusable host buffers, the writers' group, the save in flight."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        # key -> (the flat host buffer, its view in the tensor's shape): the flat one is kept because its pages
        # stay registered with CUDA (pinned) for as long as that tensor object lives (zero/offload.py host_buffer)
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.group: Any = None
        self.group_of: Any = object()  # the training group the writers' group was made for
        self.job: WriteJob | None = None

    # ---------------------------------------------------------------- waiting

    @property
    def in_flight(self) -> bool:
        return self.job is not None

    def wait(self) -> str | None:
        """Wait for the save in flight; its path, or None when there was none. Raises its error on every rank."""
        job, self.job = self.job, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()
        self._verdict(job)
        return job.path

    @staticmethod
    def _verdict(job: WriteJob) -> None:
        """Raise the job's error, one sentence the same on every rank (or this rank's own when pooling failed)."""
        if job.local is not None:
            raise CheckpointError(
                f"the background write of {job.path} failed on rank {job.rank} ({job.local}); the checkpoints already "
                f"in {job.save_dir} are kept"
            )
        for r, e in enumerate(job.errors):
            if e:
                if all(x == e for x in job.errors):
                    raise CheckpointError(f"the background write of {job.path} failed on every rank ({e}); the checkpoints "
                                          f"already in {job.save_dir} are kept")
                raise CheckpointError(f"the background write of {job.path} failed on rank {r} ({e}); the checkpoints "
                                      f"already in {job.save_dir} are kept")

    # ------------------------------------------------------------- on the main thread

    def prepare(self, plan: dict[str, tuple[torch.Tensor, torch.dtype]], planned_error: str | None,
                group: Any, world: int, rank: int) -> list[str | None]:
        """Collective: every rank's planning error, or the host-memory refusal, the same on every rank.

        The bytes checked are those the copy still has to allocate (buffers kept from the last save count
        as held), against ``MemAvailable`` less :data:`HOST_RESERVE_FRACTION`, the ranks of each machine
        added up. Unlike offload's plan (made before the processes hold anything), the processes' own
        memory is already outside ``MemAvailable`` here, so no per-rank reserve is kept.
        """
        need = sum(v.numel() * torch.empty((), dtype=d).element_size() for k, (v, d) in plan.items()
                   if not self._reusable(k, v, d))
        try:
            available = available_host_bytes()
        except OSError:
            available = -1  # not Linux: nothing to check with
        mine = {"error": planned_error, "host": socket.gethostname(), "need": need, "available": available}
        rows = gather_json(mine, group) if world > 1 else [mine]
        errors = [r["error"] for r in rows]
        if any(errors):
            return errors
        for host in dict.fromkeys(r["host"] for r in rows):
            here = [r for r in rows if r["host"] == host]
            total, avail = sum(r["need"] for r in here), min(r["available"] for r in here)
            if avail >= 0 and total > avail * (1 - HOST_RESERVE_FRACTION):
                sentence = (
                    f"checkpoint.async_save needs {_size(total)} more host memory on {host} ({len(here)} rank(s) x a "
                    f"copy of their checkpoint share) but {_size(avail)} is available (MemAvailable, of which "
                    f"{HOST_RESERVE_FRACTION:.0%} stays free); turn checkpoint.async_save off, or save from more machines"
                )
                return [sentence] * len(rows)
        if world > 1 and self.group_of is not group:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            timeout = max(comm_timeout() or WRITER_TIMEOUT, WRITER_TIMEOUT)
            self.group = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
            self.group_of = group
        return [None] * len(rows)

    def _reusable(self, key: str, view: torch.Tensor, dtype: torch.dtype) -> bool:
        held = self.buffers.get(key)
        return held is not None and held[1].dtype == dtype and held[1].shape == view.shape

    def copy(self, plan: dict[str, tuple[torch.Tensor, torch.dtype]]) -> tuple[dict[str, torch.Tensor], Any]:
        """This rank's share in its host buffers (allocated at the first save, reused after), and the event to wait for."""
        out: dict[str, torch.Tensor] = {}
        on_gpu = False
        for key, (view, dtype) in plan.items():
            if not self._reusable(key, view, dtype):
                flat = host_buffer(view.numel(), dtype, self.pin)
                self.buffers[key] = (flat, flat.view(view.shape))
            buf = self.buffers[key][1]
            on_gpu = on_gpu or view.device.type == "cuda"
            buf.copy_(view, non_blocking=self.pin and view.device.type == "cuda")
            out[key] = buf
        for key in set(self.buffers) - set(plan):
            del self.buffers[key]  # a key gone since the last save (optimizer state replaced): its memory goes
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        return out, event

    def start(self, job: WriteJob) -> None:
        """Hand the job to a thread (not a daemon: the interpreter waits for it before exiting)."""
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"hf_zero-save-{os.path.basename(job.path)}")
        self.job = job
        job.thread.start()

    # ----------------------------------------------------------------- the thread

    def _pool(self, error: str | None) -> list[str | None]:
        return gather_json(error, self.group) if self.group is not None else [error]

    def _run(self, job: WriteJob) -> None:
        try:
            if job.event is not None:
                job.event.synchronize()  # the copies into the host buffers are done
            errors = self._pool(attempt(job.write)[1])
            err = None
            if not any(errors) and job.finish is not None:
                err = attempt(job.finish)[1]
            if job.rank == 0 and (any(errors) or err):
                shutil.rmtree(job.partial, ignore_errors=True)  # not published; free its space
            job.errors = errors if any(errors) else self._pool(err)
        except Exception as e:  # noqa: BLE001 - a collective of the writers' group failed: a peer is gone
            job.local = describe_peer_failure(e, "the background checkpoint write") or reason(e)
        if threading.main_thread().is_alive():
            return
        try:  # the process is ending: nobody will wait for this save any more, so say how it went
            self._verdict(job)
        except CheckpointError as e:
            logger.error("%s", e)
