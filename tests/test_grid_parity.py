"""Every layout of the parallel grid trains to one process's numbers: the parity matrix over (dp, replicate, tp, sp).

nanotron tests its ``(tp, dp, pp)`` grids this way; here each layout is a config (``mics_shard_size`` for hybrid
sharding, ``tensor_parallel.autotp_size``, ``sequence_parallel_size``) over the same transformers Llama and Qwen2,
trained 3 steps with clipping and accumulation on ragged, prompt-masked batches, against plain torch AdamW in one
process on the concatenated batch (fp32; losses and weights within 1e-5 relative). The ranks of a tensor- or
sequence-parallel group share each sample (sequence parallelism shards its tokens); the data-parallel rank
(``dp_replicate x dp_shard``) picks the sample, all read from the engine's grid. World 4 runs the two-axis layouts at
each ZeRO stage they compose with; world 8 the three-axis one (tp 2 x sp 2 x dp 2). What the grid refuses (a
pipeline with tensor parallelism, hybrid sharding with tp or sp) is refused in one sentence, tested beside the
parser (tests/test_planner.py, tests/test_hybrid_shard.py).
"""

from __future__ import annotations

import torch

from tests.distributed import spawn
from tests.models import tiny_causal_lm, train_one_process

STEPS, MICRO, SEQ, VOCAB, LR, EPS = 3, 2, 24, 96, 1e-2, 1e-4
CLIP = 0.5

# (name, config keys, (ZeRO stage, model) cases, gradient accumulation); each layout meets both models
LAYOUTS_4 = [
    ("dp 4", {}, ((1, "qwen2"), (3, "llama")), 2),
    ("hybrid 2 x 2", {"mics_shard_size": 2}, ((1, "llama"), (2, "qwen2"), (3, "llama"), (3, "qwen2")), 1),
    ("tp 2 x dp 2", {"tensor_parallel": {"autotp_size": 2}}, ((2, "llama"), (3, "qwen2")), 2),
    ("sp 2 x dp 2", {"sequence_parallel_size": 2}, ((3, "llama"), (3, "qwen2")), 1),
    ("tp 2 x sp 2", {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}, ((2, "qwen2"), (3, "llama")), 1),
]
LAYOUTS_8 = [
    ("tp 2 x sp 2 x dp 2", {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}, ((3, "qwen2"),), 1),
]


def _model(kind: str) -> torch.nn.Module:
    # 8 heads over 4 key/value heads: 2 attention heads per rank even at tp 2 x sp 2
    return tiny_causal_lm(kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


def _data(samples: int) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (STEPS, samples, SEQ), generator=g)
    labels, mask = ids.clone(), torch.ones_like(ids)
    for s in range(samples):
        prompt, length = 3 + 5 * s % 13, SEQ - (3 * s) % 7
        labels[:, s, :prompt] = -100
        labels[:, s, length:] = -100
        mask[:, s, length:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _take(data: dict, t: int, lo: int, n: int) -> dict:
    return {k: v[t, lo : lo + n] for k, v in data.items()}


def _whole(engine) -> dict:  # noqa: ANN001
    from hf_zero.checkpoint.consolidated import OneUnitAtATime

    units = OneUnitAtATime(engine.train_state())
    with torch.no_grad():
        return {n: units.full(p).detach().clone() for n, p in engine.module.named_parameters()}


def _run(kind: str, extra: dict, stage: int, gas: int) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.parallel import DATA_AXES
    from hf_zero.sequence import shard_batch

    zero = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 64}
    if "mics_shard_size" in extra:
        zero["mics_shard_size"] = extra["mics_shard_size"]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
           "zero_optimization": zero, "steps_per_print": 1000, **{k: v for k, v in extra.items() if k != "mics_shard_size"}}
    engine = hf_zero.initialize(model=_model(kind), config=cfg,
                                optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, eps=EPS))[0]
    grid = engine.grid
    dp, dp_rank, sp, sp_rank = grid.size(*DATA_AXES), grid.rank(*DATA_AXES), grid.size("sp"), grid.rank("sp")
    data = _data(MICRO * gas * dp)
    losses = []
    for t in range(STEPS):
        total = torch.zeros(())
        for k in range(gas):
            batch = _take(data, t, (dp_rank * gas + k) * MICRO, MICRO)
            loss = engine(**(shard_batch(batch, sp_rank, sp) if sp > 1 else batch)).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        dist.all_reduce(total)  # the ranks of a tp or sp group hold the same loss: the mean over the world
        losses.append(total.item() / dist.get_world_size())
    weights = _whole(engine)
    sizes = {a: grid.size(a) for a in ("dp_replicate", "dp_shard", "sp", "tp")}
    engine.destroy()
    batches = [[_take(data, t, k * MICRO, MICRO) for k in range(gas * dp)] for t in range(STEPS)]
    ref_losses, ref_w = train_one_process(_model(kind), batches, lr=LR, eps=EPS, clip=CLIP)
    return {"loss_err": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            "w_err": max(float((weights[n] - w).norm() / w.norm()) for n, w in ref_w.items()), "sizes": sizes}


def _matrix(rank: int, world: int, layouts: list) -> dict:
    return {f"{name}, ZeRO-{stage}, {kind}": _run(kind, extra, stage, gas) for name, extra, cases, gas in layouts
            for stage, kind in cases}


def _check(results: dict, layouts: list) -> None:
    expected = {f"{name}, ZeRO-{stage}, {kind}" for name, _, cases, _ in layouts for stage, kind in cases}
    assert set(results) == expected
    for case, r in results.items():
        assert r["loss_err"] < 1e-5 and r["w_err"] < 1e-5, (case, r)
        name = case.split(",")[0]
        want = {"tp": 2 if "tp 2" in name else 1, "sp": 2 if "sp 2" in name else 1,
                "dp_replicate": 2 if "hybrid" in name else 1}
        assert all(r["sizes"][a] == v for a, v in want.items()), (case, r["sizes"])


def test_two_axis_layouts_on_four_ranks_equal_one_process() -> None:
    per_rank = spawn(_matrix, 4, LAYOUTS_4)
    for results in per_rank:
        _check(results, LAYOUTS_4)


def test_three_axis_layout_on_eight_ranks_equals_one_process() -> None:
    per_rank = spawn(_matrix, 8, LAYOUTS_8)
    for results in per_rank:
        _check(results, LAYOUTS_8)
