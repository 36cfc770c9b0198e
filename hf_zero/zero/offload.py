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
   master is updated once with its own step count; Adam/AdamW in one pass over host memory, torch's fused CPU
   kernel's bits: :func:`hf_zero.zero.host_step.step_master`), so its state and LR scheduler are untouched;
4. :meth:`publish_master` sends each group back once stepped (:class:`HostStep`) while the CPU steps the next
   (``overlap_param_gather``: in the next forward, the group's first reader steps it; stage 3: its next gather,
   :mod:`hf_zero.zero.unit_steps`): the fp32 master to a device buffer, cast there into the compute-dtype
   parameters (stages 1-2: this rank's range of ``param_flat``, then the all-gather; stage 3: the 16-bit shard).

``offload_optimizer.super_offload`` moves step 3 into step 2: each group stepped on a background thread as its host
copy lands, undone exactly where clipping or a skip says so (:class:`~hf_zero.zero.speculative_step.SpeculativeHostStep`).

When the host cannot hold the gradient copy beside the masters and the optimizer state (4 of each rank's
16 bytes per element with Adam; an 8B full fine-tune on one 125 GiB host is that case),
:func:`check_host_memory` says so before anything is allocated and every rank takes the *streamed* mode
instead: step 2's copy is skipped, the fp32 shards wait on the device (4/N bytes per parameter more GPU
memory) and the step copies them to the host one group at a time through two shared pinned buffers, the
next group's copy running while the CPU steps the current one
(:class:`HostStep`, run by the host runners of :mod:`hf_zero.zero.runner`). Same numbers, bit for bit.

Stage 3's ``offload_param`` keeps the 16-bit shards the all-gathers read in host memory too
(:class:`_HostParamShard`; the host step writes them in its pass): GPU memory holds only the units gathered at the
moment. NVMe (``"device": "nvme"``) moves masters, state and host shards on to disk (:mod:`hf_zero.zero.nvme`).
``offload_optimizer.ratio`` < 1 (ZeRO-Offload++'s Twin-Flow) offloads only the last ``ratio`` of the trainable groups
(:func:`device_group_count`); the first keep master and state on the device and step there beside the host step.

What is offloaded is decided once, from the config, as an :class:`OffloadPolicy` the engine builds; host memory
is planned from it before any buffer exists (:func:`plan_host_memory`), and the step that follows from both is a
runner chosen once (:func:`hf_zero.zero.runner.pick_runner`).
"""

from __future__ import annotations

import enum
import logging
import socket
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_zero.errors import HostMemoryError
from hf_zero.planning.estimate import offload_host_bytes
from hf_zero.zero import collectives as C
from hf_zero.zero.flat import FlatGroup
from hf_zero.zero.group import Placement, ShardGroup
from hf_zero.zero.host_grads import _HostMaster, host_buffer
from hf_zero.zero.sharded_group import ShardedParamGroup
from hf_zero.zero.unit_steps import DeferredUnitStep
from hf_zero.zero.zenflow_policy import ZenFlowPolicy

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
    - ``speculate`` (``offload_optimizer.super_offload``): the host step of each group taken while backward runs,
      as soon as its gradient is in host memory, and undone exactly where clipping or a skipped step says so
      (:class:`hf_zero.zero.runner.SpeculativeHostRunner`).
    - ``zenflow`` (``zero_optimization.zenflow``): each step only the important columns are stepped, on the device;
      the host steps the others with their summed gradient every few steps (:mod:`hf_zero.zero.zenflow`); None: the
      exact offloaded step.
    - ``optimizer_nvme`` / ``params_nvme`` (``"device": "nvme"``): the same state, kept in files on disk between
      steps instead (:mod:`hf_zero.zero.nvme`); ``optimizer`` / ``params`` are on as well, the step is then
      :class:`hf_zero.zero.runner.NvmeRunner`'s.
    """

    optimizer: bool = False
    pin_memory: bool = True
    host_threads: int | None = None
    params: bool = False
    params_pin_memory: bool = True
    optimizer_nvme: NvmeSpec | None = None
    params_nvme: NvmeSpec | None = None
    speculate: bool = False  # offload_optimizer.super_offload (the docstring above)
    speculate_threads: int | None = None  # super_offload's background steps' threads (cpuadam_cores_perc); None: host_threads
    # offload_optimizer.ratio (ZeRO-Offload++'s Twin-Flow): the share of the trainable groups whose master and optimizer
    # state live in host memory; the rest, the first groups in parameter order, stay and step on the device
    ratio: float = 1.0
    # zero_optimization.sub_group_size: each host group stepped in sub-groups of about that many elements
    # (hf_zero/zero/host_step.py sub_group_ranges); None: each group in one call
    sub_group_size: int | None = None
    zenflow: ZenFlowPolicy | None = None

    def __post_init__(self) -> None:
        for name in ("host_threads", "speculate_threads"):
            n = getattr(self, name)
            if n is not None and n < 1:
                raise ValueError(f"OffloadPolicy.{name}: got {n}; give a positive count or None")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"OffloadPolicy.ratio: got {self.ratio!r}; give the offloaded share, between 0 and 1")
        if self.sub_group_size is not None and self.sub_group_size < 0:
            raise ValueError(f"OffloadPolicy.sub_group_size: got {self.sub_group_size}; give a count of elements (0: one "
                             "parameter a sub-group) or None")

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
    # super_offload asked, but no room for its second buffers beside the copies: the copies stay, speculation is off
    NO_SPECULATION = "no_speculation"
    STREAM_GRADS = "stream_grads"  # no room for the copies: the gradients wait on the device, the step streams them


def plan_host_memory(policy: OffloadPolicy, sizes: ShardSizes, *, state_bytes: int, param_bytes: int,
                     group: dist.ProcessGroup | None, copy_bytes: int = 0) -> HostPlan:
    """Plan the host memory ``policy`` needs, before any host buffer exists; collective over ``group`` when
    anything is offloaded (every rank gets the same answer), nothing to do otherwise.

    What a rank pins is :func:`hf_zero.planning.estimate.offload_host_bytes` of its shards (``state_bytes`` of optimizer
    state per element, :func:`state_bytes_per_element`; ``param_bytes`` per element of an offloaded 16-bit
    shard). When the machine's ranks together cannot hold it but could with the gradients streamed through two
    buffers of the largest group instead of a copy per group, the answer is :attr:`HostPlan.STREAM_GRADS`
    (said once, by rank 0); when they cannot hold even that, :func:`check_host_memory` raises. With ``super_offload``
    (``policy.speculate``) its second buffers are planned first; where only they do not fit, the answer is
    :attr:`HostPlan.NO_SPECULATION` (the copies kept, the step taken after backward; said once, by rank 0).
    """
    if not policy.host_memory:
        return HostPlan.FITS
    if policy.optimizer_nvme is not None:  # the masters and state on disk: host memory holds the swap buffers only
        return HostPlan.STREAM_GRADS
    host_params = policy.params and policy.params_nvme is None  # on NVMe, max_in_cpu's share at most stays in memory
    kw = dict(optimizer=policy.optimizer, param_bytes=param_bytes if host_params else 0,
              frozen_numel=sizes.frozen if host_params else 0, copy_bytes=copy_bytes)
    plain = offload_host_bytes(sizes.trainable, state_bytes, **kw)  # type: ignore[arg-type]
    if policy.optimizer and policy.speculate:  # super_offload's second buffers (speculative_step.py)
        spec = offload_host_bytes(sizes.trainable, state_bytes, speculate=True, **kw)  # type: ignore[arg-type]
        try:  # (collective; every rank gets the same answer, the same exception included)
            without = check_host_memory(spec, group, plain)
        except HostMemoryError:
            without = None  # not even the copies fit: streamed, or the refusal, below
        if without is False:
            return HostPlan.FITS
        if without:
            if dist.get_rank(group) == 0:
                logger.warning(
                    "offload: host memory cannot hold super_offload's second master, optimizer state and 16-bit copy "
                    "(%s per rank) beside the rest; the step runs without speculation (the host step after backward)",
                    _size(spec - plain))
            return HostPlan.NO_SPECULATION
    needed = plain
    streamed = None
    if policy.optimizer:  # no gradient copy per group: two buffers of the largest group instead (and so no speculation)
        streamed = needed - 4 * sizes.trainable + 2 * 4 * min(sizes.largest_group, sizes.trainable)
    if not check_host_memory(needed, group, streamed):
        return HostPlan.FITS
    if dist.get_rank(group) == 0:
        logger.warning(
            "offload: host memory cannot hold a copy of every gradient beside the masters and optimizer state; "
            "each rank keeps its fp32 gradient shard on the GPU until the step (4 bytes per parameter / %d) and "
            "the step streams it to the host group by group through two shared buffers%s", dist.get_world_size(group),
            " (super_offload's steps during backward need the host copies: they are off)" if policy.speculate else "")
    return HostPlan.STREAM_GRADS


def device_group_count(n: int, ratio: float) -> int:
    """Of ``n`` trainable groups in parameter order, how many stay on the device under ``offload_optimizer.ratio``.

    DeepSpeed 0.19.8's stage 3 puts sub-group ``i`` of ``n`` on the device when ``i < int((1 - ratio) * n)`` and in host
    memory otherwise; hf_zero's shard groups play its sub-groups, with the same expression (so a ratio that leaves less
    than one group for the device, 0.9 of 5 groups say, offloads them all, as there).
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload_optimizer.ratio: got {ratio!r}; give the offloaded share, between 0 and 1")
    return int((1 - ratio) * n) if ratio < 1.0 else 0


def is_host_master(group: ShardGroup) -> bool:
    """Whether ``group``'s master (and so its optimizer state) lives in host memory and steps on the CPU."""
    return isinstance(group, _HostMaster) and group.master is not None


def optimizer_state_split(groups: list[ShardGroup], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the masters and their optimizer state, by where they step: ``{"host": ..., "device": ...}``.

    What ``offload_optimizer.ratio`` divides (its test compares the split with the ratio); the optimizer's state exists
    from the first step on, so before it only the masters count. Classified by group kind, not by the tensors'
    device, so CPU ranks (where both are host memory) report the split a GPU run would have.
    """
    out = {"host": 0, "device": 0}
    for g in groups:
        if g.master is None:
            continue
        n = g.master.numel() * g.master.element_size()
        for v in optimizer.state.get(g.master, {}).values():
            if isinstance(v, torch.Tensor) and v.numel() == g.master.numel():
                n += v.numel() * v.element_size()
        out["host" if is_host_master(g) else "device"] += n
    return out


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
        # stage 1's flat buffer sums its micro-steps in bf16; stage 2 adds each reduce to the last in fp32
        exact16 = self._reduces_bf16_values() and not (self.free_grads_after_reduce and self._device_grad is not None)
        FlatGroup.reduce_grads(self, stream)
        self._copy_after_reduce(stream, exact16)

    # The stepped master cast to the compute dtype, in pinned host memory: the one-pass kernel writes it in the step's
    # own pass (host_shard), and the publish copies its 2 bytes an element to the device instead of the fp32 master's 4
    # (half the PCIe bytes, and no second read of the master in host memory). Made at the first step that writes it.
    _upload: torch.Tensor | None = None
    _upload_ready = False  # the step wrote _upload from this master: the next copy to the device reads it

    def host_shard(self) -> torch.Tensor | None:
        """The 16-bit host buffer the one-pass kernel may write the stepped master into (:class:`hf_zero.zero.host_step.
        HostStep`), or None: only where the runner steps every host group with that kernel (``grad16``, which the NVMe
        and streamed steps leave off) and the parameters are 16-bit."""
        if not self.grad16 or self.master is None or self.param_flat.dtype not in (torch.bfloat16, torch.float16):
            return None
        if self._upload is None:
            self._upload = host_buffer(self.master.numel(), self.param_flat.dtype, pin=self.pin)
        return self._upload

    def host_shard_written(self) -> None:  # the step's pass wrote _upload: the next copy to the device reads it
        self._upload_ready = True

    def speculative_out16(self) -> torch.Tensor | None:
        """Where super_offload's speculative step writes its 16-bit copy: :meth:`host_shard` itself, which nothing reads
        before the publish (:meth:`speculative_out16_written` marks it once the step stands)."""
        return self.host_shard()

    def speculative_out16_written(self) -> None:
        self.host_shard_written()

    def _copy_shard(self, dst: torch.Tensor) -> None:
        """The stepped master into ``dst`` (this rank's range of the parameters) on the current stream: the 16-bit copy
        the step wrote, or the fp32 master cast on the device."""
        if self._upload_ready:
            self._upload_ready = False
            assert self._upload is not None
            dst.copy_(self._upload.view_as(dst), non_blocking=self.pin)
            return
        _to_device(dst, self.master, self.pin)

    _shard_ahead = False  # write_shard_ahead copied the master already: the next publish only all-gathers
    def _write_shard(self, shard: torch.Tensor) -> None:
        """Host master -> this rank's range of the device parameters, cast to the compute dtype
        (:meth:`FlatGroup.publish_master` then all-gathers it)."""
        if self._shard_ahead:
            self._shard_ahead = False
            return
        self._copy_shard(shard)

    def write_shard_ahead(self, stream: torch.cuda.Stream | None) -> None:
        """Copy the stepped master into this rank's range of the parameters now, ahead of the publish (super_offload
        with overlap_param_gather: the groups stepped in backward are published in forward order, and their copies would
        otherwise run at the forward's end with nothing to hide behind); the publish then only all-gathers."""
        assert self.master is not None and not self.publish_pending
        with C.on_stream(stream):
            self._copy_shard(self.param_flat[self.shard_lo : self.shard_hi])
        self._shard_ahead = True


class _HostParamShard(ShardedParamGroup):
    """Parameter offload (``offload_param``): the compute-dtype shard the all-gather reads waits in host memory and is
    copied to the device just before each gather, on the gather stream, hidden by the prefetch ahead of the compute."""

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


class OffloadedShardedParamGroup(DeferredUnitStep, _HostMaster, _HostParamShard):
    """A stage-3 group whose fp32 master lives in host memory; its compute-dtype shard on the device, or in host memory
    too under ``offload_param`` (``params_on_host``). ``stream_grads``: see :class:`_HostMaster`."""

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
        # each reduce of a unit adds to the last in fp32: only the step's first keeps bf16 values
        exact16 = self._device_grad is None and self._released is None and self._reduces_bf16_values()
        if self.has_grads():
            self._unrelease(stream)
        ShardedParamGroup.reduce_grads(self, stream, limit)
        self._copy_after_reduce(stream, exact16)

    _shard_written = False  # the host step's one pass wrote the 16-bit host shard already (host_shard_written)

    def host_shard(self) -> torch.Tensor | None:
        """The 16-bit host shard the step may write in its pass (:class:`hf_zero.zero.host_step.HostStep`), else None."""
        shard = self.param_shard if self.shard_on_host and self.shard_store is None and self.master is not None else None
        return shard if shard is not None and shard.dtype in (torch.bfloat16, torch.float16) else None

    def host_shard_written(self) -> None:  # the step wrote it: the publish skips its cast
        self._shard_written = True

    _spare_shard: torch.Tensor | None = None  # super_offload's second 16-bit host shard (speculative_out16)

    def speculative_out16(self) -> torch.Tensor | None:
        """Where super_offload's speculative step writes the 16-bit host shard in its pass: not :meth:`host_shard`, which
        the rest of this backward may still gather from and a step that does not stand must leave as it was, but a
        second buffer like it (2 bytes an element, pinned as the shard is, made at first use), which becomes the shard
        when the step stands (:meth:`speculative_out16_written`): the publish then has no cast left to do. None where
        the runner does not step every host group with the one-pass kernel (``grad16``) or there is no host shard."""
        live = self.host_shard()
        if live is None or not self.grad16:
            return None
        if self._spare_shard is None:
            self._spare_shard = host_buffer(live.numel(), live.dtype, pin=self.shard_pin)
        return self._spare_shard

    def speculative_out16_written(self) -> None:
        """The speculative step that wrote :meth:`speculative_out16` stands: that buffer becomes the shard the gathers
        read (the old one the next spare), and the publish skips its cast."""
        assert self._spare_shard is not None and self.param_shard is not None
        self.param_shard, self._spare_shard = self._spare_shard.view_as(self.param_shard), self.param_shard
        self._shard_written = True

    def publish_master(self, stream: torch.cuda.Stream | None, defer: bool = False) -> None:
        """Host master -> the shard the next all-gather reads (cast to the compute dtype): on the device, or, with
        the shard in host memory too, cast there (one CPU pass; the gather copies the 16-bit values over). ``defer``
        (overlap_param_gather, hf_zero/zero/unit_steps.py): the gather waits for the copy's event, not the step."""
        self._deferred = None  # stepped: a gather has nothing left to run first
        if self.master is None:
            return
        assert self.param_shard is not None
        if self.shard_store is not None:
            self.shard_store.put(self, self.master)
            return
        if self.shard_on_host:
            if not self._shard_written:
                self.param_shard.copy_(self.master)
            self._shard_written = False
            return
        with C.on_stream(stream):
            _to_device(self.param_shard, self.master, self.pin)
            if defer and stream is not None:
                self._published = torch.cuda.Event()
                self._published.record(stream)


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

    ``needed`` is this rank's bytes, :func:`hf_zero.planning.estimate.offload_host_bytes` of its shards (the figure
    ``hf-zero estimate`` prints as host bytes per rank). ``streamed``, when given, is the same with the
    gradients streamed through two shared buffers instead of a host copy per group: when ``needed`` does not
    fit but that does, the answer is True (stream), and every rank gets the same answer. A plan may use
    MemAvailable less :data:`HOST_RESERVE_FRACTION` of it and :data:`HOST_RESERVE_PER_RANK` per rank of the
    machine. The ranks exchange (host id, bytes, streamed bytes, available bytes) in one all-gather over ``group``."""
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
