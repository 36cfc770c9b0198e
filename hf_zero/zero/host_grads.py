"""The offloaded optimizer's gradient copy in host memory, and the pinned host buffers it and the masters live in.

:class:`_HostMaster` is the part every offloaded shard group shares (:class:`hf_zero.zero.offload.OffloadedFlatGroup`,
:class:`hf_zero.zero.offload.OffloadedShardedParamGroup`): the fp32 master moved to host memory, and the reduced
gradient of the backward that ends a step copied after it as soon as it is reduced (its part of the norm kept behind as
scalars, the device shard released), scaled there by the step policy and handed to the host step as the master's
``.grad``; :func:`host_buffer` makes the pinned buffers. Split from :mod:`hf_zero.zero.offload`, which holds the policy,
the host-memory plan and the group classes (and still exports both names).
"""

from __future__ import annotations

import weakref
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
        if self.speculation is not None:  # its speculative step read the gradient about to change
            self.speculation.undo(self)
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
