"""Where a Trainer step's time goes: ``scripts/finetune.py`` with the torch profiler around a few steps.

    torchrun --nproc_per_node 2 benchmarks/profile_trainer.py --zero_config configs/zero2.json --model_name_or_path M

Every argument is finetune.py's. Rank 0 prints the step's wall time beside its GPU kernel time by
kind (bench.py's summary: NCCL, matmuls and attention, optimizer, the rest), then the operators that
took the most GPU and the most host time. ``HF_ZERO_PROFILE_STEPS`` (``10:15``) picks the steps; ``HF_ZERO_PROFILE_TRACE`` names a
Chrome trace file to write as well.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from transformers import TrainerCallback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench.py, beside this file
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))  # the main job, scripts/finetune.py
import finetune  # noqa: E402
from bench import print_profile  # noqa: E402


class ProfileSteps(TrainerCallback):
    """Starts the profiler before step ``first`` and stops it after step ``last``."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if self.prof is None or state.global_step != self.last:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        steps = self.last - self.first
        if state.is_world_process_zero:
            print_profile(self.prof, f"Trainer steps {self.first}-{self.last}", 1e3 * wall / steps, steps)
            # the host side too: a Trainer step's Python (hooks, autograd's per-parameter work) shows here
            print(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
            trace = os.environ.get("HF_ZERO_PROFILE_TRACE")
            if trace:
                self.prof.export_chrome_trace(trace)
        self.prof = None


if __name__ == "__main__":
    first, last = (int(x) for x in os.environ.get("HF_ZERO_PROFILE_STEPS", "10:15").split(":"))
    finetune.main(callbacks=[ProfileSteps(first, last)])
