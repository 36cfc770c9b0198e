"""The ranks of one checkpoint: who stores what, and how they agree when one of them fails.

The engine hands the checkpoint its :class:`CheckpointLayout` (in its ``TrainState``, ``checkpoint/state.py``):
a plain engine's data-parallel group, or a pipeline's whole world with this rank's stage and the
tied weights another stage stores. Nothing here knows what a pipeline is beyond those numbers.

Saving and loading are collective, so a failure on one rank (a full disk, a damaged file, a
state JSON cannot hold) must reach every rank instead of leaving the others waiting in the next
collective: each rank turns its failure into one clause (:func:`attempt`), the clauses are pooled
with ``hf_zero.distributed.dist.gather_json`` and every rank raises the same sentence (:func:`agree`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from hf_zero.distributed.dist import gather_json
from hf_zero.errors import CheckpointError

T = TypeVar("T")


@dataclass
class CheckpointLayout:
    """Which ranks write one checkpoint together, and what this rank stores of what it holds.

    ``group`` (``world`` ranks, this one ``rank``) writes the checkpoint: files are numbered by
    ``rank``. Replicated values (ZeRO stage 0, frozen parameters, buffers) are stored by the rank
    whose ``dp_rank`` (and ``tp_rank``) is 0. Under tensor parallelism the group is the whole grid: the
    ranks of a tensor-parallel group store their own slices (named per rank, ``hf_zero/parallel/tp_split.py``)
    and ``others`` holds the whole parameters, which only ``tp_rank`` 0 stores. In a pipeline (``pipe_stage`` set:
    this rank's pipeline stage, not a ZeRO stage) the group is the whole world, each
    stage holds other parameters, and the tied parameters whose ids are in ``others`` are stored
    by the first stage holding them, not this one. Under hybrid sharding the ranks of replica 0 (``replica``, the
    grid's ``dp_replicate`` coordinate) store the shards and the others store only their RNG streams and index:
    one copy of every element, written once.
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    dp_rank: int
    pipe_stage: int | None = None  # stored as "stage" in a rank's JSON (hf_zero/checkpoint/format.py)
    num_stages: int | None = None
    dp: int = 1
    others: set[int] = field(default_factory=set)
    tp_rank: int = 0  # under tensor parallelism: this rank's place in its group (buffers are stored by tp_rank 0)
    replica: int = 0  # under hybrid sharding: this rank's replica of its shard (dp_replicate); only replica 0 stores

    @property
    def stores_shards(self) -> bool:
        """Whether this rank stores the shards it owns: under hybrid sharding the other replicas hold the same ones."""
        return self.replica == 0

    @classmethod
    def data_parallel(cls, group: dist.ProcessGroup | None) -> CheckpointLayout:
        """Every rank of ``group`` holds the whole model (a plain engine)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return cls(group, rank, world, rank, dp=world)


def reason(e: BaseException) -> str:
    """An exception as the clause of one sentence: a CheckpointError's own words, others with their type."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def attempt(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """``(fn(), None)``, or ``(None, reason)`` when it raises: the failure is pooled, not raised on one rank."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any failure must reach every rank
        return None, reason(e)


def pool(error: str | None, group: dist.ProcessGroup | None) -> list[str | None]:
    """Every rank's failure clause (None where it went well), by rank."""
    return gather_json(error, group)


def agree(errors: list[str | None], save_dir: str) -> None:
    """Raise the first failing rank's error on every rank; all ranks call this with the pooled errors.

    One sentence everywhere: a failure every rank found (a state JSON cannot hold) in its own words,
    one rank's (its disk is full) naming that rank.
    """
    for r, e in enumerate(errors):
        if e:
            if all(x == e for x in errors):
                raise CheckpointError(e)
            raise CheckpointError(f"save_checkpoint failed on rank {r} ({e}); the checkpoints already in {save_dir} are kept")


def gather_findings(found: list[str], extra: Any, group: dist.ProcessGroup | None) -> tuple[list[str], list[Any]]:
    """Pool every rank's reasons to refuse (and one more JSON value each); all ranks get the same lists."""
    pooled = gather_json({"errors": found, "extra": extra}, group)
    return [e for part in pooled for e in part["errors"]], [part["extra"] for part in pooled]
