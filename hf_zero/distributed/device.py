"""The device calls DeepSpeed scripts make, behind ``deepspeed.accelerator.get_accelerator()`` (:mod:`hf_zero.accelerator`).

DeepSpeed's examples write ``get_accelerator().device_name(local_rank)``,
``get_accelerator().communication_backend_name()`` or ``get_accelerator().synchronize()`` instead
of ``torch.cuda`` so the same script runs on other hardware. hf_zero runs on CUDA GPUs and, for
tests and small jobs, on CPU; this module answers those calls for whichever of the two the process
uses. A call of DeepSpeed's accelerator interface that is not here raises an AttributeError saying so.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import torch

__all__ = ["get_accelerator"]


def _numa_nodes() -> int:
    """NUMA nodes with cores, from ``numactl --hardware`` as DeepSpeed reads them; 1 without numactl."""
    try:
        out = subprocess.run(["numactl", "--hardware"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    cores = [line.split(":", 1)[1].split() for line in out.splitlines()
             if line.startswith("node ") and " cpus:" in line]
    count, prev = 0, None
    for c in cores:  # DeepSpeed skips nodes without cores (HBM in flat mode) and repeats of the previous list
        if c and c != prev:
            count, prev = count + 1, c
    return max(count, 1)


class DeviceAccelerator:
    """CUDA when it is available, else the CPU, behind DeepSpeed's accelerator method names.

    DeepSpeed's own class is abstract (``DeepSpeedAccelerator``) with one subclass per backend;
    hf_zero has two devices and one class. It is not Accelerate's ``Accelerator`` (that is
    :class:`hf_zero.integrations.accelerate.Accelerator`): this one only answers device calls.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cuda = name == "cuda"

    # ----------------------------------------------------------- device
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` or ``"cuda:<i>"`` (``"cpu"`` on the CPU), as torch device strings."""
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """GPUs; on the CPU, as DeepSpeed's CPU accelerator counts: ``LOCAL_SIZE`` when set (DeepSpeed's launcher and
        test harness set it to the processes per node), else the NUMA nodes ``numactl --hardware`` lists, else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        try:
            local = int(os.environ.get("LOCAL_SIZE", 0))
        except ValueError:
            local = 0
        return local if local > 0 else _numa_nodes()

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        """True where kernels run in program order (the CPU): DeepSpeed skips stream waits there."""
        return not self._cuda

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    # ----------------------------------------------------------- dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    # ----------------------------------------------------------- random
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if not self._cuda:
            return torch.get_rng_state()
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if not self._cuda:
            torch.set_rng_state(new_state)
        elif device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    # ----------------------------------------------------------- memory
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if not self._cuda:
            import os

            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        if not self._cuda:
            import os

            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return torch.cuda.mem_get_info(device_index)[0]

    # ----------------------------------------------------------- streams and tensors
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> Any:
        import contextlib

        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"get_accelerator().{name} (of DeepSpeed's accelerator interface) is not supported by hf_zero yet; "
            f"use torch.{'cuda' if self._cuda else 'backends.cpu'} directly"
        )

    def __repr__(self) -> str:
        return f"hf_zero accelerator({self._name})"


_ACCELERATOR: DeviceAccelerator | None = None


def get_accelerator() -> DeviceAccelerator:
    """The process's accelerator: CUDA when a GPU is visible, else the CPU (decided once, as DeepSpeed does)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = DeviceAccelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _ACCELERATOR
