"""DeepSpeed's module path ``deepspeed.runtime.utils``: holds ``see_memory_usage``, the memory report scripts print around big allocations.

Megatron-DeepSpeed, DeepSpeed-Chat and DeepSpeed's own examples call ``see_memory_usage("after init",
force=True)``; it prints, on rank 0 only, the accelerator's allocated and reserved memory (and their peaks,
which it then resets) and the host's used memory, in DeepSpeed's format. Without ``force`` it prints nothing.
"""

from __future__ import annotations

import gc

import torch.distributed as dist

from hf_zero.accelerator import get_accelerator

__all__ = ["see_memory_usage"]

_GB = 1024**3


def _host_used() -> tuple[float, float] | None:
    """(GB in use, percent) of the host's memory, from psutil or /proc/meminfo; None where neither exists."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return (vm.total - vm.available) / _GB, vm.percent
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        used = info["MemTotal"] - info["MemAvailable"]
        return used / _GB, round(100 * used / info["MemTotal"], 1)
    except (OSError, KeyError, ValueError):
        return None


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and the memory in use (rank 0 only; nothing unless ``force``), then reset the peaks."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # so the host figure counts what is still referenced
    acc = get_accelerator()
    print(message)
    print(f"MA {round(acc.memory_allocated() / _GB, 2)} GB         Max_MA {round(acc.max_memory_allocated() / _GB, 2)} GB"
          f"         CA {round(acc.memory_reserved() / _GB, 2)} GB         Max_CA {round(acc.max_memory_reserved() / _GB)} GB ")
    host = _host_used()
    if host is not None:
        print(f"CPU Virtual Memory:  used = {round(host[0], 2)} GB, percent = {host[1]}%")
    acc.reset_peak_memory_stats()
