"""A pipelined model's full weights as one Hugging Face folder (``PipelineEngine.save_pretrained``).

Each stage holds only its layers, under the model's own names, so consolidating is a matter of
rank 0 asking each stage for its tensors in stage order and streaming them into the writer of
:mod:`hf_zero.checkpoint.consolidated`. The first data-parallel replica of each stage answers
(stages 0-2 keep whole parameters on every replica); under tensor parallelism that replica's tp group
gathers each slice onto its tp rank 0, which answers. A tied weight is held by several stages
under one name; the first stage's copy is written. The lists of names travel as JSON
(``hf_zero.distributed.dist.gather_json``), never pickled.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_zero.checkpoint.consolidated import save_model_config, write_weights
from hf_zero.checkpoint.state import TrainState
from hf_zero.distributed.dist import gather_json
from hf_zero.parallel.tp_split import split_of
from hf_zero.pipe.module import PipelineModule
from hf_zero.precision.policies import dtype_by_name


def save_pretrained(state: TrainState, save_directory: str, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None) -> list[str]:
    """Consolidate every stage into ``save_directory`` (collective over the world; global rank 0 writes)."""
    module = state.module
    assert isinstance(module, PipelineModule), "a pipeline's weights are consolidated from its PipelineModule"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(save_directory, exist_ok=True)
    tp = state.tensor_parallel
    mine: dict[str, torch.Tensor] = {}
    listing = []
    if module.dp_rank == 0:  # the first data-parallel replica of each stage: under tensor parallelism, its tp group
        seen: set[int] = set()
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            mine[name] = t
            split = split_of(t)
            if tp is None or tp.tp_rank == 0:  # tp rank 0 answers, with the whole shape of a slice
                listing.append([name, str(t.dtype), list(split.full_shape if split is not None else t.shape)])
    everyone = gather_json(listing)
    owner: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    entries = []
    for r, names in enumerate(everyone):  # rank order is stage order
        for name, held, shape in names:
            if name not in owner:
                owner[name] = (r, dtype_by_name(held), tuple(shape))
                saved = dtype if (dtype is not None and dtype_by_name(held).is_floating_point) else dtype_by_name(held)
                entries.append((name, saved, tuple(shape)))

    def produce(name: str) -> torch.Tensor | None:
        src, held, shape = owner[name]
        split = split_of(mine[name]) if name in mine else None
        if split is not None and tp is not None:  # the slices of src's tp group made whole on src (each member calls)
            parts = [torch.empty_like(mine[name]) for _ in range(split.size)]
            dist.all_gather(parts, mine[name].detach().contiguous(), group=tp.tp_group)
            if rank != src:
                return None
            mine[name] = torch.cat(parts, dim=split.dim)
        if src == rank == 0:
            return mine[name].detach().to("cpu", copy=True)
        if rank == src:
            dist.send(mine[name].detach().contiguous(), dst=0)
        elif rank == 0:
            buf = torch.empty(shape, dtype=held, device=state.device)
            dist.recv(buf, src=src)
            return buf.to("cpu")
        return None

    with torch.no_grad():
        files = write_weights(save_directory, entries, produce, max_shard_size, writer=rank == 0)
    if rank == 0:
        floats = [dt for _, dt, _ in entries if dt.is_floating_point]
        save_model_config(module, save_directory, floats[0] if floats else None)
    dist.barrier()
    return files

