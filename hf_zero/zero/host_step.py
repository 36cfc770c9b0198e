"""The offloaded optimizer's host step: the masters stepped on the CPU group by group, and its threads.

:class:`HostStep` is the step :mod:`hf_zero.zero.runner`'s host runners take inside ``engine.step()`` (or, with
``overlap_param_gather``, group by group inside the next forward); ``offload_optimizer.super_offload``'s background
steps during backward are :mod:`hf_zero.zero.speculative_step`'s. :func:`host_step_threads` sizes the host step's
threads to the rank's share of the machine's cores (``offload_optimizer.cpuadam_cores_perc`` of it). Split from
:mod:`hf_zero.zero.offload`, which holds the groups and the host memory plan.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.optim import host_adam
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


def fused_adam_group(optimizer: torch.optim.Optimizer, master: torch.Tensor, grad: torch.Tensor | None) -> dict | None:
    """The param group ``master`` steps in, when the one-pass host kernel can take its step (else None).

    That is torch's Adam or AdamW (or a subclass that keeps their ``step``: DeepSpeed's ``FusedAdam`` here) with its
    fused kernel chosen (:func:`hf_zero.zero.offload.use_host_kernels`), without
    AMSGrad or the differentiable and capturable modes, on a contiguous fp32 master with an fp32 or bf16 gradient
    (None: any such gradient), where the kernel builds (:func:`hf_zero.optim.host_adam.available`): its results are
    torch's kernel's bit for bit.
    """
    if not isinstance(optimizer, torch.optim.Adam) or master.dtype != torch.float32 or not master.is_contiguous():
        return None
    # a subclass's own step is its own math (torch wraps the class's step once an instance exists: compare what it wraps)
    if inspect.unwrap(type(optimizer).step) is not inspect.unwrap(torch.optim.Adam.step):
        return None
    if grad is not None and (grad.dtype not in (torch.float32, torch.bfloat16) or not grad.is_contiguous()
                             or grad.numel() != master.numel()):
        return None
    pg = next((pg for pg in optimizer.param_groups if any(p is master for p in pg["params"])), None)
    if pg is None or not pg.get("fused") or any(pg.get(k) for k in ("amsgrad", "capturable", "differentiable")):
        return None
    return pg if host_adam.available() else None


def _fused_step(optimizer: torch.optim.Optimizer, pg: dict, master: torch.Tensor, grad: torch.Tensor,
                out16: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """Torch's Adam/AdamW step of ``master`` (its state made and its step counted as torch's fused path does), through the
    one-pass kernel: the 16-bit copy into ``out16`` in the same pass, and, with ``out``, the new master and moments
    written there instead of in place."""
    state = optimizer.state[master]
    if not state:  # torch's lazy state for a fused step: a float32 step count and two zero moments
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    state["step"] += 1
    beta1, beta2 = pg["betas"]
    host_adam.adam_step(master, grad, state["exp_avg"], state["exp_avg_sq"], float(state["step"]), lr=float(pg["lr"]),
                        beta1=float(beta1), beta2=float(beta2), eps=float(pg["eps"]),
                        weight_decay=float(pg["weight_decay"]),
                        adamw=bool(pg.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))),
                        maximize=bool(pg.get("maximize", False)), out16=out16, out=out)


def step_master(optimizer: torch.optim.Optimizer, master: torch.Tensor, grad: torch.Tensor,
                ranges: list[tuple[int, int]], *, out16: torch.Tensor | None = None,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Step ``master`` with ``grad`` (the only master with a gradient now) one range at a time, equal bit for bit to one
    call over the whole (each element's update reads only that element's values and a shared step count).

    Why: ``sub_group_size`` bounds what one optimizer call touches at once (an unfused optimizer's temporaries are the
    size of its tensors) and is the granularity a streamed step copies in. How: each range steps as a view of the
    master that takes the master's place in its param group, with views of its state; the step count, the same for
    every range, goes back to the master's state once. At the first step, when the optimizer makes its state lazily,
    each range gets its own and the pieces are joined into the master's. An optimizer whose state is not per element
    (:data:`_ELEMENTWISE` lists those known to be) and a single range step the whole master in one call.

    Where :func:`fused_adam_group` says so, the step is the one-pass kernel's over the whole master instead (the same
    bits), which also writes the updated master cast into ``out16`` when given, and with ``out`` (the master's size,
    fp32, three tensors) writes the new master and moments there, leaving the master and its moments as they were (the
    step count is still counted); the optimizer's ``step()`` is still called, with no gradient anywhere (torch's
    optimizers then change nothing), so that what wraps or hooks it (an LR scheduler's count of steps taken, a test's)
    sees the step. Returns whether that path ran (``out16`` is written only then); ``out`` needs it.
    """
    pg = fused_adam_group(optimizer, master, grad)
    if pg is not None:
        _fused_step(optimizer, pg, master, grad, out16, out)
        optimizer.step()
        return True
    if out is not None:
        raise ValueError("step_master: out (a step out of place) needs the one-pass kernel's Adam/AdamW, which "
                         "fused_adam_group refused for this master")
    if len(ranges) <= 1 or not isinstance(optimizer, _ELEMENTWISE):
        master.grad = grad
        try:
            optimizer.step()
        finally:
            master.grad = None
        return False
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
        return False
    for k, v in last.items():  # the per-element state was written through the views; the step count goes back
        old = full.get(k)  # type: ignore[union-attr]
        if _per_element(old, master):
            continue
        if isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape:
            old.copy_(v)
        else:
            full[k] = v  # type: ignore[index]
    return False


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
                 swap: Any = None, prestepped: frozenset[int] = frozenset(), sub_group_size: int | None = None,
                 scratch: Callable[[int], torch.Tensor] | None = None) -> None:
        self.optimizer, self.stream, self.defer, self.on_done = optimizer, stream, defer, on_done
        self.scratch = scratch  # the runner's reused fp32 buffer for a clipped bf16 copy read widened (step_grad)
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
                    if hasattr(g, "step_grad"):  # a bf16 copy the step policy scaled is read in fp32, scaled (host_grads.py)
                        grad = g.step_grad(grad, self.scratch)
                    ranges = [(0, g.master.numel())] if self.sub_group_size is None else sub_group_ranges(
                        g, self.sub_group_size)
                    out16 = g.host_shard() if hasattr(g, "host_shard") else None  # the 16-bit host copy the step may write in its pass
                    wrote = step_master(self.optimizer, g.master, grad, ranges, out16=out16)
                    if out16 is not None and wrote:
                        g.host_shard_written()  # type: ignore[attr-defined]  # its publish has no cast left to do
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



def report_step_parts(timed: Callable[[str, float], None], device: torch.device, t0: float, t1: float, t2: float,
                      cpu_seconds: float, io_seconds: float | None = None) -> None:
    """``wall_clock_breakdown``'s parts of a host step that ran from ``t0`` (``time.perf_counter``) to ``t2``: the wait
    for the gradients until ``t1``, the CPU optimizer, the NVMe wait when given, and the rest, until the device holds
    the new weights (a device sync, taken only when timing), as the copies back to it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timed("step.wait_grads", t1 - t0)
    timed("step.cpu_optimizer", cpu_seconds)
    if io_seconds is not None:
        timed("step.nvme_wait", io_seconds)
    timed("step.to_device", (t2 - t1 - cpu_seconds - (io_seconds or 0.0)) + (time.perf_counter() - t2))


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
