"""DeepSpeed's ``wall_clock_breakdown``: where the wall time of a training step goes.

With ``"wall_clock_breakdown": true`` the engine times its forward, backward and optimizer step
and, with the optimizer offloaded, the three parts of that step that the offload overlaps or
serialises: waiting for the last gradient copies to reach the host, the CPU optimizer, and the
copy of the updated weights back to the device with its all-gather. Each span synchronises the
device at both ends (as DeepSpeed's timers do), so the figures are what each part costs the step
as a whole, and the switch slows training a little: it is for profiling, off by default.
Rank 0 logs the means every ``steps_per_print`` optimizer steps; ``engine.timers.means()`` returns
them to a script (``benchmarks/bench.py`` prints them beside tokens/s).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

#: The spans in the order they are reported, with what each covers.
SPANS = {
    "forward": "the module's forward",
    "backward": "backward, with the gradient reductions it overlaps",
    "step": "the optimizer step on an accumulation boundary: norm, clipping, update, publishing the weights",
    "step.wait_grads": "offload: waiting for the gradient shards' copies to the host",
    "step.cpu_optimizer": "offload: the optimizer on the host masters (with overlap_param_gather most of it runs in "
                          "the next forward and is counted when its last group is stepped)",
    "step.cpu_optimizer_overlapped": "super_offload: the optimizer on the host masters taken during backward, on a "
                                     "background thread (hidden behind backward as far as the cores allow)",
    "step.to_device": "offload: copying the updated weights back (and, at stages 1-2, the all-gather) not hidden "
                      "behind the CPU optimizer",
    "step.nvme_wait": "NVMe offload: waiting for the masters' and optimizer state's reads (and for free buffers) "
                      "not hidden behind the CPU optimizer",
}


class StepTimers:
    """Wall-clock spans by name; a no-op unless ``enabled``."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self._total: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._notes: dict[str, str] = {}

    def note(self, name: str, text: str) -> None:
        """A fixed remark printed after a span's figure (the offloaded step's thread count)."""
        self._notes[name] = text

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def span(self, name: str) -> contextlib.AbstractContextManager:
        """Time the block under ``name`` (device synchronised before and after); a bare null context when disabled,
        since the engine opens three of these every step."""
        return self._timed(name) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._total[name] = self._total.get(name, 0.0) + time.perf_counter() - start
            self._count[name] = self._count.get(name, 0) + 1

    def add(self, name: str, seconds: float) -> None:
        """Add a span measured elsewhere (the parts of a step that are timed piece by piece)."""
        if self.enabled:
            self._total[name] = self._total.get(name, 0.0) + seconds
            self._count[name] = self._count.get(name, 0) + 1

    def means(self, reset: bool = False) -> dict[str, float]:
        """Mean milliseconds per occurrence of each span since the last reset, in :data:`SPANS` order.

        The offload parts are summed per step before averaging, so they add up to (most of) ``step``.
        """
        out = {name: 1000.0 * self._total[name] / self._count[name] for name in SPANS if self._count.get(name)}
        if reset:
            self._total.clear()
            self._count.clear()
        return out

    def line(self, reset: bool = True) -> str:
        """One log line: ``forward 12.3 ms | backward 25.1 ms | step 40.2 ms (wait_grads 1.0, ...)``."""
        means = self.means(reset=reset)
        parts = [f"{name} {ms:.1f} ms" for name, ms in means.items() if "." not in name]
        sub = [f"{name.split('.', 1)[1]} {ms:.1f}" + (f" on {self._notes[name]}" if name in self._notes else "")
               for name, ms in means.items() if "." in name]
        return " | ".join(parts) + (f" ({', '.join(sub)} ms)" if sub else "")
