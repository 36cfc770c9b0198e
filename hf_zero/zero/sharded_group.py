"""Stage 3's shard group: the parameters of one unit, held between uses as this rank's shard only.

:class:`ShardedParamGroup` is the :class:`hf_zero.zero.group.ShardGroup` of ZeRO stage 3: its parameters are
views of one full-size buffer whose storage is emptied between uses, so that only this rank's shard (the fp32
master of a trainable group, the compute-dtype shard of a frozen one) stays. It gathers (an all-gather into that
buffer, on a side stream when on GPU), waits, reshards (empties the buffer again) and reduce-scatters its
gradients into the fp32 gradient shard. :class:`ShardState` is where a group is in that cycle, and
:data:`DS_STATUS` the DeepSpeed ``ds_status`` its parameters report in each state. When to gather and release a
group is not decided here: :class:`hf_zero.zero.stage3.Stage3Runtime`'s hooks drive the groups of each unit
(:class:`hf_zero.zero.units.Unit`), and ``GatheredParameters`` (:mod:`hf_zero.zero.gathered`) a user's gather.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.group import Placement, ShardGroup, pack_grads
from hf_zero.zero.param_attrs import ZeroParamStatus, set_status
from hf_zero.zero.released import mark_released, mark_whole


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather issued on the side stream, not yet waited on
    GATHERED = "gathered"


# DeepSpeed's ds_status of a parameter in each state of its group
DS_STATUS = {ShardState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, ShardState.GATHERING: ZeroParamStatus.INFLIGHT,
              ShardState.GATHERED: ZeroParamStatus.AVAILABLE}


class ShardedParamGroup(ShardGroup):
    """The parameters of one unit (and one optimizer param group), sharded across ranks."""

    partitioned = True
    resident = False
    # A frozen group whose shard is the whole of its parameters may make them views of that shard (a subclass
    # that moves the shard elsewhere, to host memory, must not).
    alias_whole_shard = True
    # Set by Stage3Runtime for the groups of a unit other than the root: pin_for(module) keeps the unit whole with
    # the root unit unless ``module`` is inside it (hf_zero.zero.register_external_parameter).
    pin_for: Callable[[torch.nn.Module], None] | None = None

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, trainable: bool,
                 build_on_host: bool = False) -> None:
        """``build_on_host``: cut the shard in host memory (the offloading subclasses, whose shard lives there), so
        that sharding a model that sits whole on the GPU never needs more GPU memory than the model itself."""
        super().__init__(named_params, place, parts=place.world_size)
        self.trainable = trainable
        device, compute_dtype = place.device, place.compute_dtype
        lo, hi = self.shard_lo, self.shard_hi
        shard32 = torch.zeros(self.shard_numel, dtype=torch.float32, device="cpu" if build_on_host else device)
        with torch.no_grad():
            for s in self.slots:  # copy only the part of each parameter that falls in this shard
                a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
                if a < b:
                    shard32[a - lo : b - lo].copy_(s.param.detach().reshape(-1)[a - s.offset : b - s.offset])
            # The parameters' own storage goes before the unit's gather buffer is made: with a model built whole on
            # the GPU, both at once cost the largest unit twice over (8B with offload: 1.9 GiB above FSDP2's peak).
            for s in self.slots:
                s.param.data = torch.empty(0, dtype=s.param.dtype, device=s.param.device)
        # A trainable group keeps only its fp32 master shard: the 16-bit values are cast from it at
        # gather time (as FSDP2 does), instead of a second, 16-bit copy of every shard living
        # beside it. Frozen groups have no master and keep their shard in the compute dtype.
        self.master: torch.Tensor | None = shard32.to(self.master_dtype) if trainable else None  # fp32: shard32 itself
        self.param_shard: torch.Tensor | None = None if trainable else shard32.to(compute_dtype)
        del shard32
        # One full-size tensor for the life of the group; "freeing" it resizes its storage to 0
        # bytes. Every view of it — the parameters, and the views autograd saved in forward
        # (a linear layer saves ``weight.t()``) — shares that storage, so a resharded unit really
        # releases its memory, and the next all-gather refills the same storage in place.
        # At world size 1 a frozen group's shard is all of its parameters, already in the compute dtype on
        # the device: the parameters are views of the shard itself, and gathering or releasing the group
        # moves and frees nothing. A gather would copy it into a second buffer of the same size: on one
        # GPU, two layers and the LM head of an 8B LoRA's base weights at once, 1.8 GiB for nothing.
        self.aliased = (self.alias_whole_shard and self.param_shard is not None and self.world_size == 1
                        and self.padded_numel == self.numel)
        self.full = self.param_shard if self.aliased else torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        self._nbytes = self.full.untyped_storage().nbytes()
        for s in self.slots:  # views are made while the storage has its size, then it is emptied
            s.param.data = self.full[s.offset : s.offset + s.numel].view(s.shape)
            s.param.hf_zero_group = self  # lets GatheredParameters find a parameter's shards
        if not self.aliased:
            self.full.untyped_storage().resize_(0)
        self._marked_released = False  # the parameters' class: ShardedParameter while released (hf_zero/zero/released.py)
        self.state = ShardState.SHARDED
        self._event: torch.cuda.Event | None = None

    @property
    def state(self) -> ShardState:
        return self._state

    @state.setter
    def state(self, state: ShardState) -> None:
        # DeepSpeed's ds_status of the parameters follows (hf_zero/zero/param_attrs.py), for code that asks it
        self._state = state
        params = [s.param for s in self.slots]
        set_status(params, DS_STATUS[state])
        released = state is ShardState.SHARDED and not self.aliased  # an aliased group's views are never released
        if released != self._marked_released:  # once per gather and once per release, not at every state
            (mark_released if released else mark_whole)(params)
            self._marked_released = released

    def owned_values(self) -> torch.Tensor:
        """The fp32 master shard, or a frozen group's shard in the compute dtype."""
        values = self.master if self.master is not None else self.param_shard
        assert values is not None
        return values

    # ------------------------------------------------------------ gather

    def gather(self, stream: torch.cuda.Stream | None) -> None:
        """Issue the all-gather of the full parameters (on ``stream`` when on GPU)."""
        if self.state is not ShardState.SHARDED:
            return
        if self.aliased:
            self.state = ShardState.GATHERED
            return
        with C.on_stream(stream):
            self.full.untyped_storage().resize_(self._nbytes)
            # Refilling storage that autograd saved views of is not a modification of their values
            # (they are the same weights): keep the version counter so backward accepts them.
            with torch.autograd._unsafe_preserve_version_counter(self.full), torch.no_grad():
                C.all_gather_(self.full, self._gather_source(), self.group, self.world_size)
            if stream is not None:
                self._event = torch.cuda.Event()
                self._event.record(stream)
        self.state = ShardState.GATHERING

    def gather_for_compute(self, stream: torch.cuda.Stream | None) -> None:
        """The gather of the unit's own forward and backward (the runtime's hooks): the plain gather here; a float8
        group (hf_zero/zero/float8_gather.py) gathers float8 weights instead, which only its linears can read."""
        self.gather(stream)

    def _gather_source(self) -> torch.Tensor:
        """This rank's shard in the compute dtype on the device, as the all-gather reads it (on the current stream)."""
        if self.param_shard is not None:
            return self.param_shard
        assert self.master is not None
        return self.master.to(self.compute_dtype) if self.mixed else self.master

    def wait(self) -> None:
        """Make the gathered parameters usable on the compute stream."""
        if self.state is ShardState.GATHERED:
            return
        if self.state is ShardState.SHARDED:
            self.gather(None)
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None
        self.state = ShardState.GATHERED

    def write_back_from_full(self) -> None:
        """The gathered buffer was edited (and is identical on every rank): refresh shard and master."""
        swap = getattr(self, "nvme_swap", None)  # NVMe offload: the master waits in a file (hf_zero/zero/nvme.py)
        store = getattr(self, "shard_store", None)  # and the 16-bit shard in another
        with swap.group_resident(self, write=True) if swap is not None else contextlib.nullcontext(), torch.no_grad():
            for t in (None if store is not None else self.param_shard, self.master):
                if t is not None:
                    t.copy_(self.full[self.shard_lo : self.shard_hi])
            if store is not None:
                store.put(self, self.full[self.shard_lo : self.shard_hi])

    def reshard(self, leave_views: bool = False) -> None:
        """Release the full parameters' memory; only this rank's shard remains.

        ``leave_views`` (``GatheredParameters``, a user's gather): if tensors other than the parameters view the
        gathered buffer (``p.detach()``, or ``p.cpu()`` on the CPU, taken inside the block), they keep it and the
        group takes a new, empty buffer, as DeepSpeed leaves a released parameter's old data to whoever holds it;
        resizing the storage under them would leave them reading freed memory (a segfault on the CPU: one rank
        dies and the others hang in their next collective). The hooks' reshard never does this: there the other
        views are autograd's saved tensors, which must lose their memory and be refilled by the next gather.
        """
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.GATHERING:
            self.wait()
        if not self.aliased:
            if leave_views and self._viewed_elsewhere():
                self._new_full()
            else:
                self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    def _viewed_elsewhere(self) -> bool:
        """Whether a tensor besides ``full`` and the parameters holds ``full``'s storage."""
        storage = self.full.untyped_storage()  # this handle is one holder too
        return torch._C._storage_Use_Count(storage._cdata) > 2 + len(self.slots)

    def _new_full(self) -> None:
        """Point ``full`` and the parameters at a new buffer, emptied as in ``__init__``; the old one lives on for
        as long as the tensors viewing it do (they hold the only copy of the values besides the shards)."""
        self.full = torch.empty(self.padded_numel, dtype=self.full.dtype, device=self.full.device)
        for s in self.slots:  # views are made while the storage has its size, then it is emptied
            s.param.data = self.full[s.offset : s.offset + s.numel].view(s.shape)
        self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------- grads

    def has_grads(self) -> bool:
        """Whether any parameter holds a gradient not yet reduce-scattered."""
        return self.trainable and any(s.param.grad is not None for s in self.slots)

    def reduce_grads(self, stream: torch.cuda.Stream | None, limit: C.InflightLimit | None = None) -> None:
        """Reduce-scatter this micro-step's gradients and add them to the fp32 gradient shard.

        No flat gradient buffer exists between backward and this call: autograd stores each
        parameter's gradient as it produces it (no copy), and they are cast straight into the
        reduce-scatter's input on the communication stream. Accumulating into a zeroed 16-bit
        flat buffer instead cost a memset and an add over every unit's gradients on the compute
        stream (about 1% of a 7.2B step) and a second pass to cast it.
        """
        grads = [s.param.grad for s in self.slots]
        if not self.trainable or all(g is None for g in grads):
            return
        assert self.master is not None
        if limit is not None:
            limit.before_issue(stream)
        with C.on_stream(stream), torch.no_grad():
            src, held = pack_grads(self.slots, self.padded_numel, self.reduce_dtype, self.device)
            out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            C.reduce_scatter_(out, src, self.group, self.world_size)
            self._sum_over_replicas(out)  # hybrid sharding: the shard only, across the replicate group
            out = out.float().div_(self.place.averaged_over)
            if out.dtype != self.master_dtype:  # bf16 masters take bf16 gradients, averaged in fp32 first
                out = out.to(self.master_dtype)
            prev = self.reduced_grad()
            if prev is None:
                self._set_reduced_grad(out)
            else:
                prev.add_(out)
        # `held`: made on the compute stream, read on `stream`
        if limit is not None:
            limit.after_issue(stream, held)
        elif stream is not None:
            for g in held:
                g.record_stream(stream)
        for slot in self.slots:
            slot.param.grad = None

    def publish_master(self, stream: torch.cuda.Stream | None) -> None:
        """Nothing to publish: the next gather reads (and casts) the updated master shard itself."""

    def zero_grads(self) -> None:
        """Drop the reduced gradient shard (unit gradients were released when reduced)."""
        if self.master is not None:
            self._set_reduced_grad(None)

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        """The shard (in fp32 the master is the parameter itself) and the gathered buffer; unreduced and reduced grads."""
        shard = self.master if self.param_shard is None and not self.mixed else self.param_shard
        grads: list[torch.Tensor | None] = [s.param.grad for s in self.slots]
        grads.append(self.reduced_grad())
        return {"params": [shard, self.full], "grads": grads}
