"""The offloaded optimizer's host step: the masters stepped on the CPU group by group, and its threads.

:class:`HostStep` is the step :mod:`hf_zero.zero.runner`'s host runners take inside ``engine.step()`` (or, with
``overlap_param_gather``, group by group inside the next forward); :class:`SpeculativeHostStep` is
``offload_optimizer.super_offload``'s: each group stepped on a background thread as soon as its gradient reaches
host memory in the backward that ends the step, undone exactly when the step's verdict (clipping, a non-finite
gradient, an fp16 overflow) says the assumption it stepped under was wrong. :func:`host_step_threads` sizes the
host step's threads to the rank's share of the machine's cores (``offload_optimizer.cpuadam_cores_perc`` of it).
Split from :mod:`hf_zero.zero.offload`, which holds the groups and the host memory plan.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.zero import collectives as C
from hf_zero.zero.group import ShardGroup

# Optimizers whose state is per element (tensors the master's size) or one scalar (a step count): a slice of the master
# steps with slices of that state exactly as the whole would, element by element, so sub-groups may cut a group.
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def sub_group_ranges(group: ShardGroup, sub_group_size: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` of ``group``'s master that its host step takes one at a time under ``sub_group_size``.

    DeepSpeed 0.19.8's meaning (stage 3's sub-groups): parameters are taken in order into a sub-group until it holds
    ``sub_group_size`` elements or more, so a sub-group never cuts a parameter and a parameter larger than the size is
    a sub-group of its own; 0 makes every parameter one (axolotl's configs give 0). Here the parameters are this
    rank's partitions of the group's (:meth:`ShardGroup.partitions`), the last range running to the end of the shard's
    padding. One range (the whole master) when the size covers the group, and for a master that is not the flat shard.
    """
    master = group.master
    if master is None or master.dim() != 1 or master.numel() != group.shard_numel or sub_group_size >= master.numel():
        return [(0, 0 if master is None else master.numel())]
    out: list[tuple[int, int]] = []
    lo = hi = 0
    for _, at, n in group.partitions():
        if n == 0:
            continue
        hi = at + n
        if hi - lo >= sub_group_size:
            out.append((lo, hi))
            lo = hi
    if lo < master.numel():
        out.append((lo, master.numel()))
    return out


def _per_element(v: Any, master: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == master.numel()


def step_master(optimizer: torch.optim.Optimizer, master: torch.Tensor, grad: torch.Tensor,
                ranges: list[tuple[int, int]]) -> None:
    """Step ``master`` with ``grad`` (the only master with a gradient now) one range at a time, equal bit for bit to one
    call over the whole (each element's update reads only that element's values and a shared step count).

    Why: ``sub_group_size`` bounds what one optimizer call touches at once (an unfused optimizer's temporaries are the
    size of its tensors) and is the granularity a streamed step copies in. How: each range steps as a view of the
    master that takes the master's place in its param group, with views of its state; the step count, the same for
    every range, goes back to the master's state once. At the first step, when the optimizer makes its state lazily,
    each range gets its own and the pieces are joined into the master's. An optimizer whose state is not per element
    (:data:`_ELEMENTWISE` lists those known to be) and a single range step the whole master in one call.
    """
    if len(ranges) <= 1 or not isinstance(optimizer, _ELEMENTWISE):
        master.grad = grad
        try:
            optimizer.step()
        finally:
            master.grad = None
        return
    pg = next(pg for pg in optimizer.param_groups if any(p is master for p in pg["params"]))
    params = pg["params"]
    full = optimizer.state.get(master)
    first = not full
    pieces: list[dict[str, Any]] = []
    try:
        for lo, hi in ranges:
            view = master[lo:hi]
            view.grad = grad[lo:hi]
            if not first:
                optimizer.state[view] = {
                    k: (v[lo:hi] if _per_element(v, master) else v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in full.items()}  # type: ignore[union-attr]
            pg["params"] = [view if p is master else p for p in params]
            try:
                optimizer.step()
            finally:
                view.grad = None
                pieces.append(optimizer.state.pop(view, {}))
    finally:
        pg["params"] = params
    last = pieces[-1]
    if first:  # join the ranges' fresh state into the master's
        optimizer.state[master] = {
            k: (torch.cat([piece[k] for piece in pieces]) if isinstance(v, torch.Tensor) and v.dim() == 1 else v)
            for k, v in last.items()}
        return
    for k, v in last.items():  # the per-element state was written through the views; the step count goes back
        old = full.get(k)  # type: ignore[union-attr]
        if _per_element(old, master):
            continue
        if isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape:
            old.copy_(v)
        else:
            full[k] = v  # type: ignore[index]


class HostStep:
    """One optimizer step over host masters, one shard group at a time, each group published once it is stepped.

    ``work`` lists ``(group, gradient)`` in the order to step: the gradient is the group's host copy, or, in
    the streamed mode, its fp32 shard on the device, which is copied into one of the two shared pinned
    ``streamed`` buffers while the CPU steps the group before it. The optimizer is the one the user or the
    config made; it sees one group's gradient at a time (torch's optimizers skip a parameter without
    ``.grad``), so each master is updated once with its own step count, and its state, ``state_dict()`` and
    any LR scheduler built on it stay as they are.

    Run whole inside ``engine.step()`` (:meth:`finish`), or, with ``overlap_param_gather`` at stages 1-2
    (``defer``), group by group where the next forward first reads each group: the group's
    :meth:`~hf_zero.zero.flat.FlatGroup.wait` calls :meth:`through`, which steps every group up to it, so the
    CPU steps the later blocks' masters while the GPU runs the earlier blocks' forward. The hyperparameters
    (lr, betas, weight decay) each group steps with are those of the ``engine.step()`` that made this object:
    a scheduler's ``step()`` right after it must not reach groups stepped later.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, stream: torch.cuda.Stream | None,
                 work: list[tuple[ShardGroup, torch.Tensor]], *, streamed: list[torch.Tensor] | None = None,
                 defer: bool = False, on_done: Callable[[float], None] | None = None, threads: int | None = None,
                 swap: Any = None, prestepped: frozenset[int] = frozenset(), sub_group_size: int | None = None) -> None:
        self.optimizer, self.stream, self.defer, self.on_done = optimizer, stream, defer, on_done
        # zero_optimization.sub_group_size: each group stepped in ranges of about that many elements (sub_group_ranges);
        # None: each group in one call
        self.sub_group_size = sub_group_size
        # ids of the groups SpeculativeHostStep already stepped with this step's gradient, coefficient and
        # hyperparameters (super_offload): only published here
        self.prestepped = prestepped
        # NVMe (hf_zero/zero/nvme.py OptimizerSwap): each group's master and state read in before its step, written after
        self.swap = swap
        self.threads = threads  # the optimizer's intra-op threads (host_step_threads); None: the process's count
        self.work: list[tuple[ShardGroup, torch.Tensor | None]] = list(work)
        self._index = {id(g): i for i, (g, _) in enumerate(self.work)}
        self._hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer.param_groups]
        self._streamed = streamed
        self.next = 0  # groups stepped so far
        self.cpu_seconds = 0.0  # the optimizer's own time
        self._fetched = self._fetch(0) if streamed is not None and self.work else None

    @property
    def done(self) -> bool:
        return self.next >= len(self.work)

    def _fetch(self, i: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying group ``i``'s device gradient into its shared host buffer (streamed mode)."""
        assert self._streamed is not None
        grad = self.work[i][1]
        assert grad is not None
        dst = self._streamed[i % 2][: grad.numel()]
        event = None
        with C.on_stream(self.stream):
            dst.copy_(grad, non_blocking=dst.is_pinned())
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return dst, event

    def through(self, group: ShardGroup) -> None:
        """Step, in order, every group up to and including ``group`` that is not stepped yet."""
        last = self._index.get(id(group), -1)
        while self.next <= last:
            self._step_one()

    def finish(self) -> None:
        """Step every group not stepped yet."""
        while not self.done:
            self._step_one()

    def _step_one(self) -> None:
        i = self.next
        self.next += 1  # first: the publish below may wait on a group whose deferred step points back here
        g, grad = self.work[i]
        if self._fetched is not None:
            grad, event = self._fetched
            if event is not None:
                event.synchronize()
            if i + 1 < len(self.work):
                self._fetched = self._fetch(i + 1)  # into the other buffer, whose group was stepped last round
        self.work[i] = (g, None)  # streamed: the device shard may go once its copy has landed
        assert g.master is not None and grad is not None
        groups = self.optimizer.param_groups
        live = [{k: pg[k] for k in hyper} for pg, hyper in zip(groups, self._hyper)] if self.defer else []
        for pg, hyper in zip(groups, self._hyper if self.defer else []):
            pg.update(hyper)  # this step's lr etc., whatever a scheduler set since
        # The group's host passes (the optimizer, and under offload_param the cast of the master into the 16-bit
        # shard the gathers read) run on the rank's share of the CPUs, not on the launcher's OMP_NUM_THREADS=1.
        if self.swap is not None:
            self.swap.attach(g)
        with intra_op_threads(self.threads):
            start = time.perf_counter()
            try:
                if id(g) not in self.prestepped:
                    ranges = [(0, g.master.numel())] if self.sub_group_size is None else sub_group_ranges(
                        g, self.sub_group_size)
                    step_master(self.optimizer, g.master, grad, ranges)
            finally:
                self.cpu_seconds += time.perf_counter() - start
                for pg, values in zip(groups, live):
                    pg.update(values)
            if self.defer:
                g.publish_master(self.stream, defer=True)  # type: ignore[call-arg]
            else:
                g.publish_master(self.stream)
        if self.swap is not None:
            self.swap.detach(g)
        if self.done and self.on_done is not None:
            self.on_done(self.cpu_seconds)



def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer.param_groups]


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here: the same setting


def _same_hyperparameters(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x) for x, y in zip(a, b))


@dataclass
class _Undo:
    """What a speculative step of one group overwrote: its master and its optimizer state (None: it had none yet)."""

    group: ShardGroup
    master: torch.Tensor
    state: dict[str, Any] | None


class SpeculativeHostStep:
    """``offload_optimizer.super_offload``: each group's host step taken during the backward that ends the step, as
    soon as its gradient is in host memory, on a background thread, and undone exactly where the step decides
    otherwise.

    Why: :class:`HostStep` starts only once backward has ended and the global norm is known, so the CPU waits
    through the backward and the GPU through the CPU step. What a group's step needs that is global is one number,
    the coefficient the step policy (:mod:`hf_zero.training.step`) multiplies the gradients by (the fp16 unscale times the
    clipping factor), and whether the step is applied at all (an fp16 overflow or a non-finite gradient skips it).
    Both are known only after the last gradient, so the step is taken *speculatively* with the coefficient of a
    step that does not clip (``1 / loss scale``, :meth:`arm`), and :meth:`verdict` compares it with the one the
    policy computed: different (clipping applies), or the step is skipped (:meth:`discard`), every speculatively
    stepped group gets back its master and optimizer state, saved just before its step, and the runner steps it the
    ordinary way. The arithmetic of a step that stands is the ordinary step's (the same optimizer call on the same
    master and the same gradient values, multiplied by the same float), so the weights equal :class:`HostStep`'s bit
    for bit either way.

    Speculation is only worth its price while the verdict is unknown. The price is the undo copy of each master and its
    state (16 bytes per element with Adam, read and written again: about 1.9x the traffic of the step itself), in
    host memory, in buffers kept for the run and reused every step. So at the step the runner calls :meth:`settle`:
    the background thread takes no new group, the one it is stepping finishes, the groups still queued are left to
    the runner's ordinary step (no undo copy: the verdict is known by then), and :meth:`commit` returns those that
    were stepped. Which groups the background thread reached differs from rank to rank; the runner publishes in one
    fixed order whatever the split, so every rank issues the same collectives. DeepSpeed's SuperOffload undoes its
    step arithmetically instead, which does not give back the same bits. The optimizer's hyperparameters are checked
    too: a change between the backward and the step (a scheduler stepped early) undoes the speculation.

    One background thread steps the groups in the order their gradients arrive, on ``threads`` intra-op threads
    (:func:`host_step_threads` with ``cpuadam_cores_perc``: the backward's own threads keep the rest of the cores;
    torch's thread count is per thread, so the backward keeps the launcher's).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, threads: int | None, sub_group_size: int | None = None) -> None:
        self.optimizer, self.threads = optimizer, threads
        self.sub_group_size = sub_group_size  # as HostStep's: each group stepped in ranges of about this many elements
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[int, Future[None]] = {}
        self._undo: dict[int, _Undo] = {}  # the groups stepped in the background this step, with what they overwrote
        self._coef: float | None = None  # armed: the coefficient the groups are stepped with
        self._stopped = False  # settle() or discard() came: the background thread starts no further group
        self._lock = threading.Lock()  # a group's start against settle(): either it is stepped, or left to the runner
        self._hyper: list[dict[str, Any]] = []
        self._scratch: torch.Tensor | None = None
        self._backup: dict[int, dict[str, torch.Tensor]] = {}  # each group's undo buffers, reused every step
        self.cpu_seconds = 0.0  # the background steps' own time this step
        # since the start of the run: stepped in the background, of those kept and undone, and left to the ordinary
        # step because the verdict came first (settled)
        self.counts = {"stepped": 0, "kept": 0, "undone": 0, "settled": 0}

    @property
    def armed(self) -> bool:
        return self._coef is not None

    def arm(self, groups: list[ShardGroup], coef: float) -> bool:
        """Before the backward that ends a step: step each group with ``coef`` as its gradient arrives.

        Not armed (False) when a master still holds a ``.grad`` (a step whose gradients nobody dropped): torch's
        optimizer would step that master as well.
        """
        self.discard()
        if any(g.master is not None and g.master.grad is not None for g in groups):
            return False
        self._coef, self._hyper, self.cpu_seconds = float(coef), _hyperparameters(self.optimizer), 0.0
        self._stopped = False
        return True

    def submit(self, group: ShardGroup, grad: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """``group``'s gradient is (or, once ``ready`` has fired, will be) in host memory: step it in the background."""
        if self._coef is None or self._stopped or id(group) in self._futures:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-host-step")
        self._futures[id(group)] = self._pool.submit(self._step, group, grad, ready, self._coef)

    def _step(self, group: ShardGroup, grad: torch.Tensor, ready: torch.cuda.Event | None, coef: float) -> None:
        if ready is not None:
            ready.synchronize()
        master = group.master
        assert master is not None
        with self._lock:
            if self._stopped:  # the verdict came first: the runner's ordinary step takes this group
                return
        # Past this point the group is stepped whatever settle() says: settle() waits for this call to return.
        with intra_op_threads(self.threads):
            start = time.perf_counter()
            self._undo[id(group)] = self._save(group, master, self.optimizer.state.get(master))
            if coef != 1.0:  # the policy's scale_grads multiplies the host copy by this same float
                if self._scratch is None or self._scratch.numel() < grad.numel():
                    self._scratch = torch.empty(grad.numel(), dtype=grad.dtype)
                grad = torch.mul(grad, coef, out=self._scratch[: grad.numel()].view_as(grad))
            try:
                ranges = [(0, master.numel())] if self.sub_group_size is None else sub_group_ranges(
                    group, self.sub_group_size)
                step_master(self.optimizer, master, grad, ranges)
            finally:
                self.cpu_seconds += time.perf_counter() - start
        self.counts["stepped"] += 1

    def _save(self, group: ShardGroup, master: torch.Tensor, state: dict[str, Any] | None) -> _Undo:
        """Copy ``master`` and its optimizer state into this group's undo buffers, allocated at its first step.

        The buffers live as long as the run: a fresh ``clone`` per step would hand the allocator 16 bytes per element
        that it returns to the system at every free, and touching new pages again each step cost more than the step
        (2.81B parameters on 2 GPUs: 2,511 tokens/s/GPU against 8,547 without speculation).
        """
        keep = self._backup.setdefault(id(group), {})
        copy = keep.get("__master__")
        if copy is None or copy.shape != master.shape or copy.dtype != master.dtype:
            copy = keep["__master__"] = torch.empty_like(master)
        copy.copy_(master)
        if not state:
            return _Undo(group, copy, None)
        saved: dict[str, Any] = {}
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                buf = keep.get(k)
                if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                    buf = keep[k] = torch.empty_like(v)
                saved[k] = buf.copy_(v)
            else:
                saved[k] = v
        return _Undo(group, copy, saved)

    def undo(self, group: ShardGroup) -> None:
        """Give ``group`` back its master and optimizer state from before its speculative step (none: nothing to do);
        its gradient changed (reduced again in this backward) or the step will not stand. A step still queued is
        dropped unrun; the group may be submitted again."""
        future = self._futures.pop(id(group), None)
        if future is None:
            return
        future.cancel()
        try:
            if not future.cancelled():
                future.result()
        finally:
            saved = self._undo.pop(id(group), None)
            if saved is not None:
                self._restore(saved)

    def _restore(self, saved: _Undo) -> None:
        master = saved.group.master
        assert master is not None
        master.copy_(saved.master)
        if saved.state is None:
            self.optimizer.state.pop(master, None)
        else:
            state = self.optimizer.state[master]
            for k in [k for k in state if k not in saved.state]:
                del state[k]
            for k, v in saved.state.items():
                if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor) and state[k].shape == v.shape:
                    state[k].copy_(v)
                else:  # a copy: the undo buffers are reused next step
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        self.counts["undone"] += 1

    def _stop(self) -> None:
        """No further group starts: the queued ones are cancelled, the one running finishes (or, not past its undo
        copy yet, returns unstepped); raises what a background step raised, after waiting for all of them."""
        with self._lock:
            self._stopped = True
        for future in self._futures.values():
            future.cancel()
        first: BaseException | None = None
        for future in self._futures.values():
            if future.cancelled():
                continue
            try:
                future.result()
            except BaseException as e:  # wait for the others first, then say what failed
                first = first or e
        self._futures = {gid: f for gid, f in self._futures.items() if gid in self._undo}  # those actually stepped
        if first is not None:
            raise first

    def drain(self) -> None:
        """Wait for every step queued or in flight (tests: a backward whose groups were all stepped before the
        verdict); a failed one undoes them all and raises."""
        try:
            for future in list(self._futures.values()):
                future.result()
        except BaseException:
            self.discard()
            raise

    def verdict(self, coef: torch.Tensor | float) -> None:
        """The step policy's coefficient for this step: the speculative steps stand only if they used it.

        When they stand and the coefficient is the float 1.0 (bf16 or fp32, no clipping: the policy leaves the
        gradients as they are) nothing is waited for here; :meth:`settle` at the step stops the background thread.
        Any other coefficient is about to be multiplied into the host copies in place, which a background step may
        be reading: the background thread is settled first."""
        if self._coef is None:
            return
        if float(coef) != self._coef or not _same_hyperparameters(self._hyper, _hyperparameters(self.optimizer)):
            self.discard()
        elif not (isinstance(coef, float) and coef == 1.0):
            self.settle()

    def settle(self) -> None:
        """The step is being taken: the background thread starts no further group and the one it steps finishes, so
        the runner may hand the masters their ``.grad`` and step the rest itself (a failed background step undoes
        them all and raises)."""
        if self._coef is None:
            return
        try:
            self._stop()
        except BaseException:
            self.discard()
            raise

    def commit(self, stepped: set[int]) -> frozenset[int]:
        """At the step, after :meth:`settle`: the ids of the groups whose speculative step stands (the runner only
        publishes them, and steps the others itself).

        ``stepped`` are the ids of the groups the step takes; a speculative step of any other group is undone.
        """
        if self._coef is None:
            return frozenset()
        self.settle()
        if not _same_hyperparameters(self._hyper, _hyperparameters(self.optimizer)):
            self.discard()
            return frozenset()
        for gid in [gid for gid in self._undo if gid not in stepped]:
            self.undo(self._undo[gid].group)
        kept = frozenset(self._undo)
        self.counts["kept"] += len(kept)
        self.counts["settled"] += len(stepped - kept)
        self._futures.clear()
        self._undo.clear()
        self._coef = None
        return kept

    def discard(self) -> None:
        """Undo every speculative step of this step (skipped, cleared, or the masters read for a save); disarm."""
        self._coef = None
        first: BaseException | None = None
        try:
            self._stop()
        except BaseException as e:  # restore the others first, then say what failed
            first = e
        for gid in list(self._undo):
            self._restore(self._undo.pop(gid))
        self._futures.clear()
        self._undo.clear()
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop the background thread (``engine.destroy()``); what it stepped this step is undone first."""
        try:
            self.discard()
        finally:
            self._backup.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


# The environment variable that fixes the host step's thread count, over what host_step_threads would choose.
HOST_THREADS_ENV = "HF_ZERO_HOST_THREADS"


def _cgroup_cpus() -> float | None:
    """The CPUs a cgroup-v2 quota (``cpu.max``, a container's CPU limit) allows this process, or None without one."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1.0, int(quota) / int(period))


def host_step_threads(group: dist.ProcessGroup | None = None, cores_perc: float | None = None) -> tuple[int, str]:
    """How many threads this rank's offloaded CPU step runs on, and a phrase saying where the figure came from.

    Launchers (torchrun, ``hf-zero launch``, ``accelerate launch``) export ``OMP_NUM_THREADS=1`` when they start
    several processes, which is right for the model's CPU ops but leaves the host optimizer, the bulk of an offloaded
    step, on one core of a 32-core machine (2.8B on 2 H100s: 3,618 tokens/s per GPU, against 8,728 with 16 threads). So the step
    sizes its own pool from the CPUs this rank may run on (its affinity), each CPU shared among the ranks of this
    machine whose affinity holds it, capped by a container's CPU quota, times ``cores_perc`` when the config gives
    DeepSpeed's ``offload_optimizer.cpuadam_cores_perc``. ``HF_ZERO_HOST_THREADS`` overrides all of it. The ranks
    exchange their affinity masks with one all-gather over ``group`` (every rank calls this).
    """
    forced = os.environ.get(HOST_THREADS_ENV, "").strip()
    if forced:
        try:
            n = int(forced)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{HOST_THREADS_ENV}={forced!r} is not a thread count; set it to a positive integer or unset it")
        return n, f"{HOST_THREADS_ENV}={n}"
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        mine = list(range(os.cpu_count() or 1))
    ncpu = max([os.cpu_count() or 1, *(c + 1 for c in mine)])
    words = (ncpu + 63) // 64
    mask = [0] * words
    for c in mine:
        mask[c // 64] |= 1 << (c % 64)
    host = zlib.crc32(socket.gethostname().encode())
    # int64 words: the top bit of a mask word would overflow a signed tensor, so each word carries 63 bits at most
    row = [host, ncpu, *(w if w < 2**63 else w - 2**64 for w in mask)]
    rows = [row]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        width = torch.tensor([len(row)], dtype=torch.int64)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        widths = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(widths, width.to(device), group=group)
        longest = max(int(w) for w in widths)
        padded = torch.tensor(row + [0] * (longest - len(row)), dtype=torch.int64)
        out = [torch.empty(longest, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(out, padded.to(device), group=group)
        rows = [r.cpu().tolist() for r in out]
    local = [r for r in rows if r[0] == host]

    def cpus(r: list[int]) -> set[int]:
        return {64 * i + b for i, w in enumerate(r[2:]) for b in range(64) if (w % 2**64) >> b & 1}

    sharers: dict[int, int] = {}
    for r in local:
        for c in cpus(r):
            sharers[c] = sharers.get(c, 0) + 1
    share = sum(1.0 / sharers[c] for c in mine if c in sharers) or 1.0
    quota = _cgroup_cpus()
    if quota is not None:
        share = min(share, quota / len(local))
    why = f"{len(mine)} CPUs in its affinity, shared by {len(local)} rank(s) of this machine"
    if quota is not None:
        why += f", a CPU quota of {quota:g}"
    if cores_perc is not None:
        share *= cores_perc
        why += f", cpuadam_cores_perc {cores_perc:g}"
    return max(1, int(share)), why


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads (torch's pool; the fused CPU Adam splits its pass over them), then put
    back what the process had, so the model's own CPU ops keep the count the launcher chose."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
