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
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from hf_zero.estimate import offload_host_bytes
from hf_zero.tp_split import checkpoint_name, split_of
from hf_zero.zero import collectives as C
from hf_zero.zero.flat import FlatGroup
from hf_zero.zero.group import ParamSlot, Placement, ShardGroup
from hf_zero.zero.offload import (
    HostStep,
    OffloadedFlatGroup,
    OffloadedFrozenGroup,
    OffloadedShardedParamGroup,
    check_host_memory,
    host_buffer,
    intra_op_threads,
    state_bytes_per_element,
    use_host_kernels,
)
from hf_zero.zero.overlap import DeferredPublish
from hf_zero.zero.param_attrs import full_numel
from hf_zero.zero.preshard import materialize_
from hf_zero.zero.stage3 import ShardedParamGroup, Stage3Runtime, Unit, find_units, input_embedding_unit

NamedParams = list[tuple[str, torch.nn.Parameter]]
logger = logging.getLogger("hf_zero")


def _buckets(named: NamedParams, bucket_numel: int) -> list[NamedParams]:
    """Split parameters (already in backward order) into buckets of about ``bucket_numel`` elements."""
    out: list[NamedParams] = []
    cur: NamedParams = []
    size = 0
    for item in named:
        n = item[1].numel()
        if cur and size + n > bucket_numel:
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += n
    if cur:
        out.append(cur)
    return out


def _buckets_by_split(named: NamedParams, bucket_numel: int) -> list[NamedParams]:
    """``_buckets``, except that tensor-parallel slices and whole parameters never share a bucket.

    The global norm counts a bucket of whole parameters once per tensor-parallel group and a bucket
    of slices on every rank (``hf_zero/step.py``). Each kind is bucketed on its own and the buckets
    are ordered by when their last gradient arrives, so they still launch about as backward fills them.
    """
    if not any(split_of(p) for _, p in named):
        return _buckets(named, bucket_numel)
    pos = {id(p): i for i, (_, p) in enumerate(named)}
    out = (_buckets([x for x in named if split_of(x[1])], bucket_numel)
           + _buckets([x for x in named if not split_of(x[1])], bucket_numel))
    return sorted(out, key=lambda b: pos[id(b[-1][1])])


def _trainable_by_param_group(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[NamedParams]:
    """The trainable ``(name, parameter)`` pairs of each optimizer param group, checked before any work is done."""
    # a tensor-parallel slice is named per rank, so checkpoints keep every rank's slice (hf_zero/tp_split.py)
    names = {id(p): checkpoint_name(n, p) for n, p in module.named_parameters(remove_duplicate=True)}
    seen: set[int] = set()
    group_named: list[NamedParams] = []
    for gi, pg in enumerate(optimizer.param_groups):
        named = []
        for p in pg["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter appears twice in the optimizer's param groups (group {gi})")
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; build the optimizer from model.parameters()"
                )
            seen.add(id(p))
            if p.requires_grad:
                named.append((names[id(p)], p))
        group_named.append(named)
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(
            f"parameter '{missing[0]}' requires grad but is in no optimizer param group; "
            "freeze it (requires_grad=False) or pass it in model_parameters"
        )
    return group_named


def _assign_units(module: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], dict[int, int]]:
    """Stage 3's units (the input embedding first when it is one) and each parameter's unit (-1: the root).

    A parameter reachable under two units, or under a unit and outside every unit (a tied embedding and LM
    head, a weight a parent module also holds), must be whole whenever any of them runs: it joins the root
    unit, which stays gathered for the whole step. A unit left with no parameter of its own is dropped.
    """
    unit_mods = find_units(module)
    embedding = input_embedding_unit(module, unit_mods)
    if embedding is not None:
        unit_mods = [embedding, *unit_mods]
    owner: dict[int, int] = {}
    for ui, (_, m) in enumerate(unit_mods):
        for p in m.parameters():
            owner[id(p)] = ui if owner.get(id(p), ui) == ui else -1
    # what the root reaches without passing through a unit (the same module object repeated in a ModuleList,
    # ALBERT's shared layer, is one unit called many times, not a way around it)
    units = {id(m) for _, m in unit_mods}
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in units:
            continue
        seen.add(id(m))
        for p in m._parameters.values():
            if p is not None:
                owner[id(p)] = -1
        stack.extend(c for c in m._modules.values() if c is not None)
    kept = sorted({ui for ui in owner.values() if ui >= 0})
    renumber = {old: new for new, old in enumerate(kept)}
    unit_of = {pid: renumber.get(ui, -1) for pid, ui in owner.items() if ui >= 0}
    return [unit_mods[ui] for ui in kept], unit_of


def _largest_group_bound(module: torch.nn.Module, group_named: list[NamedParams], stage: int, bucket_numel: int,
                         world: int, threshold: int) -> int:
    """An upper bound, in elements, on the largest trainable shard group this rank will hold (before they exist).

    Stages 1-2 (and the parameters below ``threshold`` that stage 3 keeps whole) go in buckets of about
    ``bucket_numel`` elements that hold at least one parameter; stage 3 groups the rest by unit (per optimizer
    param group, so a unit's total bounds them). Each rank holds ``1/world`` of either.
    """
    params = [p for named in group_named for _, p in named]
    small = [p for p in params if stage < 3 or full_numel(p) < threshold]
    biggest = max([min(bucket_numel, sum(full_numel(p) for p in small)), *(full_numel(p) for p in small)], default=0)
    if stage == 3:
        trainable = {id(p) for p in params if full_numel(p) >= threshold}
        _, unit_of = _assign_units(module)
        per_unit: dict[int, int] = defaultdict(int)
        for p in module.parameters():
            if id(p) in trainable:
                per_unit[unit_of.get(id(p), -1)] += full_numel(p)
        biggest = max([biggest, *per_unit.values()])
    return math.ceil(biggest / world)


def _point_optimizer_at(optimizer: torch.optim.Optimizer, group_masters: list[list[torch.Tensor]]) -> None:
    """Re-point each param group at its masters and start the optimizer's state afresh."""
    for pg, masters in zip(optimizer.param_groups, group_masters):
        pg["params"] = masters
        if (
            getattr(optimizer, "hf_zero_fuse_on_device", False)
            and pg.get("fused") is None
            and not pg.get("foreach")
            and masters
            and all(m.is_cuda for m in masters)
        ):
            pg["fused"] = True  # the config's Adam, built on zero.Init's meta parameters
    optimizer.state = defaultdict(dict)


class ShardedOptimizer:
    """Owns the shard groups, the gradient hooks and the sharded optimizer step.

    The user's torch optimizer is kept (so an LR scheduler built on it keeps working) but its
    param groups are re-pointed at the fp32 master tensors, as DeepSpeed does. The stage-3
    knobs (``persistence_threshold``, ``prefetch_numel``, ``max_live_numel``: the config's
    ``stage3_*`` values, which hold their defaults) only matter at stage 3.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        bucket_numel: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        persistence_threshold: int,
        prefetch_numel: int,
        max_live_numel: int,
        offload_pin: bool | None = None,
        master_dtype: torch.dtype = torch.float32,
        param_offload_pin: bool | None = None,
        overlap_param_gather: bool = False,
        host_threads: int | None = None,
    ) -> None:
        """``offload_pin``: None keeps masters and optimizer state on ``device``; a bool moves them to host memory
        (ZeRO-Offload, :mod:`hf_zero.zero.offload`), pinned when True and CUDA is present. ``master_dtype``:
        fp32, or bf16 for bf16 masters (the optimizer's state then follows them into bf16). ``param_offload_pin``
        (stage 3's ``offload_param``): None keeps parameter shards on ``device``; a bool keeps the 16-bit shards
        the gathers read in host memory (frozen groups always; trainable ones when the optimizer is offloaded
        too, since otherwise their fp32 master is the shard and the optimizer steps it on the device).
        ``overlap_param_gather``: at stages 0-2, the step returns with the parameters' all-gathers in flight and the
        next forward waits for each group where it first reads it (:mod:`hf_zero.zero.overlap`); with the optimizer
        offloaded the CPU step of each group is deferred the same way (:class:`hf_zero.zero.offload.HostStep`), so it
        runs beside the next forward; ignored at stage 3 (it publishes as before). ``host_threads``: the offloaded
        step's intra-op threads (:func:`hf_zero.zero.offload.host_step_threads`); None keeps the process's count."""
        self.optimizer = optimizer
        self.host_threads = host_threads
        self.offload_pin = offload_pin
        self.param_offload_pin = param_offload_pin if stage == 3 else None
        self.stage = stage
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.comm_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.gather_stream = torch.cuda.Stream(device) if device.type == "cuda" and stage == 3 else None
        self.flat_groups: list[FlatGroup] = []
        self.stage3_groups: list[ShardedParamGroup] = []
        self.runtime: Stage3Runtime | None = None
        if master_dtype != torch.float32 and offload_pin is not None:
            raise ValueError("bf16 masters are not built for an offloaded optimizer")  # the config refuses it first
        self.place = Placement.over(group, device, compute_dtype, reduce_dtype, master_dtype)

        group_named = _trainable_by_param_group(module, optimizer)
        self.group_names = [[n for n, _ in named] for named in group_named]  # checkpoints record them
        if offload_pin is not None or self.param_offload_pin is not None:
            # planned before any host buffer exists: fp32 master + gradient copy + state, offloaded 16-bit shards
            def shard_of(named: list) -> int:
                return sum(math.ceil(full_numel(p) / self.place.world_size) for _, p in named)  # zero.Init's: 0 elements

            frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
            params = self.param_offload_pin is not None
            trainable = sum(shard_of(named) for named in group_named)
            needed = offload_host_bytes(trainable, state_bytes_per_element(optimizer), optimizer=offload_pin is not None,
                                        param_bytes=compute_dtype.itemsize if params else 0,
                                        frozen_numel=shard_of(frozen) if params else 0)
            streamed = None
            if offload_pin is not None:  # no gradient copy per group: two buffers of the largest group instead
                largest = _largest_group_bound(module, group_named, stage, bucket_numel, self.place.world_size,
                                               persistence_threshold)
                streamed = needed - 4 * trainable + 2 * 4 * min(largest, trainable)
            self.stream_grads = check_host_memory(needed, group, streamed)
        else:
            self.stream_grads = False
        self._grad_stream_bufs: list[torch.Tensor] = []  # the two shared host buffers of a streamed step
        group_masters: list[list[torch.Tensor]] = [[] for _ in group_named]
        if stage == 3:
            self._build_stage3(module, group_named, group_masters, persistence_threshold, prefetch_numel, max_live_numel)
            # Small parameters (norms, biases) stay whole on every rank, as stage 2 keeps them.
            group_named = [[x for x in named if x[1].numel() < persistence_threshold] for named in group_named]
        else:
            materialize_(list(module.parameters()), device)
        for gi, named in enumerate(group_named):
            # Reverse registration order approximates the order backward produces gradients.
            for bucket in _buckets_by_split(list(reversed(named)), bucket_numel):
                if offload_pin is None:
                    fg = FlatGroup(bucket, self.place, partitioned=stage >= 1, free_grads_after_reduce=stage >= 1)
                else:
                    fg = OffloadedFlatGroup(bucket, self.place, partitioned=stage >= 1, free_grads_after_reduce=stage >= 1,
                                            pin=offload_pin)
                fg.tp_split = split_of(bucket[0][1]) is not None
                self.flat_groups.append(fg)
                group_masters[gi].append(fg.master)
        _point_optimizer_at(optimizer, group_masters)
        if offload_pin is not None:
            use_host_kernels(optimizer)
            for g in self.groups:
                if g.trainable:
                    g.stream_grads = self.stream_grads
            if self.stream_grads and self.rank == 0:
                logger.warning(
                    "offload: host memory cannot hold a copy of every gradient beside the masters and optimizer state; "
                    "each rank keeps its fp32 gradient shard on the GPU until the step (4 bytes per parameter / %d) and "
                    "the step streams it to the host group by group through two shared buffers", self.world_size)

        self._group_of: dict[int, ShardGroup] = {id(s.param): g for g in self.groups for s in g.slots}
        self._bucket_of: dict[int, tuple[int, ParamSlot]] = {}  # parameter -> (bucket index, its slot)
        self._hooks = []
        for i, fg in enumerate(self.flat_groups):
            for s in fg.slots:
                self._bucket_of[id(s.param)] = (i, s)
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._arrived = [0] * len(self.flat_groups)  # gradients of this backward, per bucket
        self.overlap: DeferredPublish | None = None
        if overlap_param_gather and stage <= 2 and self.flat_groups:
            self.overlap = DeferredPublish(module, self.flat_groups)
        self._sync = False
        self._next_launch = 0
        self.reduced = False

    def _build_stage3(
        self, module: torch.nn.Module, group_named: list[NamedParams], group_masters: list[list[torch.Tensor]],
        threshold: int, prefetch_numel: int, max_live_numel: int,
    ) -> None:
        """Shard every parameter at or above ``threshold`` into per-unit, per-param-group flat shards.

        Units are built one at a time: a model made under ``zero.Init`` arrives as per-parameter
        slices, and only the unit being laid out is gathered whole, so no rank ever holds the model.
        """
        unit_mods, unit_of = _assign_units(module)
        names = dict(module.named_parameters())
        frozen = [(n, p) for n, p in names.items() if not p.requires_grad]
        units: list[Unit] = []
        for ui in [*range(len(unit_mods)), -1]:
            materialize_([p for p in names.values() if unit_of.get(id(p), -1) == ui], self.device)
            groups: list[ShardedParamGroup] = []
            for gi, named in [*enumerate(group_named), (-1, frozen)]:
                picked = [x for x in named if unit_of.get(id(x[1]), -1) == ui and x[1].numel() >= threshold]
                if not picked:
                    continue
                if gi < 0 and self.param_offload_pin is not None:
                    g = OffloadedFrozenGroup(picked, self.place, pin=self.param_offload_pin)
                elif self.offload_pin is None or gi < 0:
                    g = ShardedParamGroup(picked, self.place, trainable=gi >= 0)
                else:
                    g = OffloadedShardedParamGroup(picked, self.place, trainable=True, pin=self.offload_pin,
                                                   params_on_host=self.param_offload_pin is not None)
                groups.append(g)
                self.stage3_groups.append(g)
                if g.master is not None:
                    group_masters[gi].append(g.master)
            if ui >= 0:
                units.append(Unit(ui, unit_mods[ui][0], unit_mods[ui][1], groups, is_root=False))
            else:
                units.append(Unit(len(unit_mods), "<root>", module, groups, is_root=True))
        self.runtime = Stage3Runtime(
            module, units, stream=self.gather_stream, reduce_stream=self.comm_stream,
            prefetch_numel=prefetch_numel, max_live_numel=max_live_numel,
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

    def release_inference(self) -> None:
        """Stage 3: release what no-grad forwards (evaluation, ``generate``) left gathered."""
        if self.runtime is not None:
            self.runtime.release_inference()

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
        if self.offload_pin is not None:
            for g in self.groups:
                g.copy_after_reduce = sync and final
        if not sync:
            self.reduced = False
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

    # --------------------------------------------------------------- step

    def scale_grads(self, coef: torch.Tensor | float) -> None:
        """Multiply every reduced gradient shard by ``coef`` (unscale and clip in one pass)."""
        if isinstance(coef, float) and coef == 1.0:
            return
        grads = [g for g in (group.reduced_grad() for group in self.groups) if g is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        if self.offload_pin is not None:  # the shards already copied to the host (and released) are scaled there
            with intra_op_threads(self.host_threads):
                for g in self.groups:
                    g.scale_host_copy(coef)

    def step_and_publish(self, timed: Callable[[str, float], None] | None = None) -> None:
        """Optimizer step on this rank's masters, then publish the new weights to every rank.

        Offloaded (host) masters step one shard group at a time: the optimizer sees only that
        group's gradient (torch's optimizers skip parameters without one, so each master is updated
        once, with its own step count), and the group's copy back to the device is issued on the
        communication stream before the CPU moves on to the next group (:class:`HostStep`). With
        ``overlap_param_gather`` only the group the next forward reads first is stepped here; the others
        step where the forward first waits for them. ``timed(part, seconds)``, when given, receives the
        offloaded step's three parts (``hf_zero/timers.py``; deferred: the CPU optimizer's only, once done).
        """
        clock = time.perf_counter
        t0 = clock()
        if self.overlap is not None:  # a step with no forward since the last: its gathers still write the buffers
            self.overlap.wait_all()
        for g in self.groups:
            g.before_step()
        if self.offload_pin is None:
            self.optimizer.step()
            if self.overlap is not None:
                # No wait here: each group is waited for where it is first read (hf_zero/zero/overlap.py).
                for g in self.overlap.order:
                    g.publish_master(self.comm_stream, defer=True)
                self.overlap.armed()
                return
            for g in self.groups:
                g.publish_master(self.comm_stream)
            C.wait_for(self.comm_stream)
            return
        t1 = clock()
        if self.stream_grads:  # each group's fp32 shard waited on the device; the step streams it through two buffers
            work = [(g, g.reduced_grad()) for g in self.groups if g.master is not None and g.reduced_grad() is not None]
            largest = max((g.master.numel() for g, _ in work), default=0)
            if largest and (not self._grad_stream_bufs or self._grad_stream_bufs[0].numel() < largest):
                pin = bool(self.offload_pin) and torch.cuda.is_available()
                self._grad_stream_bufs = [host_buffer(largest, torch.float32, pin=pin) for _ in range(2)]
            streamed: list[torch.Tensor] | None = self._grad_stream_bufs
        else:  # before_step handed each group its host copy as the master's .grad
            work = [(g, g.master.grad) for g in self.groups if g.master is not None and g.master.grad is not None]
            streamed = None
        for g, _ in work:
            g.master.grad = None  # the optimizer sees one group's gradient at a time (HostStep)
        if self.overlap is not None:
            # No step here beyond the first group: each group steps where the next forward first reads it.
            rank = {id(g): i for i, g in enumerate(self.overlap.order)}
            work.sort(key=lambda x: rank[id(x[0])])
            if timed is not None:
                timed("step.wait_grads", t1 - t0)
            run = HostStep(self.optimizer, self.comm_stream, work, streamed=streamed, defer=True,
                           on_done=None if timed is None else (lambda s: timed("step.cpu_optimizer", s)),
                           threads=self.host_threads)
            for g, _ in work:
                g.defer_step(functools.partial(run.through, g))  # type: ignore[attr-defined]
            if work:  # at once: the first group the forward reads, and a step a scheduler can see was taken
                run.through(work[0][0])
            self.overlap.armed()
            return
        run = HostStep(self.optimizer, self.comm_stream, work, streamed=streamed, threads=self.host_threads)
        run.finish()
        if streamed is None:
            for g, grad in work:
                g.master.grad = grad  # as after a step without offload, until zero_grad
        t2 = clock()
        C.wait_for(self.comm_stream)
        if timed is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            timed("step.wait_grads", t1 - t0)
            timed("step.cpu_optimizer", run.cpu_seconds)
            timed("step.to_device", (t2 - t1 - run.cpu_seconds) + (clock() - t2))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. Gradient buffers are always reused (or freed under stage 2)."""
        del set_to_none
        for g in self.groups:
            g.zero_grads()
        self.reduced = False

    def step(self, closure: object = None) -> None:
        raise RuntimeError(
            "hf_zero applies the optimizer inside engine.step(); call engine.step() after engine.backward(loss) "
            "instead of optimizer.step()"
        )

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
