"""Cutting a batch along the sequence for the ranks of a sequence-parallel group.

Three things must happen *before* the cut, because after it no rank sees the whole sample:

- **Labels are shifted.** A causal LM predicts token ``t+1`` at position ``t``; transformers
  shifts ``labels`` inside its loss. Shifted per shard, the first label of every shard but the
  first would be lost (and the last position of each shard would predict nothing). So
  ``shift_labels[t] = labels[t+1]`` (``-100`` at the end) is made on the whole sample and cut
  with it; the loss then uses it as is (transformers' losses accept ``shift_labels`` too).
- **Positions are global.** The model would number each shard's tokens from 0; RoPE and the
  causal mask need their place in the whole sample, so ``position_ids`` are made (``0..S-1``,
  as the model itself would, unless the batch brings its own, e.g. for packed documents) and cut.
- **The length is padded to a multiple of sp.** The pad goes at the end, where causality keeps
  it from influencing any real token; it gets ``-100`` labels and continued positions. An
  ``attention_mask`` is padded with ones, so a batch without padding keeps the causal fast path
  of SDPA and flash attention (the padded keys are never seen by a real query anyway).

Every tensor whose second dimension is the sequence length is cut the same way (``input_ids``,
``attention_mask``, ``inputs_embeds``, ``token_type_ids``, ...); other values pass through.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.sequence.groups import SequenceParallelError, SequenceParallelGroups

IGNORE_INDEX = -100


def shift_labels_of(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` moved one position left, ``ignore_index`` at the end: the target of each position."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def _seq_len(batch: Mapping[str, Any]) -> int:
    for key in ("input_ids", "inputs_embeds"):
        t = batch.get(key)
        if torch.is_tensor(t) and t.dim() >= 2:
            return int(t.shape[1])
    raise SequenceParallelError(
        "sequence parallelism needs input_ids (or inputs_embeds) of shape [batch, sequence] in the batch to know "
        f"what to split; the batch holds {sorted(batch)}"
    )


def _pad(t: torch.Tensor, extra: int, value: float) -> torch.Tensor:
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 2) + [0, extra]
    return torch.nn.functional.pad(t, pad, value=value)


def shard_batch(
    batch: Mapping[str, Any], sp_rank: int, sp_size: int, *, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> dict[str, Any]:
    """This rank's shard of ``batch`` (see the module docstring for what is done first).

    ``labels`` becomes ``shift_labels`` (a batch that already has ``shift_labels`` keeps them);
    ``position_ids`` are added when missing. Returns a new dict; ``batch`` is not modified.
    """
    if not isinstance(batch, Mapping):
        raise SequenceParallelError(
            f"sequence parallelism splits dict batches (input_ids, labels, ...), got a {type(batch).__name__}; "
            "return a dict from the collate function"
        )
    out = dict(batch)
    seq = _seq_len(out)
    labels = out.pop("labels", None)
    if out.get("shift_labels") is None and labels is not None:
        out["shift_labels"] = shift_labels_of(labels, ignore_index)
    mask = out.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() != 2:
        raise SequenceParallelError(
            f"sequence parallelism takes a 2D attention_mask [batch, sequence] (padding), got one of shape "
            f"{tuple(mask.shape)}; pass the padding mask and let the model build the causal mask"
        )
    if out.get("position_ids") is None:
        ref = out.get("input_ids", out.get("inputs_embeds"))
        out["position_ids"] = torch.arange(seq, device=ref.device).unsqueeze(0).expand(ref.shape[0], -1)
    padded = -(-seq // sp_size) * sp_size
    extra, chunk = padded - seq, padded // sp_size
    lo = sp_rank * chunk
    for key, value in list(out.items()):
        if not (torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq):
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device)
            value = torch.cat([value, tail.to(value.dtype)], dim=1) if extra else value
        elif key == "shift_labels":
            value = _pad(value, extra, ignore_index)
        elif key == "attention_mask":
            value = _pad(value, extra, 1)
        elif key == "input_ids":
            value = _pad(value, extra, pad_token_id)
        else:
            value = _pad(value, extra, 0)
        out[key] = value[:, lo : lo + chunk]
    return out


class SequenceParallelLoader:
    """A data loader whose batches are this rank's sequence shards.

    ``gather=False`` (the engine's own loader): every rank of an sp group draws the same batches
    (the sampler is sharded over the dp group), and each keeps its shard.

    ``gather=True`` (loaders sharded over all ranks, as Accelerate prepares them for the Trainer):
    the ranks of an sp group draw different batches; they are exchanged (tensors only, shapes
    first), and the group works through them one after another, so each batch drawn becomes ``sp``
    micro-batches (DeepSpeed's UlyssesSPDataLoaderAdapter does the same, and transformers' Trainer
    counts ``len(loader) * sp`` micro-batches per epoch for it).
    """

    def __init__(
        self, loader: Any, groups: SequenceParallelGroups, *, gather: bool = False, pad_token_id: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.loader, self.groups, self.gather, self.pad_token_id = loader, groups, gather, pad_token_id
        self.device = device or torch.device("cpu")

    def __len__(self) -> int:
        return len(self.loader) * (self.groups.sp_size if self.gather else 1)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, dataset, set_epoch...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        g = self.groups
        for batch in self.loader:
            batches = _exchange_batches(batch, g, self.device) if self.gather and g.sp_size > 1 else [batch]
            for b in batches:
                yield shard_batch(b, g.sp_rank, g.sp_size, pad_token_id=self.pad_token_id)


def _exchange_batches(batch: Mapping[str, Any], g: SequenceParallelGroups, device: torch.device) -> list[dict[str, Any]]:
    """Every sp rank's batch, in rank order (tensors of any shape; gathered by shape, then by value)."""
    if not isinstance(batch, Mapping):
        raise SequenceParallelError(f"sequence parallelism splits dict batches, got a {type(batch).__name__}")
    keys = sorted(batch)
    odd = [k for k in keys if not torch.is_tensor(batch[k])]
    if odd:
        raise SequenceParallelError(
            f"the batch entry {odd[0]!r} is not a tensor; sequence-parallel loaders exchange tensors only between "
            "ranks (no pickled objects), so drop it from the collate function's output"
        )
    local = [batch[k].to(device) for k in keys]
    dims = max(t.dim() for t in local)
    shape = torch.tensor([[t.dim(), *t.shape, *([0] * (dims - t.dim()))] for t in local], dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(g.sp_size)]
    dist.all_gather(shapes, shape, group=g.sp_group)
    per_rank: list[dict[str, Any]] = [{} for _ in range(g.sp_size)]
    for i, (key, t) in enumerate(zip(keys, local)):
        sizes = [tuple(int(v) for v in s[i, 1 : 1 + int(s[i, 0])]) for s in shapes]
        numel = max(int(torch.tensor(sz).prod()) if sz else 1 for sz in sizes)
        wire = torch.uint8 if t.dtype == torch.bool else t.dtype  # gloo does not move bool tensors
        flat = torch.zeros(numel, dtype=wire, device=device)
        flat[: t.numel()] = t.reshape(-1).to(wire)
        parts = [torch.empty_like(flat) for _ in range(g.sp_size)]
        dist.all_gather(parts, flat, group=g.sp_group)
        for r, (part, sz) in enumerate(zip(parts, sizes)):
            per_rank[r][key] = part[: int(torch.tensor(sz).prod()) if sz else 1].reshape(sz).to(t.dtype)
    return per_rank
