"""Accelerate's ``ParallelismConfig`` data-parallel sizes as hf_zero's hybrid sharding.

``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)`` is HSDP in Accelerate: shard inside groups of
``S`` ranks, replicate across ``R`` of them. hf_zero runs the same layout as hybrid ZeRO sharding (the
grid's ``dp_replicate`` axis, ``hf_zero/parallel/grid.py``), which its DeepSpeed config spells
``zero_optimization.mics_shard_size: S``; the Trainer and ``hf_zero.Accelerator`` hand the engine that
value, checked here against the run's world with the ParallelismConfig's own names in the sentence.
``dp_shard_size`` alone (``R`` 1) is flat ZeRO over the data-parallel ranks, what every ZeRO config does.
"""

from __future__ import annotations

from typing import Any

from hf_zero.config import ConfigError, ZeroConfig
from hf_zero.parallel import replicas_for
from hf_zero.parallel.grid import MICS_KEY


def data_parallel_sizes(parallelism_config: Any) -> tuple[int, int]:
    """``(dp_replicate_size, dp_shard_size)`` of an Accelerate ``ParallelismConfig`` (``(1, 1)`` without one)."""
    if parallelism_config is None:
        return 1, 1
    return (int(getattr(parallelism_config, "dp_replicate_size", None) or 1),
            int(getattr(parallelism_config, "dp_shard_size", None) or 1))


def asks_for_data_parallel_layout(parallelism_config: Any) -> bool:
    """Whether the ParallelismConfig sets either data-parallel size (hf_zero then reads it, not Accelerate)."""
    return data_parallel_sizes(parallelism_config) != (1, 1)


def shard_size_of(parallelism_config: Any, world: int, sp: int, tp: int = 1) -> int:
    """The ``mics_shard_size`` the ParallelismConfig asks for on ``world`` ranks: ``dp_shard_size`` when it replicates
    (``dp_replicate_size`` > 1), else -1 (flat ZeRO). One sentence naming its keys when the sizes do not make up the
    data-parallel ranks of the run (``world / (sp x tp)``)."""
    replicate, shard = data_parallel_sizes(parallelism_config)
    if (replicate, shard) == (1, 1):
        return -1
    dp = world // max(sp * tp, 1)
    if replicate * shard != dp:
        raise ConfigError(
            f"ParallelismConfig(dp_replicate_size={replicate}, dp_shard_size={shard}) holds {replicate * shard} "
            f"data-parallel ranks but this run has {dp} ({world} processes / sequence- and tensor-parallel degree "
            f"{sp * tp}); make dp_replicate_size x dp_shard_size equal to {dp}"
        )
    return shard if replicate > 1 else -1


def apply_to(cfg: ZeroConfig, parallelism_config: Any, world: int) -> ZeroConfig:
    """``cfg`` (a freshly parsed config, changed in place) with the ParallelismConfig's hybrid sharding as its
    ``mics_shard_size``; a config that already says a different one is refused (two answers to one question), and
    what hybrid sharding does not compose with is refused in the ParallelismConfig's names."""
    shard = shard_size_of(parallelism_config, world, cfg.sequence_parallel_size, cfg.tensor_parallel_size)
    if shard <= 0:
        return cfg
    replicate, _ = data_parallel_sizes(parallelism_config)
    where = f"ParallelismConfig(dp_replicate_size={replicate}, dp_shard_size={shard})"
    own = cfg.zero_optimization.mics_shard_size
    if own > 0 and own != shard:
        raise ConfigError(f"{MICS_KEY} is {own} but {where} asks for shard groups of {shard} ranks; give the layout in "
                          "one place, or the same size in both")
    replicas_for(world, shard, zero_stage=cfg.zero_optimization.stage, sp=cfg.sequence_parallel_size,
                 tp=cfg.tensor_parallel_size, where=where)
    cfg.zero_optimization.mics_shard_size = shard
    return cfg
