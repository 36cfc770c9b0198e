"""FlatGroup: stages 0-2's shard group; the parameters stay whole on every rank.

Every stage from 0 to 2 is a policy over the same object (a :class:`hf_zero.zero.group.ShardGroup`):

- the parameters of the group live as views of one flat buffer in the compute dtype
  (``param_flat``), so one collective moves all of them;
- their gradients accumulate into views of one flat buffer (``grad_flat``), so the reduction
  of a bucket is a single all-reduce (stage 0) or reduce-scatter (stages 1-2);
- the optimizer sees one fp32 tensor per group (``master``): the whole buffer when nothing is
  partitioned, otherwise this rank's shard. In pure fp32 training the master *is* the matching
  slice of ``param_flat`` (no copy), so an optimizer step writes the weights directly.

The buffer is padded to a multiple of the world size so every rank owns an equal shard; the
padding is never viewed by a parameter, so its gradient stays zero and it does not disturb
the gradient norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.group import ParamSlot, Placement, ShardGroup, pack_grads


class FlatGroup(ShardGroup):
    """A bucket of parameters sharing one flat parameter buffer and one flat gradient buffer.

    ``partitioned`` is True for ZeRO stages 1 and above: the optimizer state and the reduced
    gradient cover only ``[shard_lo, shard_hi)``. ``free_grads_after_reduce`` (every partitioned
    stage): the full gradient buffer is allocated when its first gradient arrives and released
    once its shard has been reduced, so between steps a rank holds only its gradient shard. When
    the reduction happens is the engine's choice: stage 1 accumulates full gradients over the
    micro-steps and reduces once at the boundary (least communication), stage 2 reduces every
    micro-step into the shard (least memory), as DeepSpeed's stages do.
    """

    trainable = True
    resident = True

    def __init__(
        self, named_params: list[tuple[str, torch.nn.Parameter]], place: Placement, *, partitioned: bool,
        free_grads_after_reduce: bool,
    ) -> None:
        # A group over a sub-group of one rank (expert parallelism with autoep_size = world) stays "partitioned" in
        # one part: its reduce then writes a fresh shard and accumulates it per micro-step as stage 2 does, where
        # an unpartitioned one would divide its accumulating gradient buffer in place (averaged_over is not 1 there).
        self.partitioned = partitioned and (place.world_size > 1 or place.own_subgroup)
        self.free_grads_after_reduce = free_grads_after_reduce and self.partitioned
        super().__init__(named_params, place, parts=place.world_size if self.partitioned else 1)
        device = place.device
        # Flatten in fp32 first so the fp32 master starts from the user's exact weights,
        # not from their bf16/fp16 rounding.
        fp32_flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for s in self.slots:
                fp32_flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        if self.mixed:
            self.master = fp32_flat[self.shard_lo : self.shard_hi].to(self.master_dtype, copy=True)
            self.param_flat = fp32_flat.to(self.compute_dtype)
        else:  # fp32 (or bf16 masters of bf16 parameters): the optimizer steps the parameters' own shard
            self.param_flat = fp32_flat.to(self.compute_dtype)
            self.master = self.param_flat[self.shard_lo : self.shard_hi]
        del fp32_flat
        for s in self.slots:
            s.param.data = self.param_flat[s.offset : s.offset + s.numel].view(s.shape)
            s.param.hf_zero_flat = self  # lets GatheredParameters refresh the master after an edit
        self.grad_flat: torch.Tensor | None = None
        self._grad_views: dict[int, torch.Tensor] = {}  # id(slot) -> its view of grad_flat, made with the buffer
        self.direct = False  # this backward leaves gradients where autograd puts them (begin_backward)
        self._pending: torch.cuda.Event | Any = None  # a deferred publish's event or work handle (publish_master)

    # ----------------------------------------------------------------- views

    def write_back_param(self, slot: ParamSlot) -> None:
        """A parameter was edited in place (identically on every rank): refresh its fp32 master slice."""
        self.wait()
        if not self.mixed:
            return  # the master is a view of the parameters
        a, b = max(slot.offset, self.shard_lo), min(slot.offset + slot.numel, self.shard_hi)
        if a < b:
            swap = getattr(self, "nvme_swap", None)  # NVMe offload: the master waits in a file (hf_zero/zero/nvme.py)
            with swap.group_resident(self, write=True) if swap is not None else contextlib.nullcontext(), torch.no_grad():
                self.master[a - self.shard_lo : b - self.shard_lo].copy_(self.param_flat[a:b])

    def ensure_grad_buffer(self) -> None:
        """Allocate the flat gradient buffer if needed and make every ``param.grad`` a view of it."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            # Made once per buffer rather than per gradient and per backward: stage 0 keeps its buffer
            # for the whole run, and slicing a view for each parameter each time was per-parameter Python.
            self._grad_views = {id(s): self.grad_flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}
        for s in self.slots:
            view = self._grad_views[id(s)]
            if s.param.grad is None or s.param.grad.data_ptr() != view.data_ptr():
                if s.param.grad is not None:  # the user replaced .grad (e.g. zero_grad(set_to_none))
                    view.copy_(s.param.grad)
                s.param.grad = view

    def begin_backward(self, reduces: bool) -> None:
        """Before a backward. If it reduces and nothing is accumulated yet, gradients stay as autograd makes them.

        That "direct" backward allocates no flat buffer: each gradient is stored by autograd
        without a copy and cast straight into the reduce-scatter's input when the bucket is
        reduced, instead of a zeroed buffer that autograd adds into (a memset and an add over
        every gradient on the compute stream) and a second pass to cast it. Backward passes that
        only accumulate (stage 1 between boundaries, ``no_sync``) keep the flat buffer.
        """
        self.direct = reduces and self.free_grads_after_reduce and self.grad_flat is None
        if not self.free_grads_after_reduce:
            self.ensure_grad_buffer()

    def adopt_grad(self, slot: ParamSlot) -> None:
        """Called after autograd accumulated into ``slot.param.grad``: keep it inside grad_flat."""
        if self.direct:
            return  # reduce_grads reads it where autograd left it
        if self.grad_flat is None:
            self.ensure_grad_buffer()
            return
        g = slot.param.grad
        view = self._grad_views[id(slot)]
        if g is not None and g.data_ptr() != view.data_ptr():
            view.copy_(g)
            slot.param.grad = view

    # ------------------------------------------------------------- reduction

    def reduce_grads(self, stream: torch.cuda.Stream | None) -> None:
        """Average this group's gradients across ranks into ``master.grad`` (issued on ``stream``).

        Under stage 2 the full gradient buffer is released right after the reduce-scatter is
        issued, so at most the buckets still in flight hold full gradients during backward.
        """
        if not self.direct and self.grad_flat is None:  # no parameter of this bucket was used: still take part
            self.ensure_grad_buffer()
        with C.on_stream(stream):
            if self.direct:  # autograd's gradients, cast into the reduce-scatter input on the side stream
                src, held = pack_grads(self.slots, self.padded_numel, self.reduce_dtype, self.device)
            else:
                assert self.grad_flat is not None
                src, held = self.grad_flat, [self.grad_flat]
                if src.dtype != self.reduce_dtype:
                    src = src.to(self.reduce_dtype)
            if not self.partitioned:
                C.all_reduce_(src, self.group, self.world_size)
                out = src
            else:
                out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
                C.reduce_scatter_(out, src, self.group, self.world_size)
            self._sum_over_replicas(out)  # hybrid sharding: the shard only, across the replicate group
            if out.dtype != torch.float32:
                out = out.float()
            out.div_(self.place.averaged_over)
            if out.dtype != self.master_dtype:  # bf16 masters take bf16 gradients, averaged in fp32 first
                out = out.to(self.master_dtype)
            prev = self.reduced_grad()
            if prev is not None and self.free_grads_after_reduce:
                # Stage 2 reduces every micro-step: the shard accumulates the averaged gradients.
                prev.add_(out)
                out = prev
        self._set_reduced_grad(out)
        if self.free_grads_after_reduce:
            # Measured: bounding in-flight buckets (as stage 3 does) cost stage 2 about 4% on the
            # 7.2B shape and saved no peak memory, so stage 2 lets the allocator track the stream.
            if stream is not None:
                for t in held:
                    t.record_stream(stream)
            self.release_grad_buffer()
        self.direct = False

    def release_grad_buffer(self) -> None:
        """Drop the full gradients (the flat buffer and every ``param.grad`` view of it)."""
        for s in self.slots:
            s.param.grad = None
        self.grad_flat = None
        self._grad_views = {}

    def zero_grads(self) -> None:
        """End of step: clear accumulated gradients (free them under stage 2)."""
        self._set_reduced_grad(None)
        if self.free_grads_after_reduce:
            self.release_grad_buffer()
        elif self.grad_flat is not None:
            self.grad_flat.zero_()

    # ------------------------------------------------------------ parameters

    def publish_master(self, stream: torch.cuda.Stream | None, defer: bool = False) -> None:
        """After the optimizer step: write the updated shard into the parameters everywhere.

        ``defer``: leave the all-gather in flight. On CUDA the caller then does not wait for
        ``stream``; the group records an event after its gather instead. On CPU (``stream`` None)
        the gather is started with ``async_op`` and its work handle kept. Either way
        :meth:`wait` is what makes the parameters usable (``hf_zero/zero/overlap.py`` says who
        calls it and when).
        """
        self.wait()  # a gather still in flight from the last publish writes the same buffer
        work = None
        with C.on_stream(stream):
            shard = self.param_flat[self.shard_lo : self.shard_hi]
            self._write_shard(shard)
            if self.partitioned:
                work = C.all_gather_(self.param_flat, shard, self.group, self.world_size,
                                     async_op=defer and stream is None)
        if defer and stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._pending = event
        elif work is not None:
            self._pending = work

    def _write_shard(self, shard: torch.Tensor) -> None:
        """The updated master into this rank's range of the parameters (nothing to do when the master is that range)."""
        if self.mixed:
            shard.copy_(self.master)

    def defer_step(self, through: Callable[[ShardGroup], None]) -> None:
        """The optimizer has not stepped this group yet: the first :meth:`wait` calls ``through(self)``, which steps
        and publishes it (``defer=True``) and every group before it (an offloaded step run where the next forward
        first reads the group: :meth:`hf_zero.zero.host_step.HostStep.through`, the same bound method for every group)."""
        self._pending = through

    @property
    def publish_pending(self) -> bool:
        """A deferred publish is still to be waited for before the parameters are read."""
        return self._pending is not None

    def wait(self) -> None:
        """Make the parameters usable on the current stream after a deferred publish (else a no-op).

        CUDA: the current stream waits for the gather's event (no host sync); CPU: the gather's
        work handle is waited for. A step still to run (:meth:`defer_step`) runs first.
        """
        pending, self._pending = self._pending, None
        if callable(pending):  # the step itself is still to run (defer_step): it leaves its publish's event or handle
            pending(self)
            pending, self._pending = self._pending, None
        if pending is None:
            return
        if isinstance(pending, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(pending)
        else:
            pending.wait()

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        """The flat parameters; the gradient buffer, the reduced shard and autograd's own gradients of a direct backward."""
        grads: list[torch.Tensor | None] = [self.grad_flat, self.reduced_grad()]
        if self.direct:
            grads += [s.param.grad for s in self.slots]
        return {"params": [self.param_flat], "grads": grads}
