"""DeepSpeed's pipeline grid and topology API on hf_zero's grid, answer for answer equal to DeepSpeed 0.19.8's.

A DeepSpeed pipeline script asks ``engine.grid`` (``PipelineModule._grid``, ``mpu()``) for its place and groups, and
``PipelineModule.topology()`` for the rank layout. For pp 2 x dp 2 and pp 2 x tp 2 on 4 gloo ranks, pp 2 x dp 1 on 2
and pp 2 x dp 2 x tp 2 on 8, every method's answer on every rank (a group: its member ranks, and an all-reduce over it) must equal DeepSpeed's
``PipelineParallelGrid(topology=...)``'s: hf_zero's grid built the same way (``hf_zero.runtime.pipe.topology``), the
grid ``initialize`` gives a pipeline (a ``PipelineModule`` of linear layers; at tp 2 a Llama cut by
``split_causal_lm``; at pp 2 x dp 2 also with the replicas as hybrid sharding's ``dp_replicate`` axis), and a
``PipelineModule(topology=...)``'s. DeepSpeed's answers are the fixture
``tests/ds_topology_oracle.json``, written by ``python -m tests.ds_oracle_topology --write-fixture`` (running DeepSpeed
on 4 ranks here took 88 s); :mod:`tests.ds_oracle_topology` holds the one ``observe`` both sides run.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import ds_oracle_topology as oracle
from tests.distributed import spawn

MICRO = 2


def _fixture() -> dict:
    fixture = json.loads(oracle.FIXTURE.read_text(encoding="utf-8"))
    assert fixture["deepspeed"] == "0.19.8"
    assert fixture["source_sha256"] == oracle.source_sha(), (
        "tests/ds_oracle_topology.py changed since its fixture was written; run "
        "python -m tests.ds_oracle_topology --write-fixture")
    return fixture


def _pipeline_engine(name: str, hybrid: bool = False):  # noqa: ANN202 - a PipelineEngine
    """The engine ``initialize`` builds for a case's layout, as a DeepSpeed pipeline script builds it; ``hybrid``:
    the stage's two replicas as hybrid sharding's ``dp_replicate`` axis (``mics_shard_size`` 1), still DeepSpeed's
    ``data`` axis."""
    import hf_zero as deepspeed
    from hf_zero.pipe import LayerSpec, PipelineModule, split_causal_lm
    from tests.models import tiny_causal_lm

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if hybrid:
        cfg["zero_optimization"] = {"stage": 1, "mics_shard_size": 1}
    if "tp 2" in name:
        cfg["tensor_parallel"] = {"autotp_size": 2}
        model = split_causal_lm(tiny_causal_lm("llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=32), 2)
    else:
        model = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 6, 6) for _ in range(4)], num_stages=2,
                               loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def _refusals(world: int) -> dict:
    """What a wrong topology or axis gets: one sentence, on every rank, before any collective."""
    from hf_zero.pipe import LayerSpec, PipelineModule
    from hf_zero.runtime.pipe import topology as T

    layers = [LayerSpec(torch.nn.Linear, 2, 2) for _ in range(4)]
    tries = {
        "model axis": lambda: PipelineModule(layers, topology=T.PipeModelDataParallelTopology(world // 2, 2, 1)),
        "wrong size": lambda: PipelineModule(layers, topology=T.PipeDataParallelTopology(num_pp=2, num_dp=world)),
        "axis order": lambda: T.PipelineParallelGrid(topology=T.ProcessTopology(["data", "pipe"], [world // 2, 2])),
        "num_stages": lambda: PipelineModule(layers, num_stages=1, topology=T.PipeDataParallelTopology(2, world // 2)),
        "get_rank slice": lambda: T.ProcessTopology(["a", "b"], [2, 2]).get_rank(a=1),
        "filter axis": lambda: T.ProcessTopology(["a", "b"], [2, 2]).filter_match(c=0),
    }
    out = {}
    for what, call in tries.items():
        try:
            call()
            out[what] = None
        except ValueError as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def _hf_zero_side(rank: int, world: int) -> dict:
    import hf_zero as deepspeed
    from hf_zero.pipe import LayerSpec, PipelineModule
    from hf_zero.runtime.pipe import topology as T

    WORLD = torch.distributed.group.WORLD  # noqa: N806 - torch's name
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict = {"generic": oracle.observe_topology(T.ProcessTopology(axes=["x", "y", "z"], dims=[2, 3, 2]))}
    for name, (size, cls, kwargs) in oracle.CASES.items():
        if size != world:
            continue
        grid = T.PipelineParallelGrid(topology=getattr(T, cls)(**kwargs))
        out[f"{name} direct"] = oracle.observe(grid)
        out[f"{name} names"] = oracle.ds_names(grid)
        if world == 8:
            continue  # the grid alone: tests/test_grid_parity.py trains this layout
        engine = _pipeline_engine(name)
        module = engine.module
        out[f"{name} engine"] = oracle.observe(engine.grid)
        out[f"{name} one grid"] = [module._grid is engine.grid, module.mpu() is engine.grid, engine.mpu is engine.grid,
                                   module.topology() is engine.grid.topology(), module._topo is engine.grid.topology(),
                                   isinstance(engine.grid, T.PipelineParallelGrid),
                                   # the groups are the grid's own: the engine reduces over the data-parallel one
                                   engine.grid.get_data_parallel_group() is (engine.grid.zero_group or WORLD),
                                   engine.grid.get_pipe_parallel_group() is (engine.grid.group("pp") or WORLD)]
        if "tp 2" not in name:
            g = torch.Generator().manual_seed(3)
            batches = [(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 6, generator=g)) for _ in range(4)]
            dp = engine.grid.get_data_parallel_rank()
            out[f"{name} loss"] = float(engine.train_batch(iter(batches[2 * dp:2 * dp + 2])))
            topo = T.PipeDataParallelTopology(**kwargs)
            module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 6, 6) for _ in range(4)], topology=topo,
                                    loss_fn=torch.nn.MSELoss())
            out[f"{name} module topology"] = oracle.observe(module._grid)
            out[f"{name} module topology is"] = module.topology() is topo
        if name == "pp 2 x dp 2":
            engine = _pipeline_engine(name, hybrid=True)
            assert engine.grid.shape.dp_replicate == 2 and engine.grid.shape.dp_shard == 1, engine.grid
            out[f"{name} hybrid engine"] = oracle.observe(engine.grid)
    out["refusals"] = _refusals(world)
    return out


@pytest.fixture(scope="module")
def ds() -> dict:
    return _fixture()["ranks"]


def _compare(ds_ranks: list, ours: list, world: int) -> None:
    for rank in range(world):
        theirs, mine = ds_ranks[rank], ours[rank]
        assert mine["generic"] == theirs["generic"]
        for name, (size, _, _) in oracle.CASES.items():
            if size != world:
                continue
            public = {n for n in theirs[f"{name} names"] if not n.startswith("_")} | {"_topo"}
            assert public <= set(mine[f"{name} names"]), f"{name}: missing {sorted(public - set(mine[f'{name} names']))}"
            hows = ["direct"] + ([] if world == 8 else ["engine"]) + ([] if "tp 2" in name else ["module topology"])
            hows += ["hybrid engine"] if name == "pp 2 x dp 2" else []
            for how in hows:
                for key, value in theirs[name].items():
                    assert mine[f"{name} {how}"][key] == value, f"rank {rank}, {name} ({how}): {key}"
                assert mine[f"{name} {how}"].keys() == theirs[name].keys()
            assert world == 8 or all(mine[f"{name} one grid"]), mine.get(f"{name} one grid")
            assert mine.get(f"{name} module topology is", True)


def _check_refusals(ours: list, world: int) -> None:
    first = ours[0]["refusals"]
    assert all(r["refusals"] == first for r in ours), "the refusals differ between ranks"
    assert "model axis of 2 (layers you slice yourself) is not supported yet" in first["model axis"]
    assert f"holds {2 * world} ranks" in first["wrong size"] and f"the run has {world}" in first["wrong size"]
    assert "axes ['data', 'pipe'] numbers ranks in a way hf_zero's grid does not" in first["axis order"]
    assert "num_stages=1) disagrees with its topology's pipe axis of 2" in first["num_stages"]
    assert "needs exactly the axes ['a', 'b']" in first["get_rank slice"]
    assert "no axis 'c'" in first["filter axis"]


def test_grid_and_topology_equal_deepspeed_on_four_ranks(ds: dict) -> None:
    ours = spawn(_hf_zero_side, 4)
    _compare(ds["4"], ours, 4)
    _check_refusals(ours, 4)
    # the grid's groups carried the pipeline's traffic: both pipelines trained, each on its own samples
    losses = [r["pp 2 x dp 2 loss"] for r in ours]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] == losses[2] and losses[1] == losses[3]


def test_grid_and_topology_equal_deepspeed_on_two_ranks(ds: dict) -> None:
    ours = spawn(_hf_zero_side, 2)
    _compare(ds["2"], ours, 2)
    _check_refusals(ours, 2)


def test_grid_and_topology_equal_deepspeed_on_eight_ranks(ds: dict) -> None:
    """pp 2 x dp 2 x tp 2: no group spans the world, and DeepSpeed's model-parallel group (pipe x model) is two axes
    apart in the grid (a flattened sub-mesh)."""
    ours = spawn(_hf_zero_side, 8)
    _compare(ds["8"], ours, 8)
    _check_refusals(ours, 8)
