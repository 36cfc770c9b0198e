"""The offloaded optimizer's gradient copy in host memory, and the pinned host buffers it and the masters live in.

:class:`_HostMaster` is the part every offloaded shard group shares (:class:`hf_zero.zero.offload.OffloadedFlatGroup`,
:class:`hf_zero.zero.offload.OffloadedShardedParamGroup`): the fp32 master moved to host memory, and the reduced
gradient of the backward that ends a step copied after it as soon as it is reduced (its part of the norm kept behind as
scalars, the device shard released; in bf16 where that is exact), scaled there by the step policy and handed to the
host step (:meth:`_HostMaster.step_copy`); :func:`host_buffer` makes the pinned buffers. Split from :mod:`hf_zero.zero.offload`, which holds the policy,
the host-memory plan and the group classes (and still exports both names).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.group import ShardGroup


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
    # No gradient copy per group fits in host memory (HostPlan.STREAM_GRADS): the reduced shard stays on the device
    # until the step, which streams it through two shared host buffers (HostStep).
    stream_grads = False
    # super_offload (SpeculativeHostStep, set by the runner): each host copy of the backward that ends the step is
    # handed to it to step at once, and a group reduced again is undone first
    speculation: Any = None
    # The host step reads bf16 gradients (the one-pass kernel, hf_zero/optim/host_adam.py; set by the runner): a reduced
    # shard that is exactly one bf16 gradient (see _copy_after_reduce) then crosses to the host in bf16, half the bytes
    grad16 = False
    _coef16: tuple[float, ...] | None = None  # the step policy's coefficients for a bf16 copy, applied as it is read

    def _move_master_to_host(self, pin: bool, stream_grads: bool) -> None:
        assert self.master is not None
        self.pin = bool(pin) and torch.cuda.is_available()
        self.stream_grads = stream_grads
        on_device = self.master
        self.master = host_buffer(on_device.numel(), torch.float32, pin=self.pin)
        self.master.copy_(on_device)
        self._device_grad: torch.Tensor | None = None
        self._host_grad: torch.Tensor | None = None  # this step's copy: one of the two buffers below, reused every step
        self._host_grads: dict[torch.dtype, torch.Tensor] = {}
        self._in_flight: torch.cuda.Event | bool | None = None  # the copy of this step's gradient to the host
        # After that copy left, the device shard is released; its part of the norm stays behind as scalars.
        self._released: tuple[torch.Tensor, torch.Tensor] | None = None

    # An out-of-place step's destination (super_offload's speculative steps): fp32 host buffers of the master's size
    # the new master and moments are written into, swapped in when the step stands (swap_in_step)
    _step_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _step_out_pages: torch.Tensor | None = None  # the second master buffer's owner (see step_out)

    def step_out(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Three fp32 host tensors shaped like the master that an out-of-place step of it writes into (the master, then
        the two Adam moments); made at the first call, kept for the run (12 bytes per element, as the undo copy of a
        step in place would take). The master's is pinned as the master is: after a swap the master *is* that buffer
        and is copied to the GPU from there. Its owner tensor is kept on the group for as long as the group lives, since
        a pinned buffer's pages are unregistered when the tensor :func:`host_buffer` returned is collected."""
        assert self.master is not None
        if self._step_out is None:
            self._step_out_pages = host_buffer(self.master.numel(), torch.float32, pin=self.pin)
            self._step_out = (self._step_out_pages.view(self.master.shape), torch.empty_like(self.master),
                              torch.empty_like(self.master))
        return self._step_out

    def swap_in_step(self, state: dict[str, Any]) -> None:
        """The out-of-place step into :meth:`step_out` stands: its results become the master and ``state``'s two moments,
        by swapping buffers (the master tensor keeps its identity: it is the optimizer's parameter, only its storage
        changes), and the old buffers become the next step's destination."""
        assert self.master is not None and self._step_out is not None
        master, avg, sq = self._step_out
        with torch.no_grad():
            old = self.master.detach()  # a second tensor on the old storage
            self.master.set_(master)
        self._step_out = (old, state["exp_avg"], state["exp_avg_sq"])
        state["exp_avg"], state["exp_avg_sq"] = avg, sq

    def reduced_grad(self) -> torch.Tensor | None:
        return self._device_grad

    def _set_reduced_grad(self, grad: torch.Tensor | None) -> None:
        self._device_grad = grad
        if grad is None:
            self._in_flight = None
            self._released = None
            self._coef16 = None
            if self.master is not None:
                self.master.grad = None  # the host buffer stays for the next step

    def grad_values(self, writable: bool = False) -> torch.Tensor | None:
        if self._released is not None:
            if writable:
                self._unrelease(None)
                return self._device_grad
            self._wait_for_host_copy()
            assert self._host_grad is not None
            return self.step_grad(self._host_grad)
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
        if self.speculation is not None:  # its speculative step read the gradient about to change
            self.speculation.undo(self)
        self._wait_for_host_copy()
        assert self._host_grad is not None
        with C.on_stream(stream):
            self._device_grad = self.step_grad(self._host_grad).to(self.device, torch.float32, non_blocking=self.pin,
                                                                  copy=True)
        self._released, self._in_flight, self._coef16 = None, None, None

    def _host_grad_buffer(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This group's host buffer of ``dtype`` (made once), which from now on holds this step's copy."""
        assert self.master is not None
        if dtype not in self._host_grads:
            self._host_grads[dtype] = host_buffer(self.master.numel(), dtype, pin=self.pin)
        self._host_grad = self._host_grads[dtype]
        return self._host_grad

    def step_grad(self, grad: torch.Tensor, scratch: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The gradient the host step reads for ``grad``, this group's host copy: itself, or, for a bf16 copy the step
        policy scaled (clipping), its fp32 values times that coefficient, made now: what the fp32 copy scaled in place
        holds, bit for bit (a bf16 value widens to fp32 exactly, and the product is the same fp32 multiply).

        ``scratch(n)``: an fp32 host buffer of at least ``n`` elements to make it in (the host step reuses one for
        every group and step: fresh pages of 4 bytes per element each step cost more than the multiply); else a new
        tensor."""
        if self._coef16 is None or grad.dtype == torch.float32:
            return grad
        out = grad.float() if scratch is None else scratch(grad.numel())[: grad.numel()].view_as(grad).copy_(grad)
        for coef in self._coef16:
            out.mul_(coef)
        return out

    def _reduces_bf16_values(self) -> bool:
        """Whether one reduce of this group leaves only bf16 values in its fp32 shard: bf16 gradients on one rank,
        summed with no other rank's (nor a replica's) and divided by nothing, cast to fp32 or kept in bf16 on the way.
        What each subclass adds to the shard across reduces it says itself (:meth:`_copy_after_reduce`'s ``exact16``)."""
        return (self.world_size == 1 and self.place.replicas == 1 and self.place.averaged_over == 1
                and self.compute_dtype == torch.bfloat16 and self.reduce_dtype in (torch.bfloat16, torch.float32))

    def _copy_after_reduce(self, stream: torch.cuda.Stream | None, exact16: bool = False) -> None:
        """The last backward of the step reduced this group: start its device-to-host copy on the same stream,
        so it runs while backward goes on (pinned memory makes it asynchronous).

        ``exact16`` (the subclass's word): every value of the reduced fp32 shard is a bf16 value (one rank, nothing
        averaged, nothing added in fp32), so with :attr:`grad16` it crosses in bf16: the same values, half the bytes
        over PCIe and through host memory."""
        if not self.copy_after_reduce or self.stream_grads or self._device_grad is None:
            return
        sixteen = exact16 and self.grad16
        host, grad = self._host_grad_buffer(torch.bfloat16 if sixteen else torch.float32), self._device_grad
        self._coef16 = None
        with C.on_stream(stream):
            host.copy_(grad.to(torch.bfloat16) if sixteen else grad, non_blocking=self.pin)
            self._in_flight = torch.cuda.Event() if stream is not None else True
            if stream is not None:
                self._in_flight.record(stream)
            # The shard's part of the global norm, then the shard itself goes (it was made on this stream, so
            # its memory is reused only after the copy): GPU memory holds only the gradients still in flight.
            self._released = (torch.linalg.vector_norm(grad, dtype=torch.float32).square(), (~torch.isfinite(grad)).any().float())
            self._device_grad = None
        if self.speculation is not None:
            in_flight = self._in_flight
            self.speculation.submit(self, host, in_flight if isinstance(in_flight, torch.cuda.Event) else None)

    def _wait_for_host_copy(self) -> None:
        if isinstance(self._in_flight, torch.cuda.Event):
            self._in_flight.synchronize()
        self._in_flight = True

    def scale_host_copy(self, coef: torch.Tensor | float) -> None:
        if self._in_flight is None:
            return
        self._wait_for_host_copy()
        assert self._host_grad is not None
        if self._host_grad.dtype == torch.float32:
            self._host_grad.mul_(float(coef))
        else:  # a bf16 copy keeps its values; the host step reads them scaled in fp32 (step_grad)
            self._coef16 = (*(self._coef16 or ()), float(coef))

    def sum_grad_over(self, process_group: object) -> None:
        self._unrelease(None)
        super().sum_grad_over(process_group)  # type: ignore[arg-type]
        self._in_flight = None  # the device shard changed after its copy left: copy again before the step

    def before_step(self) -> None:
        """The reduced gradient shard as the host master's ``.grad`` (None when there is none this step)."""
        assert self.master is not None
        self._step_copy = None
        if self.stream_grads or (self._device_grad is None and self._released is None):
            self.master.grad = None  # streamed: the step hands each group its gradient in a shared buffer
            return
        if self._in_flight is not None:
            self._wait_for_host_copy()
        else:
            self._coef16 = None
            self._host_grad_buffer().copy_(self._device_grad)  # blocking: the host optimizer reads it next
        assert self._host_grad is not None
        # torch hangs no bf16 .grad on an fp32 tensor: the host runners take every copy from step_copy()
        self.master.grad = self._host_grad if self._host_grad.dtype == self.master.dtype else None
        self._step_copy = self._host_grad

    _step_copy: torch.Tensor | None = None

    def step_copy(self) -> torch.Tensor | None:
        """The host copy :meth:`before_step` found for this step (fp32, or bf16 under :attr:`grad16`), once: None after."""
        copy, self._step_copy = self._step_copy, None
        return copy
