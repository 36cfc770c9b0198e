"""Everything DeepSpeed's pipeline grid and topology answer, per rank: the oracle of tests/test_pipe_topology.py.

Under DeepSpeed 0.19.8 (its interpreter, ``DS_ACCELERATOR=cpu``, gloo; ``tests/dsenv.py:run_torchrun`` starts it)::

    python -m torch.distributed.run --nproc-per-node 4 tests/ds_oracle_topology.py OUT_PREFIX

builds ``deepspeed.runtime.pipe.topology.PipelineParallelGrid(topology=...)`` for each case of :data:`CASES` whose
world is the run's, and each rank writes ``OUT_PREFIX.rank<r>.json``: :func:`observe` of the grid. The test runs the
same :func:`observe` on hf_zero's grids (built the same way, and the ones ``initialize`` gives a pipeline) and
compares. Nothing of hf_zero is imported by the oracle side; only torch and DeepSpeed.

DeepSpeed's side is recorded in :data:`FIXTURE` rather than run by the test: importing DeepSpeed on 4 gloo ranks took
88 s of a 2-core machine (the 2-rank run 11 s), and its answers depend on nothing of hf_zero. Regenerate it with::

    python -m tests.ds_oracle_topology --write-fixture

which runs this file under DeepSpeed at 2, 4 and 8 ranks and stores every rank's answers with DeepSpeed's version and
the SHA-256 of this file; the test refuses a fixture whose hash is not this file's (an edit of :func:`observe` needs a
new fixture).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FIXTURE = Path(__file__).with_name("ds_topology_oracle.json")

#: name -> (world size, topology class name, its constructor's keyword arguments)
CASES: dict[str, tuple[int, str, dict[str, int]]] = {
    "pp 2 x dp 2": (4, "PipeDataParallelTopology", {"num_pp": 2, "num_dp": 2}),
    "pp 2 x tp 2": (4, "PipeModelDataParallelTopology", {"num_pp": 2, "num_mp": 2, "num_dp": 1}),
    "pp 2 x dp 1": (2, "PipeDataParallelTopology", {"num_pp": 2, "num_dp": 1}),
    # every group a proper sub-grid: the model-parallel one (pipe x model) is a flattened sub-mesh of two axes apart
    "pp 2 x dp 2 x tp 2": (8, "PipeModelDataParallelTopology", {"num_pp": 2, "num_mp": 2, "num_dp": 2}),
}

#: DeepSpeed's PipelineParallelGrid methods that take no argument and return a value.
PLAIN = ["get_stage_id", "get_data_parallel_id", "get_global_rank", "get_pipe_parallel_rank",
         "get_pipeline_model_parallel_rank", "get_pipe_parallel_world_size", "get_pipeline_model_parallel_world_size",
         "get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group_ranks",
         "get_model_parallel_rank", "get_model_parallel_world_size", "get_slice_parallel_rank",
         "get_tensor_model_parallel_rank", "get_slice_parallel_world_size", "get_tensor_model_parallel_world_size"]
#: ... those that return a process group (compared by member ranks and by an all-reduce over them).
GROUPS = ["get_pipe_parallel_group", "get_data_parallel_group", "get_model_parallel_group", "get_slice_parallel_group"]
#: DeepSpeed's attributes of the grid that scripts and its engine read.
ATTRS = ["global_rank", "world_size", "data_parallel_size", "pipe_parallel_size", "model_parallel_size",
         "slice_parallel_size", "stage_id", "data_parallel_id", "is_first_stage", "is_last_stage", "p2p_groups",
         "dp_group", "dp_groups", "pp_group", "pipe_groups", "slice_group", "ds_model_rank", "ds_model_world_size",
         "mp_group", "model_groups"]
GROUP_ATTRS = ["ds_model_proc_group", "dp_proc_group", "pp_proc_group", "slice_proc_group"]


def _group(g: Any) -> dict:
    """A process group as its member ranks and the sum of ones all-reduced over it (it must work for collectives)."""
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    return {"ranks": dist.get_process_group_ranks(g), "all_reduce": t.item()}


def observe_topology(topo: Any) -> dict:
    """Every answer of a ``ProcessTopology`` (pure arithmetic: the same on every rank)."""
    axes = list(topo.get_axis_names())
    n = topo.world_size()
    coords = [topo.get_coord(rank=r) for r in range(n)]
    out: dict[str, Any] = {
        "type": type(topo).__name__, "axes": axes, "coord_type": type(coords[0]).__name__,
        "coord_fields": list(coords[0]._fields), "str": str(topo), "world_size": n,
        "dims": {a: topo.get_dim(a) for a in [*axes, "absent"]},
        "coords": [list(c) for c in coords],
        "get_rank": [topo.get_rank(**c._asdict()) for c in coords],
        "coord_attrs": [[getattr(c, a) for a in axes] for c in coords],
        "rank_repr": [topo.get_rank_repr(rank=r) for r in range(n)],
        "rank_repr_all": [topo.get_rank_repr(rank=r, omit_axes=[]) for r in range(n)],
        "rank_repr_seps": [topo.get_rank_repr(r, omit_axes=[axes[0]], inner_sep="=", outer_sep="/") for r in range(n)],
        "comm_lists": {a: topo.get_axis_comm_lists(a) for a in [*axes, "absent"]},
        "axis_list": {a: [topo.get_axis_list(axis=a, idx=i) for i in range(topo.get_dim(a))] for a in axes},
        "filter_one": {a: [topo.filter_match(**{a: i}) for i in range(topo.get_dim(a))] for a in axes},
        "filter_two": {f"{a},{b}": [topo.filter_match(**{a: i, b: j}) for i in range(topo.get_dim(a))
                                    for j in range(topo.get_dim(b))]
                       for a in axes for b in axes if a < b},
        "filter_none": topo.filter_match(),
    }
    return out


def observe(grid: Any) -> dict:
    """Every answer of a ``PipelineParallelGrid`` on this rank: methods, groups (as member ranks), attributes,
    ``stage_to_global`` for every stage and other coordinate, and its topology."""
    topo = grid.topology()
    axes = list(topo.get_axis_names())
    out: dict[str, Any] = {m: getattr(grid, m)() for m in PLAIN}
    out.update({m: _group(getattr(grid, m)()) for m in GROUPS})
    out.update({a: getattr(grid, a) for a in ATTRS if hasattr(grid, a)})
    out["absent_attrs"] = [a for a in ATTRS if not hasattr(grid, a)]
    out.update({a: _group(getattr(grid, a)) for a in GROUP_ATTRS})
    stages = range(grid.get_pipe_parallel_world_size())
    out["stage_to_global"] = [grid.stage_to_global(s) for s in stages]
    for a in axes:
        if a != "pipe":
            out[f"stage_to_global_{a}"] = [[grid.stage_to_global(s, **{a: i}) for i in range(topo.get_dim(a))]
                                           for s in stages]
    out["topology"] = observe_topology(topo)
    out["same_topology_object"] = grid.topology() is topo and grid._topo is topo
    return out


def ds_names(grid: Any) -> list[str]:
    """The grid's public names (methods and attributes), to check hf_zero has every one DeepSpeed's has."""
    return sorted(n for n in dir(grid) if not n.startswith("__"))


def main(prefix: str) -> None:
    import deepspeed
    from deepspeed.runtime.pipe import topology as T

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    result: dict[str, Any] = {"version": deepspeed.__version__}
    for name, (size, cls, kwargs) in CASES.items():
        if size == world:
            grid = T.PipelineParallelGrid(topology=getattr(T, cls)(**kwargs))
            result[name] = observe(grid)
            result[name + " names"] = ds_names(grid)
    result["generic"] = observe_topology(T.ProcessTopology(axes=["x", "y", "z"], dims=[2, 3, 2]))
    with open(f"{prefix}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.barrier()


def source_sha() -> str:
    """The hash the fixture records: this file's bytes."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def write_fixture() -> None:
    """Run DeepSpeed at every world size of :data:`CASES` and write :data:`FIXTURE` (see the module docstring)."""
    import tempfile

    from tests import dsenv

    ranks: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({w for w, _, _ in CASES.values()}):
            prefix = f"{tmp}/w{world}"
            dsenv.run_torchrun(Path(__file__), world, prefix)
            ranks[str(world)] = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]
    versions = {r.pop("version") for per_world in ranks.values() for r in per_world}
    fixture = {"made_by": "python -m tests.ds_oracle_topology --write-fixture", "deepspeed": versions.pop(),
               "source_sha256": source_sha(), "ranks": ranks}
    FIXTURE.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1] == "--write-fixture":
        write_fixture()
    else:
        main(sys.argv[1])
