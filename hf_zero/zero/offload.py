"""ZeRO-Offload of the optimizer: fp32 masters and optimizer state in host memory, the step on the CPU.

DeepSpeed's ``"offload_optimizer": {"device": "cpu"}`` at stages 1-3, as two more shard groups
(:mod:`hf_zero.zero.group`): the same layouts, reductions and gathers as
:class:`~hf_zero.zero.flat.FlatGroup` and :class:`~hf_zero.zero.sharded_group.ShardedParamGroup`, with the
master moved to the host. Per step:

1. backward reduces each bucket's gradients as without offload, into an fp32 shard on the compute
   device that accumulates there across micro-steps (stages 2-3 reduce every micro-step), so the
   PCIe link carries one copy per optimizer step, not one per micro-step;
2. in the backward that ends the step, as soon as a bucket is reduced its shard is copied to pinned
   host memory on the communication stream (while backward goes on), its part of the global norm
   and of the inf/nan check kept as two scalars, and the device shard released;
3. the step policy (norm, non-finite rule, clipping, fp16 unscaling) runs as without offload, the
   scaling applied to the host copies; the optimizer the user or the config gave then steps the host
   masters one shard group at a time (torch's optimizers skip a parameter without ``.grad``, so each
   master is updated once with its own step count; Adam/AdamW use torch's fused CPU kernel), so its
   state, ``state_dict()`` and any LR scheduler built on it are untouched;
4. :meth:`publish_master` sends each group back as soon as it is stepped (:class:`HostStep`), while the CPU
   steps the next (with ``overlap_param_gather`` at stages 1-2, inside the next forward: the group's first
   reader steps it): the fp32 master to a device buffer, cast there into the compute-dtype parameters (stages
   1-2: this rank's range of ``param_flat``, then the all-gather; stage 3: the 16-bit shard the next
   all-gather reads; DeepSpeed keeps that shard on the GPU too).

When the host cannot hold the gradient copy beside the masters and the optimizer state (4 of each rank's
16 bytes per element with Adam; an 8B full fine-tune on one 125 GiB host is that case),
:func:`check_host_memory` says so before anything is allocated and every rank takes the *streamed* mode
instead: step 2's copy is skipped, the fp32 shards wait on the device (4/N bytes per parameter more GPU
memory) and the step copies them to the host one group at a time through two shared pinned buffers, the
next group's copy running while the CPU steps the current one
(:class:`HostStep`, run by the host runners of :mod:`hf_zero.zero.runner`). Same numbers, bit for bit.

GPU bytes per parameter at stage 2: without offload 2 (16-bit weights) + 4/N (fp32 gradient shard) +
(4 + 8)/N (master, moments); with offload 2 + 4/N, the masters, moments and a gradient copy (16/N) in
host memory. Stage 3's ``offload_param`` keeps the 16-bit shards the all-gathers read in host memory as
well (:class:`_HostParamShard`): GPU memory then holds only the units gathered at the moment. NVMe
(``"device": "nvme"``) moves the masters, the optimizer state and the host shards on to disk
(:mod:`hf_zero.zero.nvme`). Not here yet: ``sub_group_size`` (each shard group is one sub-group), ``ratio`` < 1.

What is offloaded is decided once, from the config, as an :class:`OffloadPolicy` the engine builds; host memory
is planned from it before any buffer exists (:func:`plan_host_memory`), and the step that follows from both is a
runner chosen once (:func:`hf_zero.zero.runner.pick_runner`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_zero.errors import HostMemoryError
from hf_zero.estimate import offload_host_bytes
from hf_zero.zero import collectives as C
from hf_zero.zero.flat import FlatGroup
from hf_zero.zero.group import Placement, ShardGroup
from hf_zero.zero.sharded_group import ShardedParamGroup

if TYPE_CHECKING:
    from hf_zero.zero.nvme_io import NvmeSpec

logger = logging.getLogger("hf_zero")


@dataclass(frozen=True)
class OffloadPolicy:
    """What of a rank's ZeRO state lives in host memory: decided once from the config, read, never changed.

    FSDP2's ``CPUOffloadPolicy`` is the model: the engine builds it from ``zero_optimization.offload_optimizer``
    and ``offload_param``, and :class:`hf_zero.zero.optimizer.ShardedOptimizer` builds its groups and picks its step
    runner from it. The default offloads nothing.

    - ``optimizer`` (``offload_optimizer.device: "cpu"``): the fp32 masters, a copy of their gradients and the
      optimizer state in host memory, the optimizer step on the CPU; ``pin_memory`` is its ``pin_memory``
      (page-locked buffers, where CUDA is present) and ``host_threads`` the CPU step's intra-op threads
      (:func:`host_step_threads`; None keeps the process's count).
    - ``params`` (stage 3's ``offload_param.device: "cpu"``): the 16-bit shards the all-gathers read in host memory,
      the frozen groups' always, the trainable groups' when the optimizer is offloaded too (otherwise their master
      is the shard, stepped on the device); ``params_pin_memory`` is its ``pin_memory`` (the frozen groups'
      shards; a trainable group's host shard is pinned as its master is, by ``pin_memory``).
    - ``optimizer_nvme`` / ``params_nvme`` (``"device": "nvme"``): the same state, kept in files on disk between
      steps instead (:mod:`hf_zero.zero.nvme`); ``optimizer`` / ``params`` are on as well, the step is then
      :class:`hf_zero.zero.runner.NvmeRunner`'s.
    """

    optimizer: bool = False
    pin_memory: bool = True
    host_threads: int | None = None
    params: bool = False
    params_pin_memory: bool = True
    # ``"device": "nvme"`` (hf_zero/zero/nvme.py): where on disk the offloaded optimizer state / parameter shards live
    optimizer_nvme: NvmeSpec | None = None
    params_nvme: NvmeSpec | None = None

    def __post_init__(self) -> None:
        if self.host_threads is not None and self.host_threads < 1:
            raise ValueError(f"OffloadPolicy.host_threads: got {self.host_threads}; give a positive count or None")

    @property
    def nvme(self) -> bool:
        """Whether anything lives on disk (the step is then :class:`hf_zero.zero.runner.NvmeRunner`'s)."""
        return self.optimizer_nvme is not None or self.params_nvme is not None

    @property
    def host_memory(self) -> bool:
        """Whether anything lives in host memory (then :func:`plan_host_memory` runs before any buffer exists)."""
        return self.optimizer or self.params


@dataclass(frozen=True)
class ShardSizes:
    """This rank's share of the model in elements, counted before any buffer exists (a ``zero.Init`` slice
    counts as the shard it will become): what :func:`plan_host_memory` plans with.

    ``largest_group`` bounds the largest trainable group's shard: the streamed mode's two shared buffers are of
    that size.
    """

    trainable: int
    frozen: int = 0
    largest_group: int = 0


class HostPlan(enum.Enum):
    """:func:`plan_host_memory`'s answer (a refusal is a :class:`hf_zero.errors.HostMemoryError` on every rank)."""

    FITS = "fits"  # a gradient copy per group beside the masters and the optimizer state (or nothing offloaded)
    STREAM_GRADS = "stream_grads"  # no room for the copies: the gradients wait on the device, the step streams them


def plan_host_memory(policy: OffloadPolicy, sizes: ShardSizes, *, state_bytes: int, param_bytes: int,
                     group: dist.ProcessGroup | None) -> HostPlan:
    """Plan the host memory ``policy`` needs, before any host buffer exists; collective over ``group`` when
    anything is offloaded (every rank gets the same answer), nothing to do otherwise.

    What a rank pins is :func:`hf_zero.estimate.offload_host_bytes` of its shards (``state_bytes`` of optimizer
    state per element, :func:`state_bytes_per_element`; ``param_bytes`` per element of an offloaded 16-bit
    shard). When the machine's ranks together cannot hold it but could with the gradients streamed through two
    buffers of the largest group instead of a copy per group, the answer is :attr:`HostPlan.STREAM_GRADS`
    (said once, by rank 0); when they cannot hold even that, :func:`check_host_memory` raises.
    """
    if not policy.host_memory:
        return HostPlan.FITS
    if policy.optimizer_nvme is not None:  # the masters and state on disk: host memory holds the swap buffers only
        return HostPlan.STREAM_GRADS
    host_params = policy.params and policy.params_nvme is None  # on NVMe, max_in_cpu's share at most stays in memory
    needed = offload_host_bytes(sizes.trainable, state_bytes, optimizer=policy.optimizer,
                                param_bytes=param_bytes if host_params else 0,
                                frozen_numel=sizes.frozen if host_params else 0)
    streamed = None
    if policy.optimizer:  # no gradient copy per group: two buffers of the largest group instead
        streamed = needed - 4 * sizes.trainable + 2 * 4 * min(sizes.largest_group, sizes.trainable)
    if not check_host_memory(needed, group, streamed):
        return HostPlan.FITS
    if dist.get_rank(group) == 0:
        logger.warning(
            "offload: host memory cannot hold a copy of every gradient beside the masters and optimizer state; "
            "each rank keeps its fp32 gradient shard on the GPU until the step (4 bytes per parameter / %d) and "
            "the step streams it to the host group by group through two shared buffers", dist.get_world_size(group))
    return HostPlan.STREAM_GRADS


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialized host tensor, page-locked when ``pin`` (so copies to and from the GPU can be asynchronous).

    Pinned by registering exactly its own pages with CUDA (``cudaHostRegister``), not with
    ``pin_memory=True``: torch's caching host allocator rounds every pinned block up to a power of two,
    which measured 21.7 GiB of host memory per billion offloaded parameters instead of the ~18 planned,
    and keeps freed blocks cached. The pages are unregistered when the tensor is collected. Where
    registering fails (no CUDA, a driver that refuses), the caching allocator's pinned memory is used.
    """
    if not pin or numel == 0 or not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=bool(pin) and torch.cuda.is_available())
    t = torch.empty(numel, dtype=dtype, device="cpu")
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)
    done = weakref.finalize(t, cudart.cudaHostUnregister, ptr)  # before the storage goes: only views could outlive t
    done.atexit = False  # at exit the process's pages go anyway; no CUDA call while the interpreter shuts down
    return t


class _HostMaster(ShardGroup):
    """The master (and so the optimizer state) of a trainable group in host memory; the reduced gradient on the device."""

    pin: bool
    # The host cannot hold a gradient copy per group (plan_host_memory said HostPlan.STREAM_GRADS): the reduced shard
    # stays on the device until the step, which streams it through two shared host buffers (HostStep). Given to the
    # constructor, from the plan made before any group existed.
    stream_grads = False

    def _move_master_to_host(self, pin: bool, stream_grads: bool) -> None:
        assert self.master is not None
        self.pin = bool(pin) and torch.cuda.is_available()
        self.stream_grads = stream_grads
        on_device = self.master
        self.master = host_buffer(on_device.numel(), torch.float32, pin=self.pin)
        self.master.copy_(on_device)
        self._device_grad: torch.Tensor | None = None
        self._host_grad: torch.Tensor | None = None  # reused every step
        self._in_flight: torch.cuda.Event | bool | None = None  # the copy of this step's gradient to the host
        # After that copy left, the device shard is released; its part of the norm stays behind as scalars.
        self._released: tuple[torch.Tensor, torch.Tensor] | None = None

    def reduced_grad(self) -> torch.Tensor | None:
        return self._device_grad

    def _set_reduced_grad(self, grad: torch.Tensor | None) -> None:
        self._device_grad = grad
        if grad is None:
            self._in_flight = None
            self._released = None
            if self.master is not None:
                self.master.grad = None  # the host buffer stays for the next step

    def grad_values(self, writable: bool = False) -> torch.Tensor | None:
        if self._released is not None:
            if writable:
                self._unrelease(None)
                return self._device_grad
            self._wait_for_host_copy()
            return self._host_grad
        return self._device_grad

    def grad_sq_sum(self) -> torch.Tensor:
        return self._released[0] if self._released is not None else super().grad_sq_sum()

    def nonfinite(self) -> torch.Tensor:
        return self._released[1] if self._released is not None else super().nonfinite()

    def _unrelease(self, stream: torch.cuda.Stream | None) -> None:
        """The shard is needed on the device again after its release (a unit reduced twice in one backward, a
        weight tied across pipeline stages): bring the host copy back."""
        if self._released is None:
            return
        self._wait_for_host_copy()
        assert self._host_grad is not None
        with C.on_stream(stream):
            self._device_grad = self._host_grad.to(self.device, non_blocking=self.pin, copy=True)
        self._released, self._in_flight = None, None

    def _host_grad_buffer(self) -> torch.Tensor:
        assert self.master is not None
        if self._host_grad is None:
            self._host_grad = host_buffer(self.master.numel(), torch.float32, pin=self.pin)
        return self._host_grad

    def _copy_after_reduce(self, stream: torch.cuda.Stream | None) -> None:
        """The last backward of the step reduced this group: start its device-to-host copy on the same stream,
        so it runs while backward goes on (pinned memory makes it asynchronous)."""
        if not self.copy_after_reduce or self.stream_grads or self._device_grad is None:
            return
        host, grad = self._host_grad_buffer(), self._device_grad
        with C.on_stream(stream):
            host.copy_(grad, non_blocking=self.pin)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                self._in_flight = event
            else:
                self._in_flight = True
            # The shard's part of the global norm, then the shard itself goes (it was made on this stream, so
            # its memory is reused only after the copy): GPU memory holds only the gradients still in flight.
            self._released = (torch.linalg.vector_norm(grad, dtype=torch.float32).square(), (~torch.isfinite(grad)).any().float())
            self._device_grad = None

    def _wait_for_host_copy(self) -> None:
        if isinstance(self._in_flight, torch.cuda.Event):
            self._in_flight.synchronize()
        self._in_flight = True

    def scale_host_copy(self, coef: torch.Tensor | float) -> None:
        if self._in_flight is None:
            return
        self._wait_for_host_copy()
        assert self._host_grad is not None
        self._host_grad.mul_(float(coef))

    def sum_grad_over(self, process_group: object) -> None:
        self._unrelease(None)
        super().sum_grad_over(process_group)  # type: ignore[arg-type]
        self._in_flight = None  # the device shard changed after its copy left: copy again before the step

    def before_step(self) -> None:
        """The reduced gradient shard as the host master's ``.grad`` (None when there is none this step)."""
        assert self.master is not None
        if self.stream_grads or (self._device_grad is None and self._released is None):
            self.master.grad = None  # streamed: the step hands each group its gradient in a shared buffer
            return
        if self._in_flight is not None:
            self._wait_for_host_copy()
        else:
            self._host_grad_buffer().copy_(self._device_grad)  # blocking: the host optimizer reads it next
        self.master.grad = self._host_grad


class OffloadedFlatGroup(_HostMaster, FlatGroup):
    """A stage 1-2 bucket whose fp32 master lives in host memory (see the module docstring)."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, partitioned: bool,
                 free_grads_after_reduce: bool, pin: bool, stream_grads: bool = False) -> None:
        FlatGroup.__init__(self, named_params, place, partitioned=partitioned, free_grads_after_reduce=free_grads_after_reduce)
        # On one rank too: the full gradients go once reduced (as on more ranks), not kept in a flat 16-bit buffer for
        # the whole run. The reduced fp32 gradient is copied to the host and released on the device in the backward that
        # ends the step, so with no accumulation no gradient outlives its bucket's reduction (the buffer was 2 bytes
        # per parameter, 5.2 GiB of a 2.8B model's GPU peak that DeepSpeed's ZeRO-2 offload does not have).
        self.free_grads_after_reduce = free_grads_after_reduce
        # In fp32 the master was a view of the parameters; from here on it is a host copy either way.
        self.mixed = True
        self._move_master_to_host(pin, stream_grads)

    def reduce_grads(self, stream: torch.cuda.Stream | None) -> None:
        self._unrelease(stream)
        FlatGroup.reduce_grads(self, stream)
        self._copy_after_reduce(stream)

    def _write_shard(self, shard: torch.Tensor) -> None:
        """Host master -> this rank's range of the device parameters, cast to the compute dtype on the device
        (:meth:`FlatGroup.publish_master` then all-gathers it)."""
        _to_device(shard, self.master, self.pin)


class _HostParamShard(ShardedParamGroup):
    """Parameter offload (``offload_param``): the compute-dtype shard the all-gather reads waits in host memory
    and is copied to the device just before each gather, on the gather stream, so the prefetch that runs
    ahead of the compute hides it. GPU memory then holds only the units gathered at the moment."""

    shard_on_host = False
    shard_pin = False
    shard_store: Any = None  # offload_param "nvme": the hf_zero.zero.nvme.ParamStore holding the shard on disk
    alias_whole_shard = False  # the shard moves to host memory: the parameters cannot be views of it

    def _move_param_shard_to_host(self, pin: bool) -> None:
        assert self.param_shard is not None
        self.shard_pin = bool(pin) and torch.cuda.is_available()
        host = host_buffer(self.param_shard.numel(), self.param_shard.dtype, pin=self.shard_pin)
        host.copy_(self.param_shard)
        self.param_shard, self.shard_on_host = host, True

    def _gather_source(self) -> torch.Tensor:
        if not self.shard_on_host:
            return super()._gather_source()
        if self.shard_store is not None:
            return self.shard_store.fetch(self).to(self.device, non_blocking=self.shard_store.spec.pin_memory)
        assert self.param_shard is not None
        return self.param_shard.to(self.device, non_blocking=self.shard_pin)

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        held = ShardedParamGroup.held_tensors(self)
        held["params"] = [None if self.shard_on_host else self.param_shard, self.full]
        return held


class OffloadedFrozenGroup(_HostParamShard):
    """A stage-3 group of frozen parameters (a LoRA base model, say) whose shard lives in host memory."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, pin: bool) -> None:
        ShardedParamGroup.__init__(self, named_params, place, trainable=False, build_on_host=True)
        self._move_param_shard_to_host(pin)


class OffloadedShardedParamGroup(_HostMaster, _HostParamShard):
    """A stage-3 group whose fp32 master lives in host memory; its compute-dtype shard stays on the device for the
    gathers, or in host memory too under ``offload_param`` (``params_on_host``). ``stream_grads``: see :class:`_HostMaster`."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, trainable: bool,
                 pin: bool, params_on_host: bool = False, stream_grads: bool = False) -> None:
        ShardedParamGroup.__init__(self, named_params, place, trainable=trainable, build_on_host=trainable)
        if not trainable:
            return
        assert self.master is not None  # cut in host memory (build_on_host): no second copy of the unit on the GPU
        self.param_shard = self.master.to(self.device if not params_on_host else "cpu", self.compute_dtype, copy=True)
        self._move_master_to_host(pin, stream_grads)
        if params_on_host:
            self._move_param_shard_to_host(pin)

    def reduce_grads(self, stream: torch.cuda.Stream | None, limit: C.InflightLimit | None = None) -> None:
        if self.has_grads():
            self._unrelease(stream)
        ShardedParamGroup.reduce_grads(self, stream, limit)
        self._copy_after_reduce(stream)

    def publish_master(self, stream: torch.cuda.Stream | None) -> None:
        """Host master -> the shard the next all-gather reads (cast to the compute dtype): on the device, or, with
        the shard in host memory too, cast there (one CPU pass; the gather copies the 16-bit values over)."""
        if self.master is None:
            return
        assert self.param_shard is not None
        if self.shard_store is not None:
            self.shard_store.put(self, self.master)
            return
        if self.shard_on_host:
            self.param_shard.copy_(self.master)
            return
        with C.on_stream(stream):
            _to_device(self.param_shard, self.master, self.pin)


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
                 swap: Any = None) -> None:
        self.optimizer, self.stream, self.defer, self.on_done = optimizer, stream, defer, on_done
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
            g.master.grad = grad
            try:
                self.optimizer.step()
            finally:
                g.master.grad = None
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


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state per master element: Adam/AdamW 8 (two fp32 moments, 12 with AMSGrad),
    SGD with momentum 4, otherwise 8 (an upper guess for an optimizer this does not know)."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return 12 if any(pg.get("amsgrad") for pg in optimizer.param_groups) else 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if any(pg.get("momentum") for pg in optimizer.param_groups) else 0
    return 8


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping); MemTotal grows on some
    hosts as memory is touched, so it is not the figure to plan with."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


# What a plan may not use of a machine's MemAvailable: a share of it and a little per rank, for what the processes
# hold beyond the planned buffers (the interpreter, libraries, the CUDA context, the data). An 8B full fine-tune on one
# H200 planned 128.5 of 131.5 GB and peaked at 130.6 GB of resident memory with 2 GB left: the margin was luck.
HOST_RESERVE_FRACTION = 0.05
HOST_RESERVE_PER_RANK = 2 * 2**30


def check_host_memory(needed: int, group: dist.ProcessGroup | None, streamed: int | None = None) -> bool:
    """Before any host buffer exists: the ranks of each machine add up what they will pin, and every rank
    stops with the same sentence when that exceeds the machine's available memory.

    ``needed`` is this rank's bytes, :func:`hf_zero.estimate.offload_host_bytes` of its shards (the figure
    ``hf-zero estimate`` prints as host bytes per rank). ``streamed``, when given, is the same with the
    gradients streamed through two shared buffers instead of a host copy per group: when ``needed`` does not
    fit but that does, the answer is True (stream), and every rank gets the same answer. A plan may use
    MemAvailable less :data:`HOST_RESERVE_FRACTION` of it and :data:`HOST_RESERVE_PER_RANK` per rank of the
    machine. The ranks exchange
    (host id, bytes, streamed bytes, available bytes) with one all-gather of integers over ``group``.
    """
    try:
        available = available_host_bytes()
    except OSError:
        return False  # not Linux: nothing to plan with
    host = zlib.crc32(socket.gethostname().encode())
    mine = torch.tensor([host, needed, needed if streamed is None else streamed, available], dtype=torch.int64)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rows = [mine]
    if world > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        out = [torch.empty(4, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(out, mine.to(device), group=group)
        rows = [r.cpu() for r in out]

    def usable(h: int) -> int:  # of machine h's MemAvailable, what its ranks' buffers may take
        ranks = [r for r in rows if int(r[0]) == h]
        return int(min(int(r[3]) for r in ranks) * (1 - HOST_RESERVE_FRACTION)) - HOST_RESERVE_PER_RANK * len(ranks)

    def fits(column: int) -> bool:  # every machine's ranks together
        return all(sum(int(r[column]) for r in rows if int(r[0]) == h) <= usable(h) for h in {int(r[0]) for r in rows})

    if fits(1):
        return False
    if streamed is not None and fits(2):
        return True
    same_host = [r for r in rows if int(r[0]) == host]
    total = sum(int(r[1]) for r in same_host)
    least = sum(int(r[2]) for r in same_host)
    also = f", {_size(least)} with the gradients streamed from the GPU," if streamed is not None else ""
    raise HostMemoryError(
        f"offload needs {_size(total)} of host memory on {socket.gethostname()} "
        f"({len(same_host)} rank(s) x masters, optimizer state and a gradient copy, and offloaded parameter shards){also} "
        f"but {_size(available)} is available (MemAvailable, of which 5% and 2 GiB per rank stay free for the processes "
        f"themselves); use fewer ranks per machine, a higher ZeRO stage or "
        "more machines, or turn offload_optimizer / offload_param off"
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _to_device(dst: torch.Tensor, host: torch.Tensor, pinned: bool) -> None:
    """``dst.copy_(host)`` on the current stream, the cast done on the device.

    A copy across devices and dtypes at once would cast on the host first (a CPU pass, into
    pageable memory, so the transfer could not be asynchronous); instead the fp32 values travel to
    a device buffer and are cast there.
    """
    if dst.device.type == "cpu" or dst.dtype == host.dtype:
        dst.copy_(host, non_blocking=pinned)
        return
    staged = torch.empty(host.shape, dtype=host.dtype, device=dst.device)
    staged.copy_(host, non_blocking=pinned)
    dst.copy_(staged)


def use_host_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Adam/AdamW param groups step with torch's fused CPU kernel once their parameters are host masters."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        for pg in optimizer.param_groups:
            if pg.get("foreach") is None and not pg.get("differentiable", False):
                pg["fused"] = True
