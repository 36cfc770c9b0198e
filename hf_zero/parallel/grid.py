"""The run's parallel grid: every parallelism a named axis of one ``DeviceMesh``.

Vocabulary (used across hf_zero):

- an **axis** is a dimension of the grid of ranks (``pp``, ``dp_replicate``, ``dp_shard``, ``sp``, ``tp``); a
  **dim** is a dimension of a tensor. A **sub-grid** of some axes is the set of ranks that differ from this
  one only along them; its **group** is the process group over those ranks.
- the **ZeRO stage** (0-3) says how much of the training state is sharded; a **pipeline stage** is one
  coordinate of the ``pp`` axis. Code says ``zero_stage`` or ``pipe_stage`` wherever the two could be confused.
- **data-parallel** ranks see different samples: the sub-grid of ``dp_replicate`` x ``dp_shard``. Its size is
  what batch sizes and samplers count. The ranks of an ``sp`` or ``tp`` group share every sample.
- **ZeRO shards over** the sub-grid of :data:`ZERO_AXES` (``dp_replicate`` x ``dp_shard`` x ``sp``): every rank
  there holds the same parameters (sequence parallelism shards tokens, not weights; DeepSpeed calls this the
  sequence-data-parallel group). The ``pp`` and ``tp`` coordinates pick which parameters a rank holds at all.
- **hybrid sharding** (``dp_replicate`` > 1): the parameters, gradients and optimizer state are sharded over the
  **shard group** (:data:`SHARD_AXES`, ``dp_shard`` x ``sp``) only, and each shard is replicated over the
  **replicate group** (``dp_replicate``): gradients are reduce-scattered inside the shard group, then all-reduced
  across the replicate group; stage 3 gathers inside the shard group. Without ``dp_replicate`` the shard group is
  the ZeRO group.

Ranks are laid out row-major in :data:`AXES` order, ``tp`` innermost: the ranks of a tensor- or
sequence-parallel group are consecutive, so with one process per GPU their per-layer collectives stay inside a
node (NVLink) whenever the degree divides the GPUs per node; ``pp`` is outermost (global rank =
``pipe_stage * (ranks per stage) + ...``), as DeepSpeed's pipeline topology numbers them.

The axes are laid out on torch's ``DeviceMesh`` (``init_device_mesh`` with named axes; a group over several axes
is a flattened sub-mesh), the grid FSDP2, torchtitan and Accelerate's ``ParallelismConfig`` use. Only the
axes of size above 1 are in the mesh, so a layout creates a process group per axis it uses, as before. A
sub-grid spanning every rank answers ``None``, the default group (the fast paths and one communicator per
world keep working), and a sub-grid of this rank alone answers a group of one (``None`` would mean the world).

One :class:`ParallelGrid` is built per layout and process (:func:`grid_for`): ``initialize``, the Trainer and
Accelerate integrations and ``PipelineModule`` ask for it; the engine receives it and derives from it, in one
place, the ZeRO group, the data-parallel degree, the norm scope and the checkpoint layout.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import torch.distributed as dist

from hf_zero.errors import ConfigError

#: The grid's axes, outermost first.
AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
#: The axes ZeRO shards over: ranks holding the same parameters.
ZERO_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "sp")
#: The data-parallel axes: ranks seeing different samples.
DATA_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard")
#: The axes of one shard group under hybrid sharding: ZeRO's axes less ``dp_replicate``, across which each shard is
#: replicated (HSDP's 2-D mesh, DeepSpeed's MiCS). Without ``dp_replicate`` it is the whole ZeRO group.
SHARD_AXES: tuple[str, ...] = ("dp_shard", "sp")


@dataclass(frozen=True)
class GridShape:
    """The degree of each axis; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1

    @classmethod
    def fill(cls, world: int, *, pp: int = 1, sp: int = 1, tp: int = 1, dp_replicate: int = 1) -> GridShape:
        """The shape with ``dp_shard`` taking the ranks the other degrees leave; one sentence when they do not divide."""
        given = {"pipeline stages": pp, "sequence_parallel_size": sp, "tensor_parallel.autotp_size": tp,
                 "dp_replicate_size": dp_replicate}
        for what, n in given.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{what}: got {n!r}, expected an integer >= 1")
        used = pp * sp * tp * dp_replicate
        if world % used:
            named = " x ".join(f"{what} {n}" for what, n in given.items() if n > 1)
            raise ConfigError(
                f"{named} does not divide the {world} ranks of this run; the world must be that product times the "
                f"data-parallel degree, so launch a multiple of {used} processes or change the degrees"
            )
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=world // used, sp=sp, tp=tp)

    def size(self, *axes: str) -> int:
        """How many ranks the sub-grid of ``axes`` holds (all axes: the world)."""
        return math.prod(getattr(self, a) for a in (axes or AXES))

    def describe(self) -> str:
        """``pp 2 x dp_shard 2 x tp 2``: the axes above 1 (``dp_shard 1`` for a world of one)."""
        parts = [f"{f.name} {getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) > 1]
        return " x ".join(parts) or "dp_shard 1"


MICS_KEY = "zero_optimization.mics_shard_size"


def replicas_for(world: int, shard_size: int, *, zero_stage: int, pp: int = 1, sp: int = 1, tp: int = 1,
                 where: str | None = None) -> int:
    """The ``dp_replicate`` degree of hybrid sharding with shard groups of ``shard_size`` consecutive data-parallel
    ranks (``zero_optimization.mics_shard_size``; 0 or below: off, 1 returned). ``where`` names the setting in the
    one-sentence refusals (default: ``zero_optimization.mics_shard_size N``): a size that does not divide the
    data-parallel ranks, ZeRO stage 0, and the parallelisms hybrid sharding does not compose with yet (tensor and
    sequence parallelism; a pipeline's stages each shard and replicate over their own ranks). Every rank
    computes the same answer from the same config (no collective)."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int):
        raise ConfigError(f"{MICS_KEY}: got {shard_size!r}, expected an integer (the data-parallel ranks of one shard group)")
    where = where or f"{MICS_KEY} {shard_size}"
    others = pp * sp * tp
    if shard_size <= 0 or world % others:
        return 1  # off; or a layout GridShape.fill refuses in its own sentence
    dp = world // others
    if shard_size == dp:
        return 1  # one shard group: flat ZeRO
    if dp % shard_size:
        raise ConfigError(
            f"{where} does not divide the {dp} data-parallel ranks of this run; give a divisor of {dp} "
            "(the ranks of one shard group, each replicated across the others), or leave it out for flat ZeRO"
        )
    for what, n in (("tensor parallelism (tensor_parallel.autotp_size)", tp),
                    ("sequence parallelism (sequence_parallel_size)", sp)):
        if n > 1:
            raise ConfigError(f"{where} (hybrid sharding) cannot be combined with {what} yet; leave one "
                              "of the two out")
    if zero_stage == 0:
        raise ConfigError(f"{where} shards inside groups of ranks and ZeRO stage 0 shards nothing; set "
                          "zero_optimization.stage to 1, 2 or 3, or leave it out")
    return dp // shard_size


class ParallelGrid:
    """This process's place in the run's grid, and the groups along any of its axes (see the module docstring)."""

    def __init__(self, shape: GridShape, device_type: str) -> None:
        world = dist.get_world_size()
        if shape.size() != world:
            raise ConfigError(f"the parallel layout {shape.describe()} holds {shape.size()} ranks but the run has {world}")
        self.shape = shape
        self.device_type = device_type
        self.global_rank = dist.get_rank()
        self.world = dist.distributed_c10d._get_default_group()  # the default group the sub-groups were cut from
        # this rank's coordinate on each axis (row-major over AXES, tp fastest)
        self.coords: dict[str, int] = {}
        rest = self.global_rank
        for a in reversed(AXES):
            rest, self.coords[a] = divmod(rest, getattr(shape, a))
        self._used = tuple(a for a in AXES if getattr(shape, a) > 1)
        self.mesh = None
        if self._used:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device_type, tuple(getattr(shape, a) for a in self._used), mesh_dim_names=self._used)
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}

    # ------------------------------------------------------------------ the grid

    def size(self, *axes: str) -> int:
        """How many ranks the sub-grid of ``axes`` holds (no axes: the world)."""
        return self.shape.size(*axes)

    def rank(self, *axes: str) -> int:
        """This rank's index in its sub-grid of ``axes`` (row-major over them, in :data:`AXES` order)."""
        index = 0
        for a in _ordered(axes):
            index = index * getattr(self.shape, a) + self.coords[a]
        return index

    def rank_at(self, **coords: int) -> int:
        """The global rank whose coordinates are this rank's except those given (``rank_at(pp=0)``)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"rank_at: no axis named {', '.join(sorted(unknown))}; the axes are {', '.join(AXES)}")
        at = {**self.coords, **coords}
        index = 0
        for a in AXES:
            index = index * getattr(self.shape, a) + at[a]
        return index

    def ranks(self, *axes: str) -> tuple[int, ...]:
        """The global ranks of this rank's sub-grid of ``axes``, in the order :meth:`rank` counts them."""
        along = _ordered(axes)
        return tuple(self.rank_at(**dict(zip(along, at)))
                     for at in itertools.product(*(range(getattr(self.shape, a)) for a in along)))

    def group(self, *axes: str) -> dist.ProcessGroup | None:
        """The process group of this rank's sub-grid of ``axes``: None when it is every rank (the default group),
        a group of this rank alone when it is just this rank, else the mesh's (flattened) sub-mesh group."""
        key = tuple(a for a in _ordered(axes) if getattr(self.shape, a) > 1)
        if key not in self._groups:
            self._groups[key] = self._make_group(key)
        return self._groups[key]

    def _make_group(self, key: tuple[str, ...]) -> dist.ProcessGroup | None:
        if self.size() == 1 or (key and self.size(*key) == self.size()):
            return None
        if not key:
            return alone()
        assert self.mesh is not None
        sub = self.mesh[key[0]] if len(key) == 1 else self.mesh[key]._flatten("_".join(key))
        return sub.get_group()

    # ------------------------------------------------------------------ roles (the one place they are decided)

    @property
    def zero_group(self) -> dist.ProcessGroup | None:
        """The group ZeRO shards and reduces over: the ranks holding the same parameters (:data:`ZERO_AXES`)."""
        return self.group(*ZERO_AXES)

    @property
    def zero_size(self) -> int:
        return self.size(*ZERO_AXES)

    @property
    def zero_rank(self) -> int:
        return self.rank(*ZERO_AXES)

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The group ZeRO partitions over (:data:`SHARD_AXES`); without hybrid sharding ``dp_replicate`` is 1, so it
        is the ZeRO group itself (an axis of size 1 is no part of a group's key)."""
        return self.group(*SHARD_AXES)

    @property
    def shard_size(self) -> int:
        return self.size(*SHARD_AXES)

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The group each shard is replicated over (``dp_replicate``); a group of this rank alone without hybrid sharding."""
        return self.group("dp_replicate")

    @property
    def replicate_size(self) -> int:
        return self.shape.dp_replicate

    @property
    def replicate_rank(self) -> int:
        return self.coords["dp_replicate"]

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards inside groups and replicates across them (``dp_replicate`` > 1)."""
        return self.shape.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        """The data-parallel degree (what batch sizes and samplers count): :data:`DATA_AXES`."""
        return self.size(*DATA_AXES)

    @property
    def dp_rank(self) -> int:
        return self.rank(*DATA_AXES)

    @property
    def pipe_stage(self) -> int:
        return self.coords["pp"]

    def __repr__(self) -> str:
        at = ", ".join(f"{a}={self.coords[a]}" for a in AXES if getattr(self.shape, a) > 1)
        return f"ParallelGrid({self.shape.describe()}; rank {self.global_rank}{': ' + at if at else ''})"


def _ordered(axes: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"no axis named {', '.join(unknown)}; the axes are {', '.join(AXES)}")
    return tuple(a for a in AXES if a in axes)


_ALONE: list[dist.ProcessGroup] = []


def alone() -> dist.ProcessGroup:
    """A group of this rank alone, made once per process (only its member takes part in making it)."""
    if not _ALONE:
        _ALONE.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))
    return _ALONE[0]


def device_type_of_default_group() -> str:
    """"cuda" under NCCL, else "cpu": the device type a mesh over the default process group is built for."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


_GRIDS: dict[tuple[GridShape, str], ParallelGrid] = {}


def grid_for(shape: GridShape, device_type: str) -> ParallelGrid:
    """The grid of ``shape``, made once per process: its groups are made collectively, on every rank in the same
    order, and a second engine of the same layout (a reference model, the next test case) reuses them."""
    key = (shape, device_type)
    if key not in _GRIDS or not _alive(_GRIDS[key]):
        _GRIDS[key] = ParallelGrid(shape, device_type)
    return _GRIDS[key]


def _alive(grid: ParallelGrid) -> bool:
    """Whether the grid's groups belong to the current default process group (not to one destroyed since)."""
    return dist.is_initialized() and grid.world is dist.distributed_c10d._get_default_group()
