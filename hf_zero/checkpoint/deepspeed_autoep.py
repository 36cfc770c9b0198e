"""DeepSpeed's AutoEP checkpoints: its expert blocks and its MoE layers' names, back to the model's own.

DeepSpeed 0.19.8's AutoEP (the ``expert_parallel`` section) swaps each MoE block ``P`` of a transformers model for
its ``AutoEPMoELayer``, so what its checkpoints store is named after that layer, not the model:

- the fused experts ``P.experts.gate_up_proj`` [E, 2I, H] and ``P.experts.down_proj`` [E, H, I] become three
  tensors of this EP rank's ``E / N`` experts, ``P.experts.w1`` (the gate: the first I rows of each expert's
  ``gate_up_proj``), ``P.experts.w3`` (the up projection, the last I rows) and ``P.experts.w2`` (``down_proj``);
  every EP rank's block has the same names. They live only in the ZeRO optimizer files, as one optimizer param group
  of their own per original group (``"moe": true``), partitioned over the expert-data-parallel group (the ranks
  holding the same experts), not over all ranks; ZeRO 0-2 also write one ``layer_<L>_expert_<X>_mp_rank_00_model_states.pt``
  file per expert (its weights in the compute dtype, copies of the masters, not read here);
- the router ``P.gate`` becomes ``P.router.gate`` (and the block keeps an alias of it under ``P.gate``, which
  repeats it in the saved state dict as ``P.gate.gate.weight``); a shared expert ``P.shared_expert`` / its gate
  ``P.shared_expert_gate`` (Qwen) become ``P.shared_experts`` / ``P.shared_experts_gate`` (DeepSeek's
  ``P.shared_experts`` keeps its name);
- ``ds_autoep_layers`` in the model-states file records each layer's path, expert count and EP degree, and the
  placement (EP rank r holds experts ``[r*E/N, (r+1)*E/N)``); ZeRO 3 adds each rank's EP and expert-data-parallel
  rank and each sub-group's partition group (``ds_zero_partition_groups`` in its optimizer file).

:class:`AutoEPLayout` reads that and answers, for the converter (``deepspeed_map.py``), which EP rank a DeepSpeed
rank's experts are and which part of their ZeRO partition it holds, the model's name of every other tensor, and where
each element range of ``w1``/``w2``/``w3`` lies in the model's fused tensors. An EP rank's block is stored as hf_zero's
own EP checkpoints store it (``name@ep<r>of<N>``, with the cut in the parameter table, ``hf_zero/parallel/tp_split.py``),
so a load at another EP degree, without EP or at another world size re-cuts it the way it re-cuts hf_zero's
(``checkpoint/tp_reshard.py``). What cannot be mapped is refused in one sentence: a placement other than contiguous
and uniform, AutoEP folded with AutoTP, an expert bias (``load_balance_coeff``), the model's names overridden by
pattern keys, frozen experts, ZeRO 0 (per-EP-rank optimizer files) and the BF16 optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hf_zero.parallel.tp_split import slice_name

# The section's keys that rename what the model holds: the names below follow DeepSpeed's presets, which keep the
# model's own (router "gate", experts "experts" with gate_up_proj / down_proj, shared experts as the model names them).
_RENAMING_KEYS = ("router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3", "shared_experts_pattern",
                  "shared_experts_gate_pattern")
_WEIGHTS = ("w1", "w2", "w3")


class AutoEPError(ValueError):
    """What an AutoEP checkpoint holds that this module cannot map (the converter words it as a refusal)."""


@dataclass
class AutoEPLayout:
    """How DeepSpeed's AutoEP laid out one checkpoint's experts (module docstring)."""

    size: int  # EP degree
    world: int  # data-parallel ranks that saved it
    data_before: bool  # use_data_before_expert_parallelism: EP groups strided, expert-data-parallel groups consecutive
    layers: dict[str, int]  # MoE block path -> its experts in all
    qwen_shared: set[str] = field(default_factory=set)  # blocks whose shared expert has a gate: Qwen's names

    # ------------------------------------------------------------------- ranks

    @property
    def edp_size(self) -> int:
        """Ranks holding the same experts (an expert block's ZeRO partition count)."""
        return self.world // self.size

    def ep_rank(self, rank: int) -> int:
        """The EP rank (which block of experts) of DeepSpeed's data-parallel rank ``rank`` (``deepspeed.utils.groups``:
        EP groups of consecutive ranks, or strided with ``use_data_before_expert_parallelism``)."""
        return rank // self.edp_size if self.data_before else rank % self.size

    def edp_rank(self, rank: int) -> int:
        """Its rank in its expert-data-parallel group: the part of its EP rank's expert partition it holds."""
        return rank % self.edp_size if self.data_before else rank // self.size

    # ------------------------------------------------------------------- names

    def _split(self, name: str) -> tuple[str, str] | None:
        """``(block, rest)`` for a name inside an AutoEP layer, else None."""
        for block in self.layers:
            if name.startswith(block + "."):
                return block, name[len(block) + 1 :]
        return None

    def is_expert(self, name: str) -> bool:
        """Whether ``name`` is one of a layer's ``experts.w1`` / ``w2`` / ``w3``."""
        s = self._split(name)
        return s is not None and s[1] in (f"experts.{w}" for w in _WEIGHTS)

    def model_name(self, name: str, held: set[str] | frozenset[str] = frozenset()) -> str | None:
        """The model's name of a DeepSpeed tensor outside the experts, or None for the router's alias (``held``: every
        name of the saved state dict, to tell ``P.gate.gate.weight``, the alias of ``P.router.gate.weight``)."""
        s = self._split(name)
        if s is None:
            return name
        block, rest = s
        head, _, tail = rest.partition(".")
        if head == "router":
            if tail in ("gate.weight", "gate.bias", "e_score_correction_bias"):
                return f"{block}.gate.{tail.removeprefix('gate.')}"
            raise AutoEPError(f"its AutoEP router holds '{name}', which the model's router has no counterpart for")
        if head == "experts":
            raise AutoEPError(f"its AutoEP experts hold '{name}' besides w1, w2 and w3")
        if head == "shared_experts":
            return f"{block}.shared_expert.{tail}" if block in self.qwen_shared else name
        if head == "shared_experts_gate":
            return f"{block}.shared_expert_gate.{tail}"
        if head == "expert_bias":
            raise AutoEPError(f"it was trained with expert_parallel.load_balance_coeff: '{name}' is an expert bias the "
                              "model's own router does not have")
        if f"{block}.router.{tail}" in held:
            return None  # the layer's alias of its router (saved twice)
        return name

    def expert_names(self, name: str, local_shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """The model's fused tensor a DeepSpeed expert tensor is part of, and that tensor's whole shape."""
        block, rest = self._split(name)  # type: ignore[misc]
        total, w = self.layers[block], rest.removeprefix("experts.")
        if len(local_shape) != 3 or local_shape[0] * self.size != total:
            raise AutoEPError(f"its '{name}' has shape {list(local_shape)}, not [{total // self.size}, I, H] for "
                              f"{total} experts over {self.size} EP ranks")
        _, a, b = local_shape
        if w == "w2":
            return f"{block}.experts.down_proj", (total, a, b)
        return f"{block}.experts.gate_up_proj", (total, 2 * a, b)

    def stored(self, base: str, ep_rank: int) -> str:
        """The name an EP rank's block of ``base`` is stored under (hf_zero's own EP checkpoints' name)."""
        return slice_name(base, ep_rank, self.size, "ep")

    def cut(self, whole: tuple[int, ...], ep_rank: int) -> dict:
        """The parameter-table entry of EP rank ``ep_rank``'s block of a fused tensor of shape ``whole``."""
        per = whole[0] // self.size
        return {"ep": {"dim": 0, "size": self.size, "full_shape": list(whole), "experts": [ep_rank * per, (ep_rank + 1) * per]}}

    def expert_ranges(self, name: str, local_shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, int, int]]:
        """Elements ``[a, b)`` of the DeepSpeed expert tensor ``name`` (of this EP rank's shape ``local_shape``) as
        ``(x, y, off)``: elements ``[x, y)`` of the EP rank's block of the fused tensor are elements
        ``[a + off, a + off + y - x)`` of it. ``w2`` is ``down_proj`` element for element; ``w1`` and ``w3`` interleave
        in ``gate_up_proj``, each expert's I x H gate rows first, then its up rows, so a range of either is cut at
        expert boundaries."""
        w = name.rsplit(".", 1)[1]
        if w == "w2":
            return [(a, b, 0)]
        per = math.prod(local_shape[1:])  # one expert's gate (or up) elements
        shift = 0 if w == "w1" else per
        out = []
        for j in range(a // per, -(-b // per)):
            lo, hi = max(a, j * per), min(b, (j + 1) * per)
            x = j * 2 * per + shift + lo - j * per
            out.append((x, x + hi - lo, lo - a))
        return out


def layout(m0: dict, world: int, stage: int, kind: str, shapes: list[dict]) -> AutoEPLayout | None:
    """The AutoEP layout rank 0's model-states file ``m0`` records, None for a checkpoint without AutoEP; raises
    :class:`AutoEPError` with what it cannot map."""
    entries = m0.get("ds_autoep_layers") or m0.get("autoep_layers")
    if not entries:
        return None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise AutoEPError("its ds_autoep_layers entry is not a list of layer records; the checkpoint is damaged")
    if m0.get("folding") is not None:
        raise AutoEPError("it folds AutoEP with AutoTP (tensor_parallel.autotp_size with expert_parallel), which hf_zero "
                          "does not convert")
    if stage == 0:
        raise AutoEPError("it was saved at ZeRO stage 0, whose optimizer state AutoEP stores per EP rank by position "
                          "(expp_rank_* files); hf_zero converts AutoEP checkpoints of ZeRO stages 1-3")
    if kind == "bf16":
        raise AutoEPError("it was saved by DeepSpeed's BF16 optimizer (bf16 with fp32 gradient accumulation); hf_zero "
                          "converts AutoEP checkpoints of ZeRO's own optimizer")
    section = ((m0.get("ds_config") or {}).get("expert_parallel")) or {}
    renaming = [k for k in _RENAMING_KEYS if section.get(k) is not None]
    if renaming:
        raise AutoEPError(f"its expert_parallel section sets {renaming[0]}, which renames what the model holds; hf_zero "
                          "maps AutoEP checkpoints of DeepSpeed's presets (the model's own names)")
    sizes = {int(e.get("ep_size", 0)) for e in entries}
    if len(sizes) != 1 or not next(iter(sizes)) or world % next(iter(sizes)):
        raise AutoEPError(f"its AutoEP layers record EP degrees {sorted(sizes)}, not one that divides its {world} ranks")
    size = sizes.pop()
    layers: dict[str, int] = {}
    for e in entries:
        path, total, local = e.get("module_path"), int(e.get("num_experts", 0)), int(e.get("num_local_experts", 0))
        if not isinstance(path, str) or local * size != total or total <= 0:
            raise AutoEPError(f"its AutoEP layer record {e.get('module_path')!r} is inconsistent ({local} local experts "
                              f"of {total} over {size} EP ranks); the checkpoint is damaged")
        placement = e.get("expert_placement")
        if placement is not None:
            ranks = sorted((r.get("rank"), list(r.get("experts", []))) for r in placement.get("ranks", []))
            if ranks != [(r, list(range(r * local, (r + 1) * local))) for r in range(size)]:
                raise AutoEPError(f"its AutoEP layer '{path}' places the experts other than in contiguous equal blocks per "
                                  "EP rank, which hf_zero's expert parallelism cannot hold")
        fmt = e.get("checkpoint_format", "per_expert_files")
        if fmt not in ("per_expert_files", "zero3_partitioned"):
            raise AutoEPError(f"its AutoEP layer '{path}' is stored as {fmt!r}, a format hf_zero does not know")
        layers[path] = total
    data_before = bool((m0.get("ds_config") or {}).get("use_data_before_expert_parallelism", False))
    out = AutoEPLayout(size, world, data_before, layers)
    names = {n for g in shapes for n in g}
    for n in m0.get("frozen_param_shapes") or {}:
        if out.is_expert(n):
            raise AutoEPError(f"its expert parameter '{n}' is frozen; hf_zero converts AutoEP checkpoints whose experts train")
    for block in layers:
        missing = [f"{block}.experts.{w}" for w in _WEIGHTS if f"{block}.experts.{w}" not in names]
        if missing:
            raise AutoEPError(f"its optimizer holds no '{missing[0]}' (frozen experts, or saved without them); hf_zero "
                              "converts AutoEP checkpoints whose experts train")
    held = set(m0.get("module") or {}) | names
    for n in sorted(held):
        if not out.is_expert(n):
            out.model_name(n, held)  # refuses a router or experts tensor of no counterpart, and an expert bias
    out.qwen_shared = {b for b in layers if any(n.startswith(f"{b}.shared_experts_gate.") for n in held)}
    return out


def check_partitions(osd: Any, ep: AutoEPLayout, rank: int, expert_flats: list[bool], where: str) -> None:
    """ZeRO 3: the partition groups a rank's optimizer file records agree with the layout (every sub-group of
    experts partitioned over this rank's expert-data-parallel group, every other over all ranks)."""
    groups = osd.get("ds_zero_partition_groups")
    if not isinstance(groups, list):
        return
    for k, g in enumerate(groups):
        if k >= len(expert_flats):
            break
        want = (ep.edp_size, ep.edp_rank(rank)) if expert_flats[k] else (ep.world, rank)
        got = (int(g.get("partition_count", -1)), int(g.get("partition_rank", -1)))
        if got != want:
            raise AutoEPError(f"{where}: sub-group {k} is partitioned {got[0]} ways (this rank's part {got[1]}), not "
                              f"{want[0]} ({want[1]}) as its AutoEP layout says; the checkpoint is damaged")
