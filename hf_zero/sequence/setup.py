"""What ``initialize`` does for sequence parallelism, in one place so the engine's own files barely change.

:func:`setup_model` reads the config's ``sequence_parallel`` settings, refuses what cannot be
combined, makes the ``dp x sp`` groups and prepares the model (:func:`.model.prepare_model`).
The grid (``hf_zero/parallel/grid.py``) has the ``sp`` axis; the engine runs ZeRO over the grid's ZeRO group,
which holds the ``sp`` ranks too (see :mod:`.groups` for why that is right); only the batch arithmetic, the
sampler and the loader see the data-parallel degree.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.parallel import ParallelGrid
from hf_zero.sequence.batch import SequenceParallelLoader
from hf_zero.sequence.groups import SequenceParallelError, SequenceParallelGroups, view_of
from hf_zero.sequence.model import LongSequenceOptions, causal_lm_of, prepare_model

logger = logging.getLogger("hf_zero")


def setup_model(model: torch.nn.Module, config: Any, grid: ParallelGrid, pipeline: bool) -> SequenceParallelGroups | None:
    """Model preparation for ``config.sequence_parallel`` (a :class:`.config.SequenceParallelConfig`) on the grid's
    ``sp`` axis.

    Returns the grid's sequence-parallel view when the degree is above 1, else None (the tiling
    switches may still have prepared the model).
    """
    sp, size = config.sequence_parallel, config.sequence_parallel_size
    wants = size > 1 or sp.tiled_loss or sp.tiled_mlp
    if not wants:
        return None
    if pipeline:
        raise SequenceParallelError(
            "sequence_parallel_size / the sequence_parallel section cannot be combined with a pipeline yet; train the "
            "model unsplit (a plain transformers model) or drop the sequence-parallel keys"
        )
    if size > 1 and config.compile.enabled:
        raise SequenceParallelError(
            "compile cannot be combined with sequence parallelism yet (the all-to-alls run inside attention); set "
            '"compile": {"enabled": false} or sequence_parallel_size to 1'
        )
    groups = view_of(grid)
    options = LongSequenceOptions(
        tiled_loss=sp.tiled_loss, loss_tile_tokens=sp.loss_tile_tokens, tiled_mlp=sp.tiled_mlp, mlp_tile_tokens=sp.mlp_tile_tokens,
    )
    done = prepare_model(model, groups, options)
    if dist.get_rank() == 0:
        logger.info(
            "sequence parallelism: degree %d (data-parallel %d), attention %s, tiled loss %s, tiled MLPs %d",
            size, grid.dp_size, done["attention"] or "unchanged",
            "on" if done["fused_loss"] else "off", done["tiled_mlps"],
        )
    return groups


def wrap_loader(loader: Any, groups: SequenceParallelGroups | None, model: torch.nn.Module, device: torch.device, *,
                gather: bool = False) -> Any:
    """The engine's (or the Trainer's) loader, yielding this rank's sequence shards; unchanged without SP.

    ``device`` is where ``gather=True`` exchanges batches (the engine's device: NCCL moves GPU tensors only).
    """
    if groups is None or not groups.enabled:
        return loader
    pad = getattr(getattr(causal_lm_of(model), "config", None), "pad_token_id", None)
    return SequenceParallelLoader(loader, groups, gather=gather, pad_token_id=int(pad or 0), device=device)


def sp_size_of(parallelism_config: Any) -> int:
    """The sequence-parallel degree of an Accelerate ``ParallelismConfig`` that hf_zero can run (1 without one).

    hf_zero takes ``sp_size`` (with ``sp_backend="deepspeed"``, the name Accelerate and transformers
    give ALST); the other dimensions belong to engines hf_zero replaces and are refused.
    """
    if parallelism_config is None:
        return 1
    sp = int(getattr(parallelism_config, "sp_size", None) or 1)
    others = {k: int(getattr(parallelism_config, f"{k}_size", None) or 1) for k in ("tp", "cp", "dp_shard")}
    given = [f"{k}_size={v}" for k, v in others.items() if v > 1]
    if given:
        raise SequenceParallelError(
            f"ParallelismConfig({', '.join(given)}) asks for tensor/context/FSDP parallelism, which hf_zero does not run; "
            "with zero_config keep sp_size (Ulysses sequence parallelism) and leave the others at 1"
        )
    backend = getattr(parallelism_config, "sp_backend", "deepspeed")
    if sp > 1 and backend not in (None, "deepspeed"):
        raise SequenceParallelError(f"ParallelismConfig(sp_backend={backend!r}): hf_zero runs sp_backend='deepspeed' (Ulysses)")
    return sp


def config_sp_size(config: dict | None) -> tuple[int, str]:
    """The sequence-parallel degree a zero_config asks for, and where it says so (1 and "" when it does not).

    Either spelling counts: DeepSpeed's top-level ``sequence_parallel_size`` or LLaMA-Factory's
    ``sequence_parallel`` section (``size`` / ``ulysses.degree``); :func:`hf_zero.sequence.config.parse`
    has already refused the two disagreeing. ``"auto"`` asks for nothing (the ParallelismConfig fills it).
    """
    from hf_zero.sequence.config import SECTION, parse

    if not config:
        return 1, ""
    data = {k: v for k, v in config.items() if not (k == "sequence_parallel_size" and v == "auto")}
    size = parse(data).size
    if size <= 1:
        return 1, ""
    return size, "sequence_parallel_size" if data.get("sequence_parallel_size") is not None else f"its {SECTION} section"


def resolve_sp_size(parallelism_config: Any, config: dict | None) -> int:
    """The run's sequence-parallel degree, from the ParallelismConfig or the zero_config, whichever gives one.

    A Trainer user with a DeepSpeed config that carries ``sequence_parallel_size`` (LLaMA-Factory's ALST
    configs) has no ParallelismConfig and no loader of the engine's; the degree must still reach the
    Trainer, which splits batches only when Accelerate's state has an ``sp_size``. Both given and different
    is refused: neither can be assumed to be the one meant.
    """
    sp = sp_size_of(parallelism_config)
    own, where = config_sp_size(config)
    if sp > 1 and own > 1 and sp != own:
        raise SequenceParallelError(
            f"zero_config asks for sequence-parallel degree {own} ({where}) but the ParallelismConfig has sp_size={sp}; "
            "give the degree in one place, or the same value in both"
        )
    return max(sp, own)


def parallelism_config_for(parallelism_config: Any, sp: int) -> Any:
    """An Accelerate ``ParallelismConfig`` with ``sp_size=sp`` (ALST's backend): the given one when it already says so."""
    if sp <= 1 or sp_size_of(parallelism_config) == sp:
        return parallelism_config
    from accelerate.parallelism_config import ParallelismConfig

    if parallelism_config is None:
        return ParallelismConfig(sp_size=sp, sp_backend="deepspeed")
    import copy

    out = copy.copy(parallelism_config)  # the user's other settings kept; sp_size was 1 (resolve_sp_size said so)
    out.sp_size, out.sp_backend = sp, "deepspeed"
    if getattr(out, "sp_handler", "absent") is None:
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        out.sp_handler = DeepSpeedSequenceParallelConfig()
    return out


def merge_sp_size(config: dict, sp: int) -> dict:
    """``config`` with ``sequence_parallel_size`` from the ParallelismConfig (an explicit, different one is refused)."""
    if sp <= 1:
        return config
    have = config.get("sequence_parallel_size")
    if have not in (None, "auto", sp):
        raise SequenceParallelError(
            f"zero_config has sequence_parallel_size {have} but the ParallelismConfig has sp_size={sp}; set one of them"
        )
    return {**config, "sequence_parallel_size": sp}
