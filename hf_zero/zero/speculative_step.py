"""``offload_optimizer.super_offload``'s host step: each group stepped on a background thread as soon as its gradient
reaches host memory in the backward that ends the step, undone exactly when the step's verdict (clipping, a non-finite
gradient, an fp16 overflow) says the assumption it stepped under was wrong (:class:`SpeculativeHostStep`). Split from
:mod:`hf_zero.zero.host_step`, whose ordinary :class:`~hf_zero.zero.host_step.HostStep` takes the groups it leaves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.zero.group import ShardGroup
from hf_zero.zero.host_step import fused_adam_group, intra_op_threads, step_master, sub_group_ranges


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


_MOMENTS = ("exp_avg", "exp_avg_sq")  # the per-element state an out-of-place step writes elsewhere


@dataclass
class _Undo:
    """What a speculative step of one group changed, to give it back.

    In place (an optimizer the one-pass kernel cannot take): ``master`` and ``state`` are copies of the master and its
    optimizer state from before the step (``state`` None: it had none yet). Out of place (``out``, the kernel's): the
    master and both moments are untouched and the step's results wait in ``out`` until :meth:`SpeculativeHostStep.commit`
    swaps them in; ``state`` then holds only the rest of the state from before the step (the step count), None when
    the step made it."""

    group: ShardGroup
    master: torch.Tensor | None
    state: dict[str, Any] | None
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    out16: bool = False  # the step also wrote the group's 16-bit host copy (speculative_out16), to be marked at commit


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

    Speculation is only worth its price while the verdict is unknown. With torch's Adam/AdamW (the one-pass kernel of
    :mod:`hf_zero.optim.host_adam`) the price is memory only: the step is taken *out of place*, the new master and
    moments written into a second set of host buffers the group keeps for the run
    (:meth:`hf_zero.zero.host_grads._HostMaster.step_out`) while the old stay as they were, so a step that stands is kept
    by swapping the buffers (no copy) and one that does not by not swapping; the step moves the bytes the ordinary
    step moves. Any other optimizer steps in place after a copy of the master and its state into undo buffers kept
    for the run (read and written again: about 1.9x the traffic of the step itself). So at the step the runner calls
    :meth:`settle`:
    the background thread takes no new group, the one it is stepping finishes, the groups still queued are left to
    the runner's ordinary step (no undo copy: the verdict is known by then), and :meth:`commit` returns those that
    were stepped. Which groups the background thread reached differs from rank to rank; the runner publishes in one
    fixed order whatever the split, so every rank issues the same collectives. DeepSpeed's SuperOffload undoes its
    step arithmetically instead, which does not give back the same bits. The optimizer's hyperparameters are checked
    too: a change between the backward and the step (a scheduler stepped early) undoes the speculation.

    A step right after one that clipped is not speculated (:meth:`arm`): gradient norms change slowly from step to
    step, so under clipping that bites (common early in a fine-tune with ``gradient_clipping`` 1.0) every speculation
    would be undone, and its undo copies and the step taken again would cost more than the step it hides. The
    verdict of every step is still read, armed or not, so the first step that does not clip arms the next one.

    One background thread steps the groups in the order their gradients arrive, on ``threads`` intra-op threads
    (:func:`host_step_threads` with ``cpuadam_cores_perc``: the backward's own threads keep the rest of the cores;
    torch's thread count is per thread, so the backward keeps the launcher's).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, threads: int | None, sub_group_size: int | None = None,
                 scratch: Callable[[int], torch.Tensor] | None = None) -> None:
        self.optimizer, self.threads = optimizer, threads
        self.sub_group_size = sub_group_size  # as HostStep's: each group stepped in ranges of about this many elements
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[int, Future[None]] = {}
        self._undo: dict[int, _Undo] = {}  # the groups stepped in the background this step, with what they overwrote
        self._coef: float | None = None  # armed: the coefficient the groups are stepped with
        self._stopped = False  # settle() or discard() came: the background thread starts no further group
        self._lock = threading.Lock()  # a group's start against settle(): either it is stepped, or left to the runner
        self._hyper: list[dict[str, Any]] = []
        # an fp32 host buffer of at least n elements for a gradient scaled by the step's coefficient (fp16's 1 / loss
        # scale): the host runner's, which its own step uses only for bf16 copies read clipped (never in an fp16 run);
        # None: a fresh tensor each time
        self.scratch = scratch
        self._backup: dict[int, dict[str, torch.Tensor]] = {}  # each group's undo buffers, reused every step
        self.cpu_seconds = 0.0  # the background steps' own time this step
        self._unclipped: float | None = None  # this step's coefficient if it does not clip (armed or not: arm's coef)
        self._clipped = False  # the last step whose verdict came clipped: the next is not speculated
        # since the start of the run: stepped in the background, of those kept and undone, and left to the ordinary
        # step because the verdict came first (settled); steps not speculated because the one before clipped (paused)
        self.counts = {"stepped": 0, "kept": 0, "undone": 0, "settled": 0, "paused": 0}

    @property
    def armed(self) -> bool:
        return self._coef is not None

    def arm(self, groups: list[ShardGroup], coef: float) -> bool:
        """Before the backward that ends a step: step each group with ``coef`` as its gradient arrives.

        Not armed (False) when a master still holds a ``.grad`` (a step whose gradients nobody dropped): torch's
        optimizer would step that master as well; nor when the last step clipped (the class docstring says why).
        """
        self.discard()
        self._unclipped, self.cpu_seconds = float(coef), 0.0
        if any(g.master is not None and g.master.grad is not None for g in groups):
            return False
        if self._clipped:
            self.counts["paused"] += 1
            return False
        self._coef, self._hyper = float(coef), _hyperparameters(self.optimizer)
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
            if coef != 1.0:  # the policy's scale_grads multiplies the host copy by this same float (a bf16 copy widened)
                n = grad.numel()
                out = (torch.empty(n) if self.scratch is None else self.scratch(n)[:n]).view_as(grad)
                grad = torch.mul(grad, coef, out=out) if grad.dtype == out.dtype else out.copy_(grad).mul_(coef)
            state = self.optimizer.state.get(master)
            # The one-pass kernel steps out of place into the group's second buffers (hf_zero/optim/host_adam.py;
            # commit swaps them in); otherwise a copy before a step in place
            if fused_adam_group(self.optimizer, master, grad) is not None:
                rest = None if not state else {k: v.clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in state.items() if k not in _MOMENTS}
                saved = _Undo(group, None, rest, group.step_out())  # type: ignore[attr-defined]
            else:
                saved = self._save(group, master, state)
            # the 16-bit host copy the publish sends (stages 1-2) or the gathers read (stage 3's host shard) is written
            # in the same pass, into a buffer nothing reads until commit says the step stands
            out16 = group.speculative_out16() if saved.out is not None else None  # type: ignore[attr-defined]
            saved.out16 = out16 is not None
            self._undo[id(group)] = saved
            try:
                ranges = [(0, master.numel())] if self.sub_group_size is None else sub_group_ranges(
                    group, self.sub_group_size)
                step_master(self.optimizer, master, grad, ranges, out16=out16, out=saved.out)
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
        """Undo: in place, the master and state copied back; out of place, the master and moments are as they were and
        only the rest of the state (the step count) goes back."""
        master = saved.group.master
        assert master is not None
        if saved.master is not None:
            master.copy_(saved.master)
        if saved.state is None:
            self.optimizer.state.pop(master, None)
        else:
            state = self.optimizer.state[master]
            for k in [k for k in state if k not in saved.state and saved.out is None]:
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
        if self._unclipped is not None:  # armed or paused: whether this step clipped decides the next one's speculation
            self._clipped, self._unclipped = float(coef) != self._unclipped, None
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
        for saved in self._undo.values():
            if saved.out is not None:  # the results of an out-of-place step become the master and the moments
                saved.group.swap_in_step(self.optimizer.state[saved.group.master])  # type: ignore[attr-defined]
            if saved.out16:
                saved.group.speculative_out16_written()  # type: ignore[attr-defined]
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
