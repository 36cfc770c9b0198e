"""DeepSpeed's pipeline topology API (``deepspeed.runtime.pipe.topology``) answered from hf_zero's one grid.

DeepSpeed's ``PipelineEngine.grid`` and ``PipelineModule._grid`` are a ``PipelineParallelGrid``: the "mpu" object
Megatron-style code passes around and asks for its place (``get_data_parallel_rank()``, ``get_stage_id()``,
``get_model_parallel_group()``, ...), and ``PipelineModule.topology()`` is a ``ProcessTopology`` that maps named
coordinates to global ranks. hf_zero's grid is :class:`~hf_zero.parallel.grid.ParallelGrid` on ``DeviceMesh``; this
module gives it DeepSpeed's vocabulary without a second set of process groups.

The two grids name the same ranks. DeepSpeed's topologies are row-major over ``pipe, data[, model]``; hf_zero's grid
is row-major over ``pp, dp_replicate, dp_shard, sp, tp``. Under a pipeline ``sp`` is 1, so DeepSpeed's axes are:

- ``pipe`` = hf_zero's ``pp`` (the pipeline stage);
- ``data`` = ``dp_replicate x dp_shard`` (:data:`~hf_zero.parallel.grid.DATA_AXES`: the replicas of a stage; hybrid
  sharding's two axes read as one, ``dp_replicate`` outer, which is the order the grid numbers them in);
- ``model`` = ``tp`` (tensor slicing), present only when tensor parallelism is on
  (:class:`PipeModelDataParallelTopology`), as DeepSpeed's ``PipelineModule(num_stages=...)`` builds a
  :class:`PipeDataParallelTopology` otherwise.

DeepSpeed's own terms, kept because its callers depend on them: its **model-parallel** group is every rank holding a
part of one whole model (``pipe x model``: the ranks with this rank's ``data`` coordinate), the group it detects
overflow over; its **slice-parallel** (``get_tensor_model_parallel_*``) group is the ``model`` axis alone; its
``p2p_groups`` are pairs of rank lists, each rank with the next stage's rank of its pipeline (the last wrapping round
to the first), not process groups.

Every group is one of the grid's (:meth:`ParallelGrid.group`), made on every rank when the view is made (some are
collective to make), so a method called on some ranks only never waits for the others. A sub-grid spanning every rank
is the default group (``torch.distributed.group.WORLD``), where hf_zero's grid says ``None``: DeepSpeed hands back a
group object, and scripts pass it to collectives or to ``get_process_group_ranks``.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from hf_zero.errors import PipelineError
from hf_zero.parallel.grid import DATA_AXES, GridShape, ParallelGrid, device_type_of_default_group, grid_for

#: DeepSpeed's axis names and the hf_zero axes each stands for, in the order both grids number ranks.
DS_AXES: dict[str, tuple[str, ...]] = {"pipe": ("pp",), "data": DATA_AXES, "model": ("tp",)}


class ProcessTopology:
    """Named coordinates <-> global ranks, row-major over ``axes`` (the last axis fastest), as DeepSpeed's.

    ``ProcessTopology(axes=["x", "y"], dims=[2, 3])``: rank 1 is ``x=0, y=1``. Coordinates come back as
    ``ProcessCoord`` namedtuples with the axes as fields. Pure arithmetic: no process group is involved, so a
    topology can be built before ``init_distributed`` and passed to ``PipelineModule(topology=...)``.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise PipelineError(f"ProcessTopology(axes={axes}, dims={dims}) needs one dim per axis; give as many of each")
        if len(set(axes)) != len(axes) or not all(isinstance(a, str) and a.isidentifier() for a in axes):
            raise PipelineError(f"ProcessTopology(axes={axes}): the axes must be distinct names (identifiers)")
        for a, d in zip(axes, dims):
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise PipelineError(f"ProcessTopology: axis {a!r} has dim {d!r}; a dim must be an integer >= 1")
        self.axes = axes  # DeepSpeed's attribute names: callers read them
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # noqa: PYI024 - DeepSpeed's coordinate type, by name
        # Every coordinate with its rank, in rank order: DeepSpeed's ``mapping``, which its __str__ prints.
        self.mapping: dict[Any, int] = {self.ProcessCoord(*c): r
                                        for r, c in enumerate(itertools.product(*(range(d) for d in dims)))}

    def _check_axis(self, axis: str, what: str) -> None:
        if axis not in self.axes:
            raise PipelineError(f"{what}: this topology has no axis {axis!r}; its axes are {self.axes}")

    def get_rank(self, **coord: int) -> int:
        """The global rank at ``coord``, every axis given (``get_rank(pipe=1, data=0)``; for a slice, ``filter_match``)."""
        if set(coord) != set(self.axes):
            raise PipelineError(f"get_rank({', '.join(f'{k}={v}' for k, v in coord.items())}) needs exactly the "
                                f"axes {self.axes}; for the ranks matching some axes use filter_match()")
        rank = 0
        for a, d in zip(self.axes, self.dims):
            c = coord[a]
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < d:
                raise PipelineError(f"get_rank: {a}={c!r} is outside the axis (0 to {d - 1})")
            rank = rank * d + c
        return rank

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Iterable[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``rank``'s coordinates as text for file names (``model_01``), the omitted axes left out, as DeepSpeed's
        checkpoints name per-rank files."""
        omitted = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omitted)

    def get_dim(self, axis: str) -> int:
        """How many ranks lie along ``axis``; 0 for an axis the topology does not have (DeepSpeed's answer, which its
        callers turn into 1 with ``max``)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """``rank``'s coordinates, a ``ProcessCoord`` namedtuple (``get_coord(rank=1).data``)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size():
            raise PipelineError(f"rank {rank!r} not found in topology (it has ranks 0 to {self.world_size() - 1})")
        at = []
        for d in reversed(self.dims):
            rank, c = divmod(rank, d)
            at.append(c)
        return self.ProcessCoord(*reversed(at))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of the groups along ``axis``: one per coordinate of the other axes (row-major over them),
        each holding the ranks that differ only on ``axis``; ``[]`` for an axis the topology does not have."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for at in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, at))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks, ascending, whose coordinates equal those given (``filter_match(pipe=0, data=1)``)."""
        for a in filter_kwargs:
            self._check_axis(a, "filter_match")
        return [r for c, r in self.mapping.items() if all(getattr(c, a) == v for a, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks, ascending, whose coordinate on ``axis`` is ``idx``."""
        self._check_axis(axis, "get_axis_list")
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return math.prod(self.dims)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ``pipe, data``, a stage's replicas on neighbouring ranks."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor-slicing) parallelism: axes ``pipe, data, model``, the slices of a layer on
    neighbouring ranks. Note the argument order (``num_pp, num_mp, num_dp``) differs from the axes', as DeepSpeed's."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def shape_of_topology(topology: ProcessTopology, world: int) -> GridShape:
    """The hf_zero grid shape that numbers ranks as ``topology`` does; one sentence for a topology it cannot be
    (other axis names, another order, or a size other than the world's)."""
    if not isinstance(topology, ProcessTopology):
        raise PipelineError(f"topology must be a ProcessTopology (PipeDataParallelTopology or "
                            f"PipeModelDataParallelTopology), got {type(topology).__name__}")
    axes = topology.get_axis_names()
    if axes not in (["pipe", "data"], ["pipe", "data", "model"]):
        raise PipelineError(
            f"a ProcessTopology with axes {axes} numbers ranks in a way hf_zero's grid does not; give axes "
            "['pipe', 'data'] (PipeDataParallelTopology) or ['pipe', 'data', 'model'] (PipeModelDataParallelTopology)")
    if topology.world_size() != world:
        raise PipelineError(f"the topology holds {topology.world_size()} ranks ({topology.get_dim('pipe')} pipe x "
                            f"{topology.get_dim('data')} data{' x ' + str(topology.get_dim('model')) + ' model' if 'model' in axes else ''})"
                            f" but the run has {world}; launch that many processes or change its dims")
    return GridShape(pp=topology.get_dim("pipe"), dp_shard=topology.get_dim("data"), tp=max(topology.get_dim("model"), 1))


def topology_of(grid: ParallelGrid) -> ProcessTopology:
    """DeepSpeed's topology of hf_zero's ``grid``: ``pipe, data`` (``pipe, data, model`` with tensor parallelism)."""
    pp, dp, tp = grid.size("pp"), grid.size(*DATA_AXES), grid.size("tp")
    if tp > 1:
        return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


def _split_world(world: int) -> tuple[int, int]:
    """DeepSpeed's default layout when no topology is given: the world's prime factors, smallest first, dealt in turn
    to the pipe and the data axes (4 ranks: 2 x 2; 8: 4 x 2; 2: 2 x 1)."""
    primes, rest, p = [], world, 2
    while rest > 1:
        while rest % p == 0:
            primes.append(p)
            rest //= p
        p += 1
    return math.prod(primes[0::2]), math.prod(primes[1::2])


class PipelineParallelGrid(ParallelGrid):
    """hf_zero's grid with DeepSpeed's ``PipelineParallelGrid`` API: the same object the engine computes with (a
    :class:`ParallelGrid`: same axes, mesh and groups), so ``engine.grid`` answers both vocabularies.

    Made by the pipeline (:meth:`over`, the one grid of the run), or as DeepSpeed's scripts make it,
    ``PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=2))``: then the grid of that layout is
    fetched (:func:`~hf_zero.parallel.grid.grid_for`, the groups made once per process). Every process must make it,
    in the same order, as DeepSpeed's.

    Like DeepSpeed 0.19.8's it has ``get_tensor_model_parallel_rank/world_size`` but no
    ``get_tensor_model_parallel_group``: code written against DeepSpeed's grid probes for that method with ``hasattr``
    (DeepSpeed's ``utils/bwc.py`` then takes ``get_slice_parallel_group()``, the same ranks), and takes the branch it
    takes under DeepSpeed only if the method is missing here too.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        """``topology``: the layout (None: DeepSpeed's default split of the world's prime factors between ``pipe`` and
        ``data``); ``process_group``: the world's group or None (DeepSpeed ignores it; another group is refused)."""
        if not dist.is_initialized():
            raise PipelineError("PipelineParallelGrid needs torch.distributed initialized; call "
                                "deepspeed.init_distributed() first")
        world = dist.get_world_size()
        if process_group is not None and dist.get_world_size(process_group) != world:
            raise PipelineError("PipelineParallelGrid(process_group=...) must span every rank (the grid covers the "
                                "world); leave it out")
        if topology is None:
            pp, dp = _split_world(world)
            topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        grid = grid_for(shape_of_topology(topology, world), device_type_of_default_group())
        self._view(grid, topology)

    @classmethod
    def over(cls, grid: ParallelGrid, topology: ProcessTopology | None = None) -> PipelineParallelGrid:
        """The view of ``grid`` (a :class:`PipelineParallelGrid` is returned as it is); ``topology``: the one the
        user gave ``PipelineModule``, which ``topology()`` then returns (by default :func:`topology_of` the grid).
        Collective: call it on every rank."""
        if isinstance(grid, PipelineParallelGrid) and topology in (None, grid._topo):
            return grid
        view = cls.__new__(cls)
        view._view(grid, topology)
        return view

    def _view(self, grid: ParallelGrid, topology: ProcessTopology | None) -> None:
        """Share ``grid``'s state (its shape, coordinates, mesh and group cache: the same dict, so a group made by
        either is the other's) and make DeepSpeed's attributes from it."""
        if grid.size("sp") > 1:
            raise PipelineError(f"the grid {grid.shape.describe()} has a sequence-parallel axis, which DeepSpeed's "
                                "PipelineParallelGrid has no name for; a pipeline runs without sequence parallelism")
        self.__dict__.update(grid.__dict__)
        topo = topology if topology is not None else topology_of(grid)
        if shape_of_topology(topo, grid.size()) != GridShape(pp=grid.size("pp"), dp_shard=grid.size(*DATA_AXES),
                                                             tp=grid.size("tp")):
            raise PipelineError(f"the topology {topo.get_axis_names()} {topo.dims} does not match the run's grid "
                                f"{grid.shape.describe()}")
        self._topo = topo
        # DeepSpeed's attributes, read directly by its engine and by scripts
        self.world_size = grid.size()
        self.pipe_parallel_size, self.data_parallel_size = grid.size("pp"), grid.size(*DATA_AXES)
        self.model_parallel_size = self.slice_parallel_size = grid.size("tp")
        self.stage_id, self.data_parallel_id = grid.pipe_stage, grid.dp_rank
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # The groups, made here on every rank in one order (a flattened sub-mesh is made collectively).
        model_axes = ("pp", "tp")  # DeepSpeed's "model parallel": every rank of one whole model
        self.ds_model_proc_group = self._group_object(*model_axes)
        self.ds_model_world_size, self.ds_model_rank = grid.size(*model_axes), grid.rank(*model_axes)
        self.dp_groups = topo.get_axis_comm_lists("data")
        self.dp_group = list(grid.ranks(*DATA_AXES))
        self.dp_proc_group = self._group_object(*DATA_AXES)
        self.pipe_groups = topo.get_axis_comm_lists("pipe")
        self.pp_group = list(grid.ranks("pp"))
        self.pp_proc_group = self._group_object("pp")
        self.p2p_groups = self._build_p2p_groups()
        self.slice_group = list(grid.ranks("tp"))
        self.slice_proc_group = self._group_object("tp")
        if self.model_parallel_size > 1:
            self.mp_group: list[int] = []
            self.model_groups = topo.get_axis_comm_lists("model")

    def _group_object(self, *axes: str) -> dist.ProcessGroup:
        """The grid's group of ``axes`` as a group object: the default group where the grid says None (every rank)."""
        group = self.group(*axes)
        return group if group is not None else dist.group.WORLD

    def _build_p2p_groups(self) -> list[list[int]]:
        """For every rank in order, ``[rank, the next stage's rank in its pipeline]`` (the last stage's next is the
        first), DeepSpeed's list of point-to-point pairs. The pipeline's sends use the engine's own pairs."""
        pairs = []
        for rank in range(self.world_size):
            c = self._topo.get_coord(rank)
            pairs.append([rank, self._topo.get_rank(**{**c._asdict(), "pipe": (c.pipe + 1) % self.pipe_parallel_size})])
        return pairs

    # ------------------------------------------------------------------ DeepSpeed's methods

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank at pipeline stage ``stage_id`` with this rank's other coordinates, except those given by
        axis name (``stage_to_global(1, data=0)``)."""
        unknown = sorted(set(kwargs) - set(self._topo.get_axis_names()))
        if unknown:
            raise PipelineError(f"stage_to_global: no axis {', '.join(map(repr, unknown))}; the topology's axes are "
                                f"{self._topo.get_axis_names()}")
        return self._topo.get_rank(**{**self._topo.get_coord(self.global_rank)._asdict(), "pipe": stage_id, **kwargs})

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        """The pipeline stage of this rank."""
        return self.stage_id

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.get_pipe_parallel_rank()

    def get_pipe_parallel_world_size(self) -> int:
        """The number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.get_pipe_parallel_world_size()

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline: one per stage, all other coordinates equal."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """Which replica of its stage this rank is (which pipeline it belongs to)."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines (replicas of each stage): what batch sizes count."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        """This stage's replicas: the group gradients are averaged over."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the ranks of its whole model (pipe x model), DeepSpeed's model-parallel group."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's tensor-slicing coordinate (0 without tensor parallelism)."""
        return self.coords["tp"]

    def get_tensor_model_parallel_rank(self) -> int:
        return self.get_slice_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.get_slice_parallel_world_size()

    def get_slice_parallel_group(self) -> dist.ProcessGroup:
        """The ranks holding the other slices of this rank's layers (this rank alone without tensor parallelism)."""
        return self.slice_proc_group

    def __repr__(self) -> str:
        return "PipelineParallelGrid" + super().__repr__().removeprefix("ParallelGrid")
