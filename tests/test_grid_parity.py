"""Every layout of the parallel grid trains to one process's numbers: the parity matrix over (pp, dp, replicate, tp, sp).

nanotron tests its ``(tp, dp, pp)`` grids this way; here each layout is a config (``mics_shard_size`` for hybrid
sharding, ``tensor_parallel.autotp_size``, ``sequence_parallel_size``) over the same transformers Llama and Qwen2,
trained 3 steps with clipping and accumulation on ragged, prompt-masked batches, against plain torch AdamW in one
process on the concatenated batch (fp32; losses and weights within 1e-5 relative). A pipeline is the model split as
users split it (``split_causal_lm``) and trained with ``train_batch``, each stage's weights compared under the model's
names. The ranks of a tensor- or sequence-parallel group share each sample (sequence parallelism shards its tokens);
the data-parallel rank (``dp_replicate x dp_shard``) picks the sample, all read from the engine's grid. World 4 runs
the two-axis layouts at each ZeRO stage they compose with (a pipeline takes ZeRO 0-2; "pp 2 x hybrid 1 x 2" is hybrid
sharding's degenerate form there, shard groups of one rank replicated twice, and world 8 runs its 2 x 2 form), and a
tp 2 x pp 2 resume checkpoint resumed at tp 2 x pp 2 and tp 2 x dp 2 and consolidated; world 8 the three-axis
layouts (tp 2 x sp 2 x dp 2, tp 2 x pp 2 x dp 2). What the grid refuses (a pipeline with ZeRO-3 or sequence
parallelism, hybrid sharding with tp or sp) is refused in one sentence, tested beside the parser
(tests/test_planner.py, tests/test_hybrid_shard.py, tests/test_pipe.py, tests/test_sequence_parallel_dist.py).
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
    ("tp 2 x pp 2", {"tensor_parallel": {"autotp_size": 2}, "pp": 2}, ((1, "llama"), (2, "qwen2")), 2),
    ("pp 2 x hybrid 1 x 2", {"pp": 2, "mics_shard_size": 1}, ((1, "qwen2"), (2, "llama")), 2),
]
LAYOUTS_8 = [
    ("tp 2 x sp 2 x dp 2", {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}, ((3, "qwen2"),), 1),
    ("tp 2 x pp 2 x dp 2", {"tensor_parallel": {"autotp_size": 2}, "pp": 2}, ((2, "llama"),), 2),
    ("pp 2 x hybrid 2 x 2", {"pp": 2, "mics_shard_size": 2}, ((2, "qwen2"),), 2),
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
    from hf_zero.parallel.tp_split import split_of
    from hf_zero.pipe import split_causal_lm
    from hf_zero.sequence import shard_batch

    zero = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 64}
    if "mics_shard_size" in extra:
        zero["mics_shard_size"] = extra["mics_shard_size"]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
           "zero_optimization": zero, "steps_per_print": 1000,
           **{k: v for k, v in extra.items() if k not in ("mics_shard_size", "pp")}}
    pp = extra.get("pp", 1)  # a pipeline: the model split as users split it, trained with train_batch
    model = split_causal_lm(_model(kind), pp) if pp > 1 else _model(kind)
    engine = hf_zero.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, eps=EPS))[0]
    grid = engine.grid
    dp, dp_rank, sp, sp_rank = grid.size(*DATA_AXES), grid.rank(*DATA_AXES), grid.size("sp"), grid.rank("sp")
    data = _data(MICRO * gas * dp)
    losses = []
    for t in range(STEPS):
        if pp > 1:  # the mean loss over the data-parallel ranks, on every stage
            losses.append(float(engine.train_batch(iter([_take(data, t, (dp_rank * gas + k) * MICRO, MICRO)
                                                          for k in range(gas)]))))
            continue
        total = torch.zeros(())
        for k in range(gas):
            batch = _take(data, t, (dp_rank * gas + k) * MICRO, MICRO)
            loss = engine(**(shard_batch(batch, sp_rank, sp) if sp > 1 else batch)).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        dist.all_reduce(total)  # the ranks of a tp or sp group hold the same loss: the mean over the world
        losses.append(total.item() / dist.get_world_size())
    weights = _whole(engine)  # a pipeline stage's own layers, under the model's names
    held: list = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(weights))
    sizes = {a: grid.size(a) for a in ("pp", "dp_replicate", "dp_shard", "sp", "tp")}
    split = sum(split_of(p) is not None for p in engine.module.parameters())  # the slices this rank holds
    engine.destroy()
    batches = [[_take(data, t, k * MICRO, MICRO) for k in range(gas * dp)] for t in range(STEPS)]
    ref_losses, ref_w = train_one_process(_model(kind), batches, lr=LR, eps=EPS, clip=CLIP)
    return {"loss_err": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            "w_err": max(float((w - ref_w[n]).norm() / ref_w[n].norm()) for n, w in weights.items()), "sizes": sizes,
            "missing": sorted(set(ref_w) - {n for names in held for n in names}), "split": split}


def _matrix(rank: int, world: int, layouts: list, folder: str | None = None) -> dict:
    out = {f"{name}, ZeRO-{stage}, {kind}": _run(kind, extra, stage, gas) for name, extra, cases, gas in layouts
           for stage, kind in cases}
    if folder is not None:
        out["checkpoint"] = _checkpoints(rank, folder)
    return out


def _engine(tp: int, pp: int, gas: int, zero: int):  # noqa: ANN202 - a ZeroEngine or PipelineEngine
    import hf_zero
    from hf_zero.pipe import split_causal_lm

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": zero, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 64},
           "steps_per_print": 1000,
           "tensor_parallel": {"autotp_size": tp}}
    model = split_causal_lm(_model("llama"), pp) if pp > 1 else _model("llama")
    return hf_zero.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, eps=EPS))[0]


def _step(engine, data: dict, t: int, gas: int) -> float:  # noqa: ANN001
    """One step on the first ``gas x dp`` micro-batches of batch ``t``: the mean loss over the world."""
    import torch.distributed as dist

    from hf_zero.parallel import DATA_AXES

    dp_rank = engine.grid.rank(*DATA_AXES)
    batches = [_take(data, t, (dp_rank * gas + k) * MICRO, MICRO) for k in range(gas)]
    if engine.grid.size("pp") > 1:
        return float(engine.train_batch(iter(batches)))
    total = torch.zeros(())
    for batch in batches:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach() / gas
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _all_weights(engine) -> dict:  # noqa: ANN001
    """Every whole weight of the model, whichever stage holds it, on every rank."""
    import torch.distributed as dist

    held: list = [None] * dist.get_world_size()
    dist.all_gather_object(held, _whole(engine))
    return {n: w for part in held for n, w in part.items()}


# (tp, pp, gradient accumulation, ZeRO stage) of a layout at world 4; the layouts of one checkpoint share their
# global batch
CHECKPOINTS = {
    "tp 2 x pp 2": ((2, 2, 2, 1), {"tp 2 x pp 2": (2, 2, 2, 1), "tp 2 x dp 2": (2, 1, 1, 2), "pp 2 x dp 2": (1, 2, 1, 1)}),
    "tp 2 x dp 2": ((2, 1, 2, 3), {"dp 4": (1, 1, 1, 2)}),
    "dp 4": ((1, 1, 1, 1), {"tp 2 x dp 2": (2, 1, 2, 3)}),
}


def _checkpoints(rank: int, folder: str) -> dict:
    """Each layout of :data:`CHECKPOINTS` saves a resume checkpoint after a step; the next step resumed at each of its
    layouts (the same one; another tensor-parallel degree, with or without a pipeline, at another ZeRO stage: tp 2 x
    ZeRO-3 dp 2 to and from dp 4) equals the uninterrupted one;
    save_pretrained and offline consolidation (hf-zero consolidate) write whole weights that from_pretrained loads."""
    data = _data(4 * MICRO)
    out: dict = {}
    for saved, ((tp, pp, gas, zero), resumed) in CHECKPOINTS.items():
        where = f"{folder}/{saved.replace(' ', '')}"
        engine = _engine(tp, pp, gas, zero)
        _step(engine, data, 0, gas)
        engine.save_checkpoint(f"{where}/resume")
        at_save = _all_weights(engine)
        loss = _step(engine, data, 1, gas)
        engine.save_pretrained(f"{where}/whole")
        want = _all_weights(engine)
        engine.destroy()
        for name, (tp2, pp2, gas2, zero2) in resumed.items():
            again = _engine(tp2, pp2, gas2, zero2)
            again.load_checkpoint(f"{where}/resume")
            got_loss = _step(again, data, 1, gas2)
            got = _all_weights(again)
            again.destroy()
            out[f"{saved} -> {name}"] = {
                "loss_err": abs(got_loss - loss) / loss, "names": sorted(got) == sorted(want),
                "w_err": max(float((got[n] - w).norm() / w.norm()) for n, w in want.items() if n in got)}
        if rank == 0:
            from transformers import AutoModelForCausalLM

            from hf_zero.checkpoint.consolidated import consolidate

            consolidate(f"{where}/resume", f"{where}/offline", progress=False)  # hf-zero consolidate
            for what, folder_of, weights in (("save_pretrained", "whole", want), ("consolidate", "offline", at_save)):
                loaded = dict(AutoModelForCausalLM.from_pretrained(f"{where}/{folder_of}").named_parameters())
                out[f"{saved} {what}"] = {
                    "names": sorted(loaded) == sorted(weights),
                    "w_err": max(float((loaded[n] - w).norm() / w.norm()) for n, w in weights.items())}
    return out


def _check(results: dict, layouts: list) -> None:
    expected = {f"{name}, ZeRO-{stage}, {kind}" for name, _, cases, _ in layouts for stage, kind in cases}
    results = dict(results)
    checkpoint = results.pop("checkpoint", None)
    for case, r in (checkpoint or {}).items():  # the same layout and the fp32 weights bit for bit, another layout 1e-6
        same = case.endswith(("save_pretrained", "consolidate")) or case.split(" -> ")[0] == case.split(" -> ")[-1]
        tol = 0.0 if same else 1e-6
        assert r["names"] and r["w_err"] <= tol and r.get("loss_err", 0.0) <= tol, (case, r)
    assert set(results) == expected
    for case, r in results.items():
        assert r["loss_err"] < 1e-5 and r["w_err"] < 1e-5, (case, r)
        name = case.split(",")[0]
        want = {"tp": 2 if "tp 2" in name else 1, "sp": 2 if "sp 2" in name else 1, "pp": 2 if "pp 2" in name else 1,
                "dp_replicate": 2 if "hybrid" in name else 1}
        assert all(r["sizes"][a] == v for a, v in want.items()), (case, r["sizes"])
        assert not r["missing"], (case, r["missing"])  # every weight compared, on some stage
        assert (r["split"] >= 7) == (want["tp"] > 1), (case, r["split"])  # a block's 7 linear layers at least


def test_two_axis_layouts_on_four_ranks_equal_one_process(tmp_path) -> None:  # noqa: ANN001
    per_rank = spawn(_matrix, 4, LAYOUTS_4, str(tmp_path))
    resumed = {f"{saved} -> {name}" for saved, (_, layouts) in CHECKPOINTS.items() for name in layouts}
    assert set(per_rank[0]["checkpoint"]) == resumed | {f"{saved} {how}" for saved in CHECKPOINTS
                                                         for how in ("save_pretrained", "consolidate")}
    for results in per_rank:
        assert resumed <= set(results["checkpoint"])
        _check(results, LAYOUTS_4)


def test_three_axis_layout_on_eight_ranks_equals_one_process() -> None:
    per_rank = spawn(_matrix, 8, LAYOUTS_8)
    for results in per_rank:
        _check(results, LAYOUTS_8)
