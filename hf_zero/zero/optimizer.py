"""``ShardedOptimizer``: every ZeRO stage as one optimizer wrapper over shard groups.

- Stage 0: gradients all-reduced per bucket; every rank steps the whole (fp32 master) buffer.
- Stage 1: gradients reduce-scattered; each rank steps only its shard of the masters and the
  optimizer state, then the updated parameters are all-gathered. Full gradients accumulate
  over the micro-steps of a step and are reduced once, at the boundary.
- Stage 2: as stage 1, but reduced every micro-step into the fp32 shard, so no full gradient
  outlives the backward that made it (more communication under gradient accumulation, less memory).
- Stage 3: the parameters themselves are sharded per unit (:mod:`hf_zero.zero.stage3`), and
  parameters below ``stage3_param_persistence_threshold`` stay whole in stage-2 style buckets.

Stages 0-2 keep their parameters in :class:`hf_zero.zero.flat.FlatGroup` buckets; in stages 1-2 a
bucket's full gradient buffer exists only from its first gradient until its reduce-scatter is
issued (with one micro-step per step the two stages are the same schedule). Everything outside
``zero/`` sees the buckets through :attr:`ShardedOptimizer.groups` and the
:class:`hf_zero.zero.group.ShardGroup` interface.

Buckets are launched strictly in bucket order (like DDP) even when autograd finishes them
out of order, so that every rank issues the same collectives in the same order: a bucket
whose gradients are complete waits until every earlier bucket has been launched.

What is built, and how the step runs, is decided once from three frozen inputs (:class:`ZeroPolicy`,
:class:`hf_zero.zero.group.Placement`, :class:`hf_zero.zero.offload.OffloadPolicy`): host memory is planned
(:func:`hf_zero.zero.offload.plan_host_memory`) before any buffer exists, and the step is a runner picked then
(:func:`hf_zero.zero.runner.pick_runner`) that :meth:`ShardedOptimizer.step_and_publish` calls. Adding NVMe
offload is a new runner class in ``hf_zero/zero/runner.py``, registered in ``pick_runner``, not a branch here;
``offload_optimizer.ratio`` < 1 is only a choice of group class at build time (which groups keep their master on the
device: :func:`hf_zero.zero.offload.device_group_count`), the host runners stepping those on the device first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hf_zero.errors import UnusedParameterError, UsageError
from hf_zero.parallel.tp_split import checkpoint_name, split_of
from hf_zero.zero import collectives as C
from hf_zero.zero.flat import FlatGroup
from hf_zero.zero.float8_gather import Float8ShardedParamGroup, float8_module_of
from hf_zero.zero.group import ParamSlot, Placement, ShardGroup, subgroup_of
from hf_zero.zero.grouping import (
    NamedParams,
    buckets_by_split,
    kind,
    largest_group_bound,
    trainable_group_count,
    unit_parts,
)
from hf_zero.zero.host_step import intra_op_threads
from hf_zero.zero.nvme import NvmeStores, open_stores
from hf_zero.zero.nvme_io import Scope
from hf_zero.zero.offload import (
    HostPlan,
    OffloadedFlatGroup,
    OffloadedFrozenGroup,
    OffloadedShardedParamGroup,
    OffloadPolicy,
    ShardSizes,
    _HostParamShard,
    device_group_count,
    is_host_master,
    optimizer_state_split,
    plan_host_memory,
    state_bytes_per_element,
)
from hf_zero.zero.optimizer_views import DeepSpeedOptimizerViews
from hf_zero.zero.overlap import DeferredPublish
from hf_zero.zero.param_attrs import full_numel
from hf_zero.zero.param_groups import point_optimizer_at, trainable_by_param_group
from hf_zero.zero.preshard import materialize_
from hf_zero.zero.runner import StepRunner, pick_runner
from hf_zero.zero.sharded_group import ShardedParamGroup
from hf_zero.zero.stage3 import Stage3Runtime
from hf_zero.zero.unit_steps import DeferredUnitSteps
from hf_zero.zero.units import Unit, assign_units

logger = logging.getLogger("hf_zero")


@dataclass(frozen=True, kw_only=True)
class ZeroPolicy:
    """The ZeRO stage and the knobs that shape its groups, decided once from the config's ``zero_optimization``.

    ``bucket_numel``: the elements of a stage 0-2 bucket (``reduce_bucket_size``; stage 3 too, for the parameters
    it keeps whole). ``persistence_threshold``, ``prefetch_numel``, ``max_live_numel``, ``max_reuse_numel``: the ``stage3_*`` values
    (which hold their defaults), read at stage 3 only. ``overlap_param_gather``: at stages 0-2 the step returns
    with the parameters' all-gathers in flight and the next forward waits for each group where it first reads it
    (:mod:`hf_zero.zero.overlap`); with the optimizer offloaded the CPU step of each group is deferred the same way,
    at stage 3 too, to each unit's next gather (:mod:`hf_zero.zero.unit_steps`); at stage 3 without offload it changes
    nothing. ``ignore_unused_parameters`` False: at stages 1-2, a trainable parameter that got
    no gradient in a step's backward passes stops that step (:meth:`ShardedOptimizer.check_unused_parameters`).
    """

    stage: int
    bucket_numel: int
    persistence_threshold: int
    prefetch_numel: int
    max_live_numel: int
    max_reuse_numel: int = 1_000_000_000
    overlap_param_gather: bool = False
    ignore_unused_parameters: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroPolicy.stage: got {self.stage!r}, expected one of 0, 1, 2, 3")
        if self.bucket_numel < 1:
            raise ValueError(f"ZeroPolicy.bucket_numel: got {self.bucket_numel}; a bucket holds at least one element")


class ShardedOptimizer(DeepSpeedOptimizerViews):
    """Owns the shard groups, the gradient hooks and the sharded optimizer step.

    The user's torch optimizer is kept (so an LR scheduler built on it keeps working) but its
    param groups are re-pointed at the fp32 master tensors, as DeepSpeed does. Built from three
    decisions made before it: where each group lives and in which dtypes (``place``, a
    :class:`hf_zero.zero.group.Placement` over the process group it shards over; its ``master_dtype`` is
    fp32, or bf16 for bf16 masters, the optimizer's state then following them), the stage and its knobs
    (``zero``, :class:`ZeroPolicy`) and what lives in host memory (``offload``,
    :class:`hf_zero.zero.offload.OffloadPolicy`). In that order it plans host memory, builds the groups
    and the gradient hooks, and picks the step runner (:mod:`hf_zero.zero.runner`) that
    :meth:`step_and_publish` delegates to.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, place: Placement,
                 zero: ZeroPolicy, offload: OffloadPolicy = OffloadPolicy()) -> None:
        if offload.optimizer and place.master_dtype != torch.float32:
            raise ValueError("bf16 masters are not built for an offloaded optimizer")  # the config refuses it first
        if offload.params and zero.stage != 3:
            raise ValueError(f"OffloadPolicy(params=True) is stage 3's offload_param, and the stage is {zero.stage}")
        self.optimizer, self.place, self.zero, self.offload = optimizer, place, zero, offload
        self.stage = stage = zero.stage
        self.group, self.rank, self.world_size, self.device = place.group, place.rank, place.world_size, place.device
        device = place.device
        self.comm_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.gather_stream = torch.cuda.Stream(device) if device.type == "cuda" and stage == 3 else None
        self.flat_groups: list[FlatGroup] = []
        self.stage3_groups: list[ShardedParamGroup] = []
        self.runtime: Stage3Runtime | None = None
        self._sub_places: dict[int, Placement] = {}  # place_of's placements over SubGroups, by process group

        group_named = trainable_by_param_group(module, optimizer)
        self.group_names = [[n for n, _ in named] for named in group_named]  # checkpoints record them
        self._group_params = [[p for _, p in named] for named in group_named]  # get_fp32_grad_partitions' order
        # optimizer.step() (DeepSpeed's: the ZeRO optimizer steps itself): the engine's step, set by the engine
        self.step_fn: Callable[[], None] | None = None
        self._global_grad_norm: torch.Tensor | None = None  # DeepSpeed's attribute: the last applied step's norm
        # the loss scale the gradients of the next backward carry (fp16: the engine points it at its LossScaler); the
        # speculative host step (super_offload) assumes the step multiplies them by its inverse, as without clipping
        self.loss_scale: Callable[[], float] = lambda: 1.0
        plan = HostPlan.FITS
        if offload.host_memory:  # before any host buffer exists; every rank gets the same answer
            plan = plan_host_memory(offload, self._shard_sizes(module, group_named),
                                    state_bytes=state_bytes_per_element(optimizer) + (
                                        offload.zenflow.host_bytes_per_element() if offload.zenflow else 0),
                                    param_bytes=place.compute_dtype.itemsize, group=place.group,
                                    # stages 1-2: the 16-bit copy of each stepped master sent to the device
                                    copy_bytes=place.compute_dtype.itemsize if stage < 3 and place.compute_dtype in (
                                        torch.bfloat16, torch.float16) else 0)
        self.stream_grads = plan is HostPlan.STREAM_GRADS
        if plan is not HostPlan.FITS and offload.speculate:  # super_offload's second buffers do not fit: off
            offload = self.offload = dataclasses.replace(offload, speculate=False)
        # "device": "nvme": the folders exist before the groups, and each group goes to disk as it is built
        self.nvme: NvmeStores | None = None
        self.nvme_scope = Scope(place.group, place.replicate)  # a disk failure stops every rank of the grid
        if offload.nvme and offload.optimizer:
            self.nvme = open_stores(optimizer, offload.optimizer_nvme, offload.params_nvme,
                                    max(1, state_bytes_per_element(optimizer) // 4), self.nvme_scope, self.comm_stream)
        group_masters: list[list[torch.Tensor]] = [[] for _ in group_named]
        # offload_optimizer.ratio < 1: the first this many trainable groups in parameter order keep their master on the
        # device (DeepSpeed's sub-groups by position, hf_zero/zero/offload.py device_group_count); _placed counts the
        # trainable groups placed so far (stage 3's units, then the buckets)
        self.device_groups = 0
        if offload.optimizer and offload.ratio < 1.0:
            self.device_groups = device_group_count(
                trainable_group_count(module, group_named, stage, zero.bucket_numel, zero.persistence_threshold),
                offload.ratio)
        self._placed = 0
        if stage == 3:
            self._build_stage3(module, group_named, group_masters)
            # Small parameters (norms, biases) stay whole on every rank, as stage 2 keeps them.
            group_named = [[x for x in named if full_numel(x[1]) < zero.persistence_threshold] for named in group_named]
        else:
            materialize_(list(module.parameters()), device)
        self._build_flat(group_named, group_masters)
        if self.nvme is not None:
            self.nvme.adopted(self.nvme_scope)
        point_optimizer_at(optimizer, group_masters)

        self._group_of: dict[int, ShardGroup] = {id(s.param): g for g in self.groups for s in g.slots}
        self._bucket_of: dict[int, tuple[int, ParamSlot]] = {}  # parameter -> (bucket index, its slot)
        self._hooks = []
        for i, fg in enumerate(self.flat_groups):
            for s in fg.slots:
                self._bucket_of[id(s.param)] = (i, s)
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._arrived = [0] * len(self.flat_groups)  # gradients of this backward, per bucket
        # ignore_unused_parameters false (DeepSpeed checks it at stages 1-2): the parameters that got a gradient since
        # the last step; None when nothing is checked
        self._got_grad: set[int] | None = set() if stage in (1, 2) and not zero.ignore_unused_parameters else None
        self.overlap: DeferredPublish | DeferredUnitSteps | None = None
        if zero.overlap_param_gather and stage <= 2 and self.flat_groups:
            self.overlap = DeferredPublish(module, self.flat_groups)
        elif (zero.overlap_param_gather and self.runtime is not None and offload.optimizer and self.nvme is None
              and not self.device_groups and not self.stream_grads and any(is_host_master(g) for g in self.stage3_groups)):
            # stage 3: each unit's host step where the next forward gathers it (hf_zero/zero/unit_steps.py); not with
            # the gradients streamed, whose fp32 shards wait on the GPU until their step (into the forward, deferred)
            self.overlap = DeferredUnitSteps(self.runtime, self.flat_groups, self.stage3_groups)
        self.runner: StepRunner = pick_runner(optimizer, self.groups, self.comm_stream, device=device, offload=offload,
                                              stream_grads=self.stream_grads, overlap=self.overlap, process_group=self.nvme_scope,
                                              nvme=self.nvme)
        if self.device_groups and self.rank == 0:
            trainable = sum(1 for g in self.groups if g.master is not None)
            logger.info("offload_optimizer.ratio %g: %d of %d trainable groups keep master and optimizer state on the "
                        "device (the first in parameter order) and step there beside the host step of the other %d",
                        offload.ratio, self.device_groups, trainable, sum(is_host_master(g) for g in self.groups))
        self._sync = False
        self._next_launch = 0
        self.reduced = False
        self.unreduced_backward = False  # a backward since the last step / zero_grad left its gradients unreduced

    def place_of(self, param: torch.Tensor) -> Placement:
        """The placement of ``param``'s shard group: the optimizer's, or, for a parameter marked with a
        :class:`hf_zero.zero.group.SubGroup`, the same dtypes and device over that sub-group (made once per sub-group)."""
        sub = subgroup_of(param)
        if sub is None:
            return self.place
        key = id(sub.group)
        if key not in self._sub_places:
            if self.place.replicas > 1:
                raise ValueError("a parameter sharded over a sub-group cannot also be hybrid-sharded")
            p = Placement.over(sub.group, self.place.device, self.place.compute_dtype, self.place.reduce_dtype,
                               self.place.master_dtype)
            self._sub_places[key] = dataclasses.replace(p, average_over=sub.average_over)
        return self._sub_places[key]

    def _shard_sizes(self, module: torch.nn.Module, group_named: list[NamedParams]) -> ShardSizes:
        """This rank's trainable and frozen shards, and a bound on its largest trainable group, before any group exists."""
        world = self.world_size

        def shard_of(named: NamedParams) -> int:  # zero.Init's: 0 elements
            return sum(math.ceil(full_numel(p) / (self.place_of(p).world_size if subgroup_of(p) else world))
                       for _, p in named)

        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        largest = 0
        if self.offload.optimizer:  # the streamed mode's two buffers
            largest = largest_group_bound(module, group_named, self.stage, self.zero.bucket_numel, world,
                                          self.zero.persistence_threshold)
        return ShardSizes(sum(shard_of(named) for named in group_named), frozen=shard_of(frozen), largest_group=largest)

    def _build_flat(self, group_named: list[NamedParams], group_masters: list[list[torch.Tensor]]) -> None:
        """Stages 0-2 (and stage 3's small parameters): each param group's parameters in buckets, in backward order."""
        offload, stage = self.offload, self.stage
        for gi, named in enumerate(group_named):
            # Reverse registration order approximates the order backward produces gradients.
            buckets = buckets_by_split(list(reversed(named)), self.zero.bucket_numel)
            for j, bucket in enumerate(buckets):
                place = self.place_of(bucket[0][1])
                # its position in parameter order (the last bucket holds the first parameters): offloaded, unless
                # offload_optimizer.ratio keeps it among the first groups on the device
                if offload.optimizer and self._placed + len(buckets) - 1 - j >= self.device_groups:
                    # on NVMe the master is written out and its memory freed: not registered with CUDA
                    fg: FlatGroup = OffloadedFlatGroup(bucket, place, partitioned=stage >= 1, free_grads_after_reduce=stage >= 1,
                                                       pin=offload.pin_memory and offload.optimizer_nvme is None,
                                                       stream_grads=self.stream_grads)
                else:
                    fg = FlatGroup(bucket, place, partitioned=stage >= 1, free_grads_after_reduce=stage >= 1)
                fg.tp_split = split_of(bucket[0][1]) is not None
                self.flat_groups.append(fg)
                if self.nvme is not None and self.nvme.swap is not None and fg.master is not None:
                    self.nvme.swap.adopt(fg)
                group_masters[gi].append(fg.master)
            self._placed += len(buckets)

    def _build_stage3(
        self, module: torch.nn.Module, group_named: list[NamedParams], group_masters: list[list[torch.Tensor]],
    ) -> None:
        """Shard every parameter at or above ``persistence_threshold`` into per-unit, per-param-group flat shards.

        Units are built one at a time: a model made under ``zero.Init`` arrives as per-parameter
        slices, and only the unit being laid out is gathered whole, so no rank ever holds the model.
        """
        offload, threshold = self.offload, self.zero.persistence_threshold
        unit_mods, unit_of = assign_units(module)
        names = dict(module.named_parameters())
        # named as checkpoints store them, as the trainable ones are (trainable_by_param_group): an EP rank's frozen
        # experts are its own block, which a resume checkpoint must keep apart from the other EP ranks' (name@ep<r>of<n>)
        frozen = [(checkpoint_name(n, p), p) for n, p in names.items() if not p.requires_grad]
        units: list[Unit] = []
        for ui in [*range(len(unit_mods)), -1]:
            materialize_([p for p in names.values() if unit_of.get(id(p), -1) == ui], self.device)
            groups: list[ShardedParamGroup] = []
            for gi, named in [*enumerate(group_named), (-1, frozen)]:
                kinds = unit_parts(named, ui, unit_of, threshold)
                # float8 linears' weights marked for the float8 all-gather (hf_zero/precision/float8.py), trainable and not
                # offloaded, in groups of their own: their unit's compute gathers them as float8
                f8 = [x for part in kinds for x in part if float8_module_of(x[1]) is not None and kind(x[1]) == (False, 0)
                      ] if gi >= 0 and not (offload.optimizer or offload.params) else []
                if f8:
                    moved = {id(x[1]) for x in f8}
                    kinds = [[x for x in part if id(x[1]) not in moved] for part in kinds] + [f8]
                for part in (k for k in kinds if k):
                    place = self.place_of(part[0][1])
                    # offloaded, unless offload_optimizer.ratio keeps it among the first trainable groups on the device
                    host = offload.optimizer and gi >= 0 and self._placed >= self.device_groups
                    self._placed += int(gi >= 0)
                    if part is f8:
                        g = Float8ShardedParamGroup(part, place, trainable=True)
                    elif gi < 0 and offload.params:
                        g = OffloadedFrozenGroup(part, place,
                                                 pin=offload.params_pin_memory and offload.params_nvme is None)
                    elif not host:
                        g = ShardedParamGroup(part, place, trainable=gi >= 0)
                    else:
                        g = OffloadedShardedParamGroup(part, place, trainable=True,
                                                       pin=offload.pin_memory and not offload.nvme,
                                                       params_on_host=offload.params, stream_grads=self.stream_grads)
                    g.tp_split = split_of(part[0][1]) is not None
                    groups.append(g)
                    if self.nvme is not None:  # to disk as built: host memory never holds every group at once
                        if self.nvme.params is not None and isinstance(g, _HostParamShard) and g.shard_on_host:
                            self.nvme.params.adopt(g)
                        if self.nvme.swap is not None and g.master is not None:
                            self.nvme.swap.adopt(g)
                    self.stage3_groups.append(g)
                    if g.master is not None:
                        group_masters[gi].append(g.master)
            if ui >= 0:
                units.append(Unit(ui, unit_mods[ui][0], unit_mods[ui][1], groups, is_root=False))
            else:
                units.append(Unit(len(unit_mods), "<root>", module, groups, is_root=True))
        self.runtime = Stage3Runtime(
            module, units, stream=self.gather_stream, reduce_stream=self.comm_stream,
            prefetch_numel=self.zero.prefetch_numel, max_live_numel=self.zero.max_live_numel,
            max_reuse_numel=self.zero.max_reuse_numel,
        )

    # ------------------------------------------------------------ the groups

    @property
    def groups(self) -> list[ShardGroup]:
        """Every shard group: the FlatGroup buckets, then stage 3's ShardedParamGroups (the public listing)."""
        return [*self.flat_groups, *self.stage3_groups]

    def group_of(self, param: torch.Tensor) -> ShardGroup | None:
        """The shard group holding ``param`` (None for a buffer or a frozen parameter kept whole)."""
        return self._group_of.get(id(param))

    def master_params(self) -> Iterable[torch.Tensor]:
        """The fp32 tensors the optimizer steps, one per trainable group."""
        return (g.master for g in self.groups if g.master is not None)

    def wait_params(self) -> None:
        """Make every parameter usable on the current stream: wait for the gathers a deferred publish left in flight.

        A no-op unless ``overlap_param_gather`` is on and a step has published since the last wait.
        """
        if self.overlap is not None:
            self.overlap.wait_all()

    def resident(self) -> contextlib.AbstractContextManager[None]:
        """Every master, optimizer state and offloaded shard in memory for the block: a save or a load reads and writes
        them (collective). Only NVMe offload keeps any elsewhere (:class:`hf_zero.zero.runner.NvmeRunner`)."""
        return self.runner.resident()

    @property
    def state_namespace(self) -> str | None:
        """The prefix of the optimizer-state keys the step runner keeps state of its own under during a save or load
        (``"zenflow."``); None for the runners that keep none. A checkpoint's keys of another namespace are not
        loaded (``hf_zero/checkpoint/optim_state.py``)."""
        return self.runner.state_namespace

    def set_epoch_length(self, steps: int) -> None:
        """The training loader's epoch is ``steps`` optimizer steps: ZenFlow's "epoch" reselection counts in it."""
        self.runner.set_epoch_length(steps)

    def release_inference(self) -> None:
        """Stage 3: release what no-grad forwards (evaluation, ``generate``) left gathered."""
        if self.runtime is not None:
            self.runtime.release_inference()

    # ------------------------- the torch optimizer it wraps (DeepSpeed's names for the masters: optimizer_views.py)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    # ----------------------------------------------------------- backward

    @property
    def reduces_every_micro_step(self) -> bool:
        """Stages 2-3 reduce-scatter each micro-step's gradients (stages 0-1 only at the boundary)."""
        return self.stage >= 2

    def prepare_backward(self, sync: bool, final: bool = True) -> None:
        """Before ``loss.backward()``: gradient views in place; ``sync`` means reduce as buckets fill.

        A backward without ``sync`` leaves unreduced gradients behind, so ``reduced`` turns False
        until a synced backward has reduced them too. ``final``: this backward ends the step's
        accumulation (offloaded groups then start copying each reduced shard to the host at once).
        """
        if self.overlap is not None:  # a backward with no forward since the step (retain_graph) reads the weights
            self.overlap.wait_all()
        self._sync = sync
        if self.offload.optimizer:
            for g in self.groups:
                g.copy_after_reduce = sync and final
            if sync and final:  # super_offload: the groups are stepped as their host copies land (hf_zero/zero/runner.py)
                self.runner.arm(1.0 / self.loss_scale())
        if not sync:
            self.reduced = False
            self.unreduced_backward = True
        self._next_launch = 0
        self._arrived = [0] * len(self.flat_groups)
        for fg in self.flat_groups:
            # Stages 1-2 allocate a bucket's buffer, if at all, when its first gradient arrives
            # (adopt_grad), so the activation peak at the start of backward does not also carry
            # every gradient; a backward that reduces leaves gradients where autograd puts them.
            fg.begin_backward(sync)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        i, slot = self._bucket_of[id(param)]
        self.flat_groups[i].adopt_grad(slot)
        if self._got_grad is not None:
            self._got_grad.add(id(param))
        if not self._sync:
            return
        self._arrived[i] += 1
        while self._next_launch < len(self.flat_groups):
            nxt = self.flat_groups[self._next_launch]
            if self._arrived[self._next_launch] < len(nxt.slots):
                break
            nxt.reduce_grads(self.comm_stream)
            self._next_launch += 1

    def finish_backward(self) -> None:
        """After ``loss.backward()``: launch what unused parameters held back, then wait."""
        if self.runtime is not None:
            self.runtime.finish_backward()
        if not self._sync:
            return
        while self._next_launch < len(self.flat_groups):
            self.flat_groups[self._next_launch].reduce_grads(self.comm_stream)
            self._next_launch += 1
        C.wait_for(self.comm_stream)
        self.reduced = True
        self._sync = False

    def check_unused_parameters(self) -> None:
        """``ignore_unused_parameters: false``: stop the step when a trainable parameter got no gradient since the last.

        DeepSpeed's stage 1-2 optimizer asserts it (naming the config key) when it takes the step's gradient norm; here
        the ranks first agree on which parameters are missing on any of them (one all-reduce of a flag per parameter),
        so every rank raises the same error, naming them, instead of one rank raising while the others wait for it.
        A no-op where the option is on (DeepSpeed's default) or the stage is 0 or 3.
        """
        if self._got_grad is None:
            return
        slots = [s for fg in self.flat_groups for s in fg.slots]
        missing = torch.tensor([id(s.param) not in self._got_grad for s in slots], dtype=torch.int32, device=self.device)
        if self.world_size > 1:
            torch.distributed.all_reduce(missing, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if self.place.replicate is not None:  # hybrid sharding: the other shard groups' ranks too
            torch.distributed.all_reduce(missing, op=torch.distributed.ReduceOp.MAX, group=self.place.replicate)
        names = [s.name for s, m in zip(slots, missing.tolist()) if m]
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise UnusedParameterError(
                f"{len(names)} trainable parameter(s) got no gradient in this step's backward passes on at least one "
                f"rank ({shown}) and zero_optimization.ignore_unused_parameters is false: make every trainable "
                "parameter take part in the loss, freeze the unused ones (requires_grad=False), or set "
                "ignore_unused_parameters to true"
            )

    # --------------------------------------------------------------- step

    def scale_grads(self, coef: torch.Tensor | float) -> None:
        """Multiply every reduced gradient shard by ``coef`` (unscale and clip in one pass).

        The runner hears ``coef`` first: under ``super_offload`` the groups already stepped with the coefficient of a
        step that does not clip keep that step only if ``coef`` is that one."""
        self.runner.verdict(coef)
        if isinstance(coef, float) and coef == 1.0:
            return
        grads = [g for g in (group.reduced_grad() for group in self.groups) if g is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        if self.offload.optimizer:  # the shards already copied to the host (and released) are scaled there
            with intra_op_threads(self.offload.host_threads):
                for g in self.groups:
                    g.scale_host_copy(coef)

    def discard_speculation(self) -> None:
        """The step policy skips this step: undo the host steps ``super_offload`` took for it during backward."""
        self.runner.discard()

    def step_and_publish(self, timed: Callable[[str, float], None] | None = None) -> None:
        """Optimizer step on this rank's masters, then publish the new weights to every rank.

        How is the runner's, picked once when this optimizer was built (:mod:`hf_zero.zero.runner`): on the
        device, or, offloaded, the host masters one shard group at a time (:class:`hf_zero.zero.host_step.HostStep`);
        with ``overlap_param_gather`` the publish (and an offloaded step) is finished where the next forward
        first reads each group. ``timed(part, seconds)``, when given, receives the offloaded step's three parts
        (``hf_zero/training/timers.py``; deferred: the CPU optimizer's only, once done).
        """
        self.runner.step(timed)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. Gradient buffers are always reused (or freed under stage 2)."""
        del set_to_none
        self.runner.discard()  # a step skipped (or gradients cleared): a speculative step taken for it is undone
        for g in self.groups:
            g.zero_grads()
        self.reduced = False
        if self._got_grad is not None:
            self._got_grad.clear()
        self.unreduced_backward = False

    def step(self, closure: object = None) -> None:
        """DeepSpeed's ZeRO ``optimizer.step()``: the engine's optimizer step (global norm, fp16 / non-finite rule,
        clip, step, publish; the reduced gradients are dropped after) without its counters or LR scheduler, which
        only ``engine.step()`` moves, as under DeepSpeed."""
        if closure is not None:
            raise UsageError("optimizer.step(closure): a ZeRO optimizer takes no closure; run forward and "
                             "engine.backward(loss) first, then step")
        if self.step_fn is None:
            raise UsageError("this optimizer belongs to no engine (it was destroyed, or built outside "
                             "hf_zero.initialize); step through engine.step()")
        self.step_fn()

    # ------------------------------------------------------------ helpers

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (unique storages).

        A storage counts once, in the first of params, grads, optim that holds it (in fp32 a
        stage 0-2 master is a view of the parameters: it counts as parameters).
        """
        seen: set[int] = set()

        def size(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                return 0
            seen.add(st.data_ptr())
            return st.nbytes()

        held = [g.held_tensors() for g in self.groups]
        params = sum(size(t) for h in held for t in h["params"])
        grads = sum(size(t) for h in held for t in h["grads"])
        optim = sum(size(m) for m in self.master_params())
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.numel() > 1:
                    optim += size(v)
        return {"params": params, "grads": grads, "optim": optim}

    def optimizer_state_bytes(self) -> dict[str, int]:
        """This rank's masters and optimizer state in bytes, by where they step: ``{"host": ..., "device": ...}``.

        With ``offload_optimizer.ratio`` < 1 the device holds the first groups' share (DeepSpeed's Twin-Flow split,
        :func:`hf_zero.zero.offload.device_group_count`); the optimizer state exists from the first step on.
        """
        return optimizer_state_split(self.groups, self.optimizer)
