"""``hf-zero plan`` counts the bytes the engine's collectives really move, and the memory its shards really hold.

One spawn of 4 gloo ranks runs hf_zero's engine on a transformers Llama (built from a config) for two steps per
case: ZeRO 0, 1, 2 and 3 over all 4 ranks, stage 2 and 3 with two micro-steps per step, and tensor parallelism 2
x ZeRO-1 and x ZeRO-3 over 2; a spawn of 8 runs flat ZeRO-3, hybrid sharding 2 x 4 at stages 2 and 3, and tp 2 x
ZeRO-3 over 4. Inside the ranks every torch.distributed collective the engine calls is wrapped and recorded
(operation, group, phase of the step, numel x element size); the second step is compared with what
:func:`hf_zero.planning.planner.plan` says for the same model, layout and step:

- the parameter and gradient collectives (all-gathers, reduce-scatters, stage 0's all-reduce): planned <= counted
  <= planned + calls x (group - 1) x element size. Each flat buffer is padded to a multiple of the group size so
  that every rank owns an equal shard, at most group - 1 elements per buffer, which the planner leaves out;
- tensor-parallel all-reduces and the gradient-norm all-reduce: exactly equal, calls included;
- no collective the planner does not name, and none it names that did not happen;
- weights, gradients and optimizer state: the engine's ``memory_bytes()`` within the same padding (up to 5
  tensors per buffer, as tests/test_memory.py counts it).

The planner's refusals are checked against the config parser's, and its parameter count of the Llama-3 presets
against the counts Meta publishes. Padding aside, nothing here has a tolerance: the numbers are counts.
"""

from __future__ import annotations

import pytest

from tests.distributed import spawn

WORLD = 4
SEQ, MICRO = 8, 2
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, "tie_word_embeddings": False}
THRESHOLD = 40  # stage3_param_persistence_threshold: the 32-element norms stay whole, every matrix is sharded
# (name, zero stage, micro-steps per step, tensor-parallel degree, hybrid shard size or 0 for flat)
CASES = [("zero0", 0, 1, 1, 0), ("zero1", 1, 1, 1, 0), ("zero2", 2, 1, 1, 0), ("zero3", 3, 1, 1, 0),
         ("zero2 accum 2", 2, 2, 1, 0), ("zero3 accum 2", 3, 2, 1, 0), ("tp2 x zero1", 1, 1, 2, 0),
         ("tp2 x zero3", 3, 1, 2, 0)]
# world 8: flat ZeRO-3 over 8, hybrid sharding (2 replicas of shard groups of 4) at stages 2 and 3, tp 2 x ZeRO-3 dp 4
WORLD8 = 8
CASES8 = [("zero3", 3, 1, 1, 0), ("hybrid 2x4 zero3", 3, 1, 1, 4), ("hybrid 2x4 zero2 accum 2", 2, 2, 1, 4),
          ("tp2 x zero3", 3, 1, 2, 0)]


def _count(rank: int, world: int, cases: list) -> list:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.zero import collectives as C

    log: list[dict] = []
    phase = ["init"]

    def wrap(op: str, fn, tensor_of):  # noqa: ANN001, ANN202
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t = tensor_of(args, kwargs)
            group = kwargs.get("group")
            log.append({"phase": phase[0], "op": op, "ranks": dist.get_process_group_ranks(group or dist.group.WORLD),
                        "bytes": t.numel() * t.element_size(), "itemsize": t.element_size(), "numel": t.numel()})
            return fn(*args, **kwargs)
        return counted

    # hf_zero/zero/collectives.py binds torch's all-gather and reduce-scatter at import: wrap its names, and torch's
    C._all_gather = wrap("all_gather", C._all_gather, lambda a, k: a[0])  # the gathered output
    C._reduce_scatter = wrap("reduce_scatter", C._reduce_scatter, lambda a, k: a[1])  # the input
    for name in ("all_reduce", "broadcast"):
        setattr(dist, name, wrap(name, getattr(dist, name), lambda a, k: a[0]))
    dist.all_to_all_single = wrap("all_to_all", dist.all_to_all_single, lambda a, k: a[1])
    dist.all_gather_into_tensor = wrap("all_gather", dist.all_gather_into_tensor, lambda a, k: a[0])
    dist.reduce_scatter_tensor = wrap("reduce_scatter", dist.reduce_scatter_tensor, lambda a, k: a[1])

    out = []
    for name, stage, accum, tp, shard in cases:
        torch.manual_seed(0)
        values = dict(LLAMA)
        model = LlamaForCausalLM(AutoConfig.for_model(values.pop("model_type"), **values))
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": THRESHOLD}}
        if tp > 1:
            config["tensor_parallel"] = {"autotp_size": tp}
        if shard:
            config["zero_optimization"]["mics_shard_size"] = shard
        engine, _, _, _ = hf_zero.initialize(model=model, config=config)
        g = torch.Generator().manual_seed(rank // tp)  # the ranks of a tensor-parallel group share their batches
        for _ in range(2):  # the second step is counted: the first has its one-off checks
            log.clear()
            for _micro in range(accum):
                ids = torch.randint(0, LLAMA["vocab_size"], (MICRO, SEQ), generator=g)
                phase[0] = "forward"
                loss = engine(input_ids=ids, labels=ids).loss
                phase[0] = "backward"
                engine.backward(loss)
                phase[0] = "step"
                held = engine.memory_bytes()  # at the optimizer step, as hf_zero/planning/estimate.py counts
                engine.step()
        zo = engine.zero_optimizer
        out.append({"name": name, "log": list(log), "held": held,
                    "buffers": len(zo.flat_groups) + len(zo.stage3_groups)})
    return out


def _kind(entry: dict, rank: int, tp: int, hybrid: bool) -> str:
    """The planner's name for a counted collective."""
    op, phase = entry["op"], entry["phase"]
    if op == "reduce_scatter":
        return "grad reduce-scatter"
    if op == "all_gather":
        return {"forward": "param all-gather (forward)", "backward": "param all-gather (backward)",
                "step": "param all-gather (after step)"}[phase]
    if op == "all_reduce":
        if entry["numel"] <= 3:
            return "grad-norm all-reduce"
        first = rank - rank % tp
        if tp > 1 and entry["ranks"] == list(range(first, first + tp)):
            return f"tp all-reduce ({phase})"
        return "grad all-reduce across replicas" if hybrid else "grad all-reduce"
    return f"unexpected {op}"


@pytest.fixture(scope="module")
def counted() -> list:
    return spawn(_count, WORLD, [list(c) for c in CASES])


@pytest.fixture(scope="module")
def counted8() -> list:
    return spawn(_count, WORLD8, [list(c) for c in CASES8])


def _facts():  # noqa: ANN202
    from transformers import AutoConfig

    from hf_zero.planning import planner

    values = dict(LLAMA)
    return planner.model_facts(AutoConfig.for_model(values.pop("model_type"), **values), "tiny llama")


def _check_counts(counted: list, world: int, cases: list) -> None:
    from hf_zero.parallel import GridShape
    from hf_zero.planning import planner

    facts = _facts()
    machines = planner.Machines(nodes=1, gpus_per_node=world)
    for rank, per_rank in enumerate(counted):
        for (name, stage, accum, tp, shard), case in zip(cases, per_rank):
            assert case["name"] == name
            shape = GridShape.fill(world, tp=tp, dp_replicate=world // tp // shard if shard else 1)
            training = planner.Training(micro_batch=MICRO, seq=SEQ, zero_stage=stage, grad_accum=accum, dtype="bf16",
                                        optimizer="adamw", recompute="none", persistence_threshold=THRESHOLD)
            p = planner.plan(facts, shape, machines, training)
            planned = {t.kind: t for t in p.traffic}
            got: dict[str, list[dict]] = {}
            for entry in case["log"]:
                got.setdefault(_kind(entry, rank, tp, shape.dp_replicate > 1), []).append(entry)
            assert set(got) == set(planned), (name, sorted(got), sorted(planned))
            for kind, entries in got.items():
                want = planned[kind]
                total = sum(e["bytes"] for e in entries)
                if kind.startswith(("tp ", "grad-norm")):
                    assert (total, len(entries)) == (want.payload, want.calls), (name, kind, total, len(entries), want)
                    continue
                group = len(entries[0]["ranks"])
                assert (group, len(entries)) == (want.group, want.calls), (name, kind, group, len(entries), want)
                slack = sum((group - 1) * e["itemsize"] for e in entries)
                assert want.payload <= total <= want.payload + slack, (name, kind, total, want.payload, slack)
            # the shards the engine holds are the planner's weights, gradients and optimizer state (padding aside)
            held, mem = case["held"], p.memory
            slack = case["buffers"] * (shape.size("dp_shard") - 1) * 4 * 5
            for key, want_bytes in (("params", mem.weights), ("grads", mem.grads), ("optim", mem.optim)):
                assert abs(held[key] - want_bytes) <= slack, (name, key, held[key], want_bytes, mem.formula)


def test_planned_bytes_equal_counted_collectives(counted: list) -> None:
    _check_counts(counted, WORLD, CASES)


def test_planned_bytes_equal_counted_collectives_at_world_8(counted8: list) -> None:
    """Flat and hybrid sharding and tp x ZeRO-3 at 8 ranks: the hybrid replicas' all-reduce is counted too."""
    _check_counts(counted8, WORLD8, CASES8)


def test_zero3_counts_are_the_units_the_engine_gathers(counted: list) -> None:
    """The stage-3 split the planner takes from the engine's units: every matrix gathered in forward, the blocks
    again in backward (the input embedding, a lookup, is not; the root with the LM head stays gathered)."""
    facts = _facts()
    blocks = sum(p.numel for p in facts.params if p.role == "block" and p.numel >= THRESHOLD)
    big = sum(p.numel for p in facts.params if p.numel >= THRESHOLD)
    case = next(c for c in counted[0] if c["name"] == "zero3")
    fwd = sum(e["numel"] for e in case["log"] if e["op"] == "all_gather" and e["phase"] == "forward")
    bwd = sum(e["numel"] for e in case["log"] if e["op"] == "all_gather" and e["phase"] == "backward")
    assert big <= fwd < big + 4 * WORLD and blocks <= bwd < blocks + 4 * WORLD, (fwd, big, bwd, blocks)
    assert blocks < big  # the embedding and the head are outside the blocks


def test_refusals_match_the_config_parser() -> None:
    from hf_zero.config import ZeroConfig
    from hf_zero.errors import ConfigError
    from hf_zero.parallel import GridShape
    from hf_zero.planning.planner import refusal

    base = {"train_micro_batch_size_per_gpu": 1}
    cases = [  # (config, shape, stage)
        ({"tensor_parallel": {"autotp_size": 2}}, GridShape(tp=2, dp_shard=2), 3),
        ({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}, GridShape(tp=2, sp=2), 1),
        ({"tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}}, GridShape(tp=2, pp=2), 1),
        ({"tensor_parallel": {"autotp_size": 2}}, GridShape(tp=2, dp_shard=2), 1),
        ({"sequence_parallel_size": 2}, GridShape(sp=2, dp_shard=2), 3),
        ({}, GridShape(dp_shard=4), 3),
    ]
    for extra, shape, stage in cases:
        cfg = {**base, **extra, "zero_optimization": {"stage": stage}}
        why = refusal(shape, stage)
        try:
            ZeroConfig.load(cfg)
            parsed = True
        except ConfigError:
            parsed = False
        assert parsed == (why is None), (cfg, why)


def test_presets_count_metas_published_parameters() -> None:
    from hf_zero.planning import planner

    for name, count in (("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496)):
        config, _ = planner.load_config(name)
        assert planner.model_facts(config, name).numel == count, name


def test_ring_split_inside_and_across_nodes() -> None:
    """2 nodes x 4 GPUs: flat ZeRO-3 sends 1/4 of its wire bytes across nodes (4 rings, one NIC each); hybrid
    sharding 4 x 2 keeps its gathers inside a node and sends its replica all-reduce wholly across."""
    from hf_zero.parallel import GridShape
    from hf_zero.planning import planner

    facts = _facts()
    machines = planner.Machines(nodes=2, gpus_per_node=4)
    training = planner.Training(micro_batch=MICRO, seq=SEQ, zero_stage=3, recompute="none", persistence_threshold=THRESHOLD)
    flat = {t.kind: t for t in planner.plan(facts, GridShape(dp_shard=8), machines, training).traffic}
    gather = flat["param all-gather (forward)"]
    assert gather.nodes == 2 and gather.inter == pytest.approx(gather.payload * 7 / 8 / 4)
    assert gather.intra == pytest.approx(gather.payload * 7 / 8 * 3 / 4)
    hybrid = {t.kind: t for t in planner.plan(facts, GridShape(dp_replicate=2, dp_shard=4), machines, training).traffic}
    assert hybrid["param all-gather (forward)"].inter == 0 and hybrid["grad reduce-scatter"].inter == 0
    replicas = hybrid["grad all-reduce across replicas"]
    assert replicas.intra == 0 and replicas.inter == pytest.approx(replicas.payload * 2 * 1 / 2)


def test_cli_plan_prints_a_layout_and_a_ranking(capsys: pytest.CaptureFixture) -> None:
    from hf_zero.launch.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--gpus-per-node", "2", "--dp-shard", "2", "--zero-stage", "3"]) == 0
    text = capsys.readouterr().out
    assert "8,030,261,248 trainable parameters" in text and "param all-gather (backward)" in text and "fits" in text
    assert main(["plan", "--model", "llama-3-8b", "--gpus-per-node", "2"]) == 0
    text = capsys.readouterr().out
    assert "dp_shard 2, ZeRO-3" in text and "runnable" in text
    assert main(["plan", "--model", "llama-3-8b", "--gpus-per-node", "2", "--tp", "3"]) == 2
    assert "tensor_parallel.autotp_size 3 does not divide" in capsys.readouterr().err
