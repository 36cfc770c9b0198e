"""What sharding a model costs in memory while ``initialize`` cuts it (stage 3): at most the model plus its largest
unit once, because each unit's own parameter storage is released before its gather buffer is made.

Measured with torch's profiler (every allocation and free of the CPU allocator, the model built inside the profile so
that its parameters' release is seen). Before the release moved, the peak was the model plus the largest unit twice
over; on the GPU that was 8B's 1 GiB embedding shard and 1 GiB gather buffer at once, the 1.9 GiB by which the 8B
offload row's peak exceeded FSDP2's (BENCHMARKS.md, session 16)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import hf_zero


class _Model(torch.nn.Module):
    """An embedding much larger than anything else: the largest unit, and the whole of the cost to look for."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20000, 256)  # 19.5 MiB in fp32
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(2))
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).pow(2).mean()


def _peak_while_initializing(config: dict) -> tuple[int, int, int]:
    """(peak bytes held while the model is built and initialize runs, the model's bytes, its largest unit's bytes)."""
    hf_zero.init_distributed()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = _Model()
        engine = hf_zero.initialize(model=model, config=config)[0]
    held = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    sizes = [sum(p.numel() * 4 for p in m.parameters()) for m in (_Model().emb, *_Model().blocks, _Model().head)]
    engine.destroy()
    return peak, sum(sizes), max(sizes)


def test_stage3_initialize_holds_at_most_one_unit_beyond_the_model() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    peak, model, largest = _peak_while_initializing(cfg)
    # the largest unit's fp32 shard is made while its parameters still exist; its gather buffer only after they go
    assert peak - model <= largest + 2**20, (peak / 2**20, model / 2**20, largest / 2**20)
    assert peak - model >= largest * 0.9, "the profile saw none of the shard being made: it measures nothing"
