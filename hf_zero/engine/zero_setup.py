"""The ZeRO optimizer an engine steps through, built once from the config.

The config is read here, once, into ``ShardedOptimizer``'s three frozen inputs (``hf_zero/zero/optimizer.py``):
the groups' ``Placement`` (which ranks, which device, which dtypes), the ``ZeroPolicy`` (the stage and its
knobs) and the ``OffloadPolicy`` (what waits in host memory or on NVMe). Nothing changes them afterwards,
so the engine's step never reads the ``zero_optimization`` section again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hf_zero.config import ZeroConfig
from hf_zero.parallel import ParallelGrid
from hf_zero.precision.policies import reduce_dtype
from hf_zero.training.timers import StepTimers
from hf_zero.zero.group import Placement
from hf_zero.zero.host_step import host_step_threads
from hf_zero.zero.nvme_io import NvmeSpec
from hf_zero.zero.offload import OffloadPolicy
from hf_zero.zero.optimizer import ShardedOptimizer, ZeroPolicy
from hf_zero.zero.zenflow_policy import ZenFlowPolicy

logger = logging.getLogger("hf_zero")


class NoOptimizer:
    """The optimizer of a frozen stage-3 model: no parameter groups, so the shard layout holds only frozen groups."""

    def __init__(self) -> None:
        self.param_groups: list[dict] = []
        self.state: dict = {}


def _nvme(sec: Any, key: str, aio: Any) -> NvmeSpec | None:
    """An offload section's NVMe spec for ``"device": "nvme"`` (the config refused it without a path), else None."""
    if sec is None or sec.device != "nvme":
        return None
    return NvmeSpec(path=str(sec.nvme_path), where=f"zero_optimization.{key}", buffer_count=int(sec.buffer_count),
                    pin_memory=bool(sec.pin_memory), max_in_cpu=int(getattr(sec, "max_in_cpu", 0)),
                    buffer_size=int(getattr(sec, "buffer_size", 0)), block_size=int(aio.block_size),
                    queue_depth=int(aio.queue_depth), threads=int(aio.intra_op_parallelism),
                    single_submit=bool(aio.single_submit))


def _zenflow(zf: Any) -> ZenFlowPolicy | None:
    """``zero_optimization.zenflow`` resolved as DeepSpeed 0.19.8's ``configure_zenflow`` resolves it: "auto" selection
    is once an epoch (``select_strategy`` "epoch", interval 1), "auto" ``update_interval`` is None."""
    if zf is None:
        return None
    by_epoch = zf.select_strategy in ("auto", "epoch")
    every = 1 if zf.select_strategy == "auto" else int(zf.select_interval)
    return ZenFlowPolicy(topk_ratio=float(zf.topk_ratio), by_epoch=by_epoch, select_every=every,
                         update_interval=None if zf.update_interval == "auto" else int(zf.update_interval),
                         overlap_step=bool(zf.overlap_step), offload=bool(zf.offload), auto_ratio=float(zf.auto_ratio),
                         warm_up=int(zf.full_warm_up_rounds), reserved_cores=float(zf.pt_reserved_cores_perc),
                         steps_per_epoch=zf.steps_per_epoch)


def sharded_optimizer(module: torch.nn.Module, optimizer: Any, config: ZeroConfig, grid: ParallelGrid,
                      device: torch.device, timers: StepTimers, rank: int, inference_only: bool) -> ShardedOptimizer:
    """The ZeRO stage of ``config`` over ``optimizer``, sharded over ``grid``'s shard group (replicated across its
    replicate group under hybrid sharding). ``inference_only``: a stage-3 engine without an optimizer, which
    offloads no optimizer state. ``timers`` and ``rank`` say how many threads the host step runs on."""
    zc = config.zero_optimization
    place = Placement.over(grid.shard_group, device, config.compute_dtype, reduce_dtype(config), config.master_dtype,
                           replicate=grid.replicate_group if grid.hybrid else None)
    zero = ZeroPolicy(
        stage=zc.stage, bucket_numel=max(1, int(zc.reduce_bucket_size)),
        persistence_threshold=int(zc.stage3_param_persistence_threshold),
        prefetch_numel=int(zc.stage3_prefetch_bucket_size), max_live_numel=int(zc.stage3_max_live_parameters),
        max_reuse_numel=int(zc.stage3_max_reuse_distance),
        overlap_param_gather=zc.overlap_param_gather, ignore_unused_parameters=zc.ignore_unused_parameters,
    )
    off, par = zc.offload_optimizer, zc.offload_param  # offload_param: stage 3 only (the config says it is ignored elsewhere)
    offload_optimizer = off is not None and off.device in ("cpu", "nvme") and not inference_only
    host_threads = speculate_threads = None
    if offload_optimizer:
        # cpuadam_cores_perc is the share of the host step that runs beside the backward (super_offload's background
        # steps); the steps taken while the GPU waits for them take the whole share. Without super_offload it is the
        # whole host step's share, as before.
        speculative = bool(off.super_offload) and off.device == "cpu"
        host_threads, why = host_step_threads(None, None if speculative else off.cores_share())
        if speculative:
            speculate_threads, why_spec = host_step_threads(None, off.cores_share())
            why += f"; {speculate_threads} for the steps taken during backward ({why_spec})"
        if timers.enabled:
            timers.note("step.cpu_optimizer", f"{host_threads} threads")
            if rank == 0:
                logger.info("offload: the host optimizer step runs on %d threads per rank (%s)", host_threads, why)
    params_on = par is not None and par.device in ("cpu", "nvme") and zc.stage == 3
    offload = OffloadPolicy(
        optimizer=offload_optimizer, pin_memory=bool(off.pin_memory) if off is not None else True,
        host_threads=host_threads,
        params=params_on,
        params_pin_memory=bool(par.pin_memory) if par is not None else True,
        optimizer_nvme=_nvme(off, "offload_optimizer", config.aio) if offload_optimizer else None,
        params_nvme=_nvme(par, "offload_param", config.aio) if params_on and offload_optimizer else None,
        speculate=offload_optimizer and bool(off.super_offload) and off.device == "cpu",
        speculate_threads=speculate_threads,
        ratio=float(off.ratio) if offload_optimizer else 1.0,
        sub_group_size=int(zc.sub_group_size) if offload_optimizer else None,
        zenflow=_zenflow(zc.zenflow) if offload_optimizer else None,
    )
    return ShardedOptimizer(module, optimizer, place=place, zero=zero, offload=offload)
