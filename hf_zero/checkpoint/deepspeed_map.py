"""DeepSpeed's flat partitions mapped back to parameter names and element ranges.

DeepSpeed stores each rank's fp32 masters and optimizer state as flat tensors with no names;
the names come from what its model-states file records:

- ZeRO 1-2 (``DeepSpeedZeroOptimizer``): one flat per optimizer param group, the group's
  trainable parameters in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings`` entry, the whole padded to a multiple of 2 x world and cut into
  ``world`` equal partitions. A rank's ``single_partition_of_fp32_groups`` entry is its
  partition without the group padding (``group_paddings``); the optimizer state keeps it.
- bf16 with fp32 gradient accumulation (``BF16_Optimizer``): the same cut, no per-parameter
  padding, the padding kept in the saved partition.
- ZeRO 3: every parameter is cut on its own into ``world`` slices of ``ceil(numel / world)``
  elements (the last padded); a rank's flat per sub-group is its slices in ``param_shapes``
  order. Frozen parameters are sliced the same way in each rank's model-states file.
- ZeRO 0: the module state dict is whole, and the optimizer state (a torch state dict, or the
  fp16/bf16 wrapper's flat fp32 copy per group) is by position only; names come from the saved
  ``param_names``, from the loading run's own param groups, or from the module's parameter
  order when that fits one way only.

A rank's share is a list of :class:`Piece`: elements ``[a, b)`` of parameter ``name`` are
elements ``[at, at + b - a)`` of its flat number ``flat``.

A checkpoint of DeepSpeed's AutoEP (``ds_autoep_layers`` in the model-states file, ``deepspeed_autoep.py``) adds
flats of experts: each rank's holds its EP rank's block of every layer's ``w1``/``w2``/``w3``, partitioned over its
expert-data-parallel group instead of all ranks, in optimizer param groups of their own. The plan reads the flats
under DeepSpeed's names (their offsets are DeepSpeed's), and gives everything else under the model's: a share's
pieces of experts are ranges of the EP rank's block of ``gate_up_proj`` / ``down_proj`` (``name@ep<r>of<N>``), the
router and shared experts their own names, the expert groups folded back into the groups they were split from.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_zero.checkpoint.deepspeed_autoep import AutoEPError, AutoEPLayout, check_partitions, layout
from hf_zero.checkpoint.deepspeed_read import (
    DeepSpeedCheckpointError,
    Folder,
    expect_ranks,
    find,
    load_pickle,
)

# Top-level keys of DeepSpeed's model-states file that are its own; every other key is client state.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info", "num_experts", "ds_autoep_layers", "autoep_layers", "folding",
})


@dataclass
class Piece:
    name: str
    a: int
    b: int
    flat: int
    at: int


@dataclass
class Share:
    """One rank's fp32 flats, the optimizer state over each, what they hold, and its frozen slices."""

    masters: list[torch.Tensor]
    states: list[dict[str, Any]]
    pieces: list[Piece]
    frozen: list[tuple[str, int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class Plan:
    """What rank 0's files say about the whole checkpoint."""

    folder: Folder
    kind: str  # "zero12", "bf16" (BF16_Optimizer), "zero3"; ZeRO 0: "torch", "fp16_unfused", "fp16_optimizer"
    stage: int
    world: int  # data-parallel ranks that saved it
    shares: int  # rank files to convert (1 for ZeRO 0, whose state is replicated)
    compute_dtype: torch.dtype
    flats: list[list[tuple[str, tuple[int, ...], int]]]  # per flat: (name, shape, offset) in flat order
    flat_group: list[int]  # the optimizer param group each flat belongs to
    hypers: list[dict]  # each optimizer param group's hyper-parameters
    frozen: dict[str, tuple[tuple[int, ...], torch.dtype]]
    shared: dict[str, str]  # tied alias -> the name that holds the values
    model0: dict
    optim0: dict | None
    partition: list[int] = field(default_factory=list)  # ZeRO 1-2 / bf16: elements per rank in each flat
    # Saved with save_checkpoint(exclude_frozen_parameters=True): DeepSpeed then writes frozen_param_shapes as None at
    # ZeRO 2-3 (a dict, empty without frozen parameters, otherwise) and leaves the frozen values out altogether.
    frozen_excluded: bool = False
    autoep: AutoEPLayout | None = None  # DeepSpeed's AutoEP: its layout; flats and offsets stay under its names
    expert_flats: list[bool] = field(default_factory=list)  # AutoEP: which flats hold an EP rank's experts
    source: dict[str, str] = field(default_factory=dict)  # AutoEP: a frozen parameter's or buffer's DeepSpeed name

    def table(self) -> dict[str, dict[str, Any]]:
        """The trainable parameters as the converted checkpoint stores them: name -> shape, optimizer param group, and
        for an EP rank's block of a fused experts tensor (``name@ep<r>of<N>``) its cut (``deepspeed_autoep.py``)."""
        out: dict[str, dict[str, Any]] = {}
        for f, flat in enumerate(self.flats):
            for n, shape, _ in flat:
                if self.autoep is None or not self.expert_flats[f]:
                    out[self.model_name(n)] = {"shape": tuple(shape), "group": self.flat_group[f]}
                    continue
                base, whole = self.autoep.expert_names(n, tuple(shape))
                block = (whole[0] // self.autoep.size, *whole[1:])
                for r in range(self.autoep.size):
                    out[self.autoep.stored(base, r)] = {"shape": block, "group": self.flat_group[f],
                                                        **self.autoep.cut(whole, r)}
        return out

    @property
    def trainable(self) -> dict[str, tuple[int, ...]]:
        """Stored name -> shape of every trainable parameter (the model's names)."""
        return {n: v["shape"] for n, v in self.table().items()}

    def model_name(self, name: str) -> str:
        """The model's name of a trainable DeepSpeed tensor outside the experts (itself without AutoEP)."""
        if self.autoep is None:
            return name
        out = self.autoep.model_name(name)
        assert out is not None, name
        return out

    def buffer_names(self) -> list[tuple[str, str]]:
        """``(model's name, DeepSpeed's name)`` of every buffer of the module state dict."""
        names = [n for n in self.model0.get("buffer_names") or [] if torch.is_tensor(self.model0["module"].get(n))]
        if self.autoep is None:
            return [(n, n) for n in names]
        renamed = [(self.autoep.model_name(n, set(self.model0["module"])), n) for n in names]
        return [(m, n) for m, n in renamed if m is not None]


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def plan(load_dir: str, tag: str | None, order_hint: list[list[str]] | None = None) -> Plan:
    """Read rank 0's files and work out the layout; refuses what it cannot map."""
    folder = find(load_dir, tag)
    m0 = load_pickle(folder.model_files[0])
    if not isinstance(m0, dict) or "module" not in m0:
        raise DeepSpeedCheckpointError(f"{folder.model_files[0]} is not a DeepSpeed model-states file (no 'module' entry)")
    dims = m0.get("checkpoint_parallel_dimensions") or {}
    if int(m0.get("mp_world_size") or 1) != 1 or int(dims.get("tp_degree", 1)) != 1 or int(dims.get("pp_degree", 1)) != 1:
        raise DeepSpeedCheckpointError(
            f"{folder.path} was saved with tensor or pipeline parallelism (mp_world_size {m0.get('mp_world_size')}, {dims}); "
            "hf_zero converts data-parallel ZeRO checkpoints only"
        )
    world = int(m0.get("dp_world_size") or len(folder.optim_files) or 1)
    expect_ranks(folder, world)
    dtype = next((t.dtype for t in m0["module"].values() if torch.is_tensor(t) and t.is_floating_point()), torch.float32)
    frozen_shapes = m0.get("frozen_param_shapes") or {}
    shared = dict(m0.get("shared_params") or {})
    if folder.optim_files:
        o0 = load_pickle(folder.optim_files[0])
        osd = o0.get("optimizer_state_dict") if isinstance(o0, dict) else None
        if not isinstance(osd, dict):
            raise DeepSpeedCheckpointError(f"{folder.optim_files[0]} has no 'optimizer_state_dict'; it is not a DeepSpeed ZeRO optimizer file")
        p = _zero_plan(folder, m0, osd, world, dtype)
    else:
        p = _stage0_plan(folder, m0, world, dtype, order_hint)
    p.frozen_excluded = p.stage >= 2 and "frozen_param_shapes" in m0 and m0["frozen_param_shapes"] is None
    trainable = {n: s for flat in p.flats for n, s, _ in flat}  # DeepSpeed's names
    if p.kind == "zero3":  # ZeRO 3 records frozen shapes; tied aliases are in rank 0's shared_params
        p.frozen = {n: (tuple(s), dtype) for n, s in frozen_shapes.items()}
        p.shared = {k: v for k, v in shared.items() if k not in trainable and k not in p.frozen}
    else:
        params, aliases = _module_params(m0)
        p.shared = {**aliases, **{k: v for k, v in shared.items() if k not in trainable}}
        p.frozen = {n: (tuple(t.shape), t.dtype) for n, t in params if n not in trainable and n not in p.shared}
    try:
        p.autoep = layout(m0, world, p.stage, p.kind, [dict(g) for g in m0.get("param_shapes") or []])
        if p.autoep is not None:
            _autoep_plan(p)
    except AutoEPError as e:
        raise DeepSpeedCheckpointError(f"{folder.path} is a DeepSpeed AutoEP checkpoint that hf_zero cannot map: {e}") from None
    if p.autoep is None and folder.expert_files:
        raise DeepSpeedCheckpointError(
            f"{folder.path} holds mixture-of-experts files ('{os.path.basename(folder.expert_files[0])}') of DeepSpeed's own "
            "MoE layers (deepspeed.moe.layer.MoE), which hf_zero does not convert; checkpoints of AutoEP (the "
            "expert_parallel section on a transformers model) it does"
        )
    return p


def _autoep_plan(p: Plan) -> None:
    """An AutoEP checkpoint's flats of experts, their partition groups, the param groups they were split from, and the
    model's names of its frozen parameters and tied aliases (``deepspeed_autoep.py``)."""
    ep = p.autoep
    assert ep is not None
    p.expert_flats = []
    for f, flat in enumerate(p.flats):
        kinds = {ep.is_expert(n) for n, _, _ in flat}
        if len(kinds) > 1:
            raise AutoEPError(f"its optimizer flat {f} holds experts and other parameters together")
        p.expert_flats.append(kinds == {True})
        for n, shape, _ in flat if p.expert_flats[f] else ():
            ep.expert_names(n, tuple(shape))  # refuses a block that is not [E/N, I, H]
        if p.kind == "zero3" and p.expert_flats[f]:  # each expert tensor cut over its holders, not over all ranks
            at, p.flats[f] = 0, list(flat)
            for i, (n, shape, _) in enumerate(flat):
                p.flats[f][i] = (n, shape, at)
                at += math.ceil(_numel(shape) / ep.edp_size)
    if p.kind == "zero12":
        counts = (p.optim0 or {}).get("partition_count")
        if isinstance(counts, list):
            for f, c in enumerate(counts):
                want = ep.edp_size if p.expert_flats[f] else p.world
                if int(c) != want:
                    raise AutoEPError(f"its optimizer param group {f} is partitioned over {c} ranks, not the {want} its "
                                      "AutoEP layout says")
    # DeepSpeed splits every param group into its non-expert part (kept in place) and an expert part appended after
    # all of them with the same hyper-parameters ("moe": true, "name" the EP group's): folded back by those.
    dense = [g for g, h in enumerate(p.hypers) if not h.get("moe")]
    plain = [{k: v for k, v in p.hypers[g].items() if k not in ("name", "moe")} for g in range(len(p.hypers))]
    fold = {}
    for g, h in enumerate(p.hypers):
        if h.get("moe"):
            match = [d for d in dense if plain[d] == plain[g]]
            if not match:
                raise AutoEPError(f"its expert optimizer param group {g} has hyper-parameters no other group has, so the "
                                  "param group it was split from is unknown")
            fold[g] = match[0]
    keep = {g: i for i, g in enumerate(dense)}
    p.flat_group = [keep[fold.get(g, g)] for g in p.flat_group]
    p.hypers = [{k: v for k, v in p.hypers[g].items() if not (k == "name" and v == "dense-params")} for g in dense]
    held = set(p.model0["module"]) | {n for flat in p.flats for n, _, _ in flat}
    frozen, p.source = {}, {}
    for n, v in p.frozen.items():
        m = ep.model_name(n, held)
        if m is not None:
            frozen[m], p.source[m] = v, n
    p.frozen = frozen
    shared = {}
    for k, v in p.shared.items():
        mk, mv = ep.model_name(k, held), ep.model_name(v, held)
        if mk is not None and mv is not None:
            shared[mk] = mv
    p.shared = shared


def _zero_plan(folder: Folder, m0: dict, osd: dict, world: int, dtype: torch.dtype) -> Plan:
    shapes = m0.get("param_shapes")
    if not shapes:
        raise DeepSpeedCheckpointError(f"{folder.model_files[0]} has no 'param_shapes'; the ZeRO partitions cannot be mapped to names")
    groups = [list(g.items()) for g in shapes]
    if "zero_stage" in osd and int(osd["zero_stage"]) == 3:
        inner = osd["optimizer_state_dict"]
        owner = {int(i): g for g, pg in enumerate(inner["param_groups"]) for i in pg["params"]}
        if sorted(owner) != list(range(len(groups))):
            raise DeepSpeedCheckpointError(
                f"{folder.optim_files[0]} has {len(owner)} optimizer flats for {len(groups)} parameter sub-groups; "
                "the checkpoint is damaged or from an unsupported DeepSpeed layout"
            )
        counts = osd.get("partition_count")
        counts = set(counts) if isinstance(counts, list) else {int(counts)}
        if counts != {world}:
            raise DeepSpeedCheckpointError(
                f"{folder.path} partitions ZeRO-3 state over {sorted(counts)} ranks, not its data-parallel world of {world} "
                "(MiCS or hierarchical partitioning); hf_zero converts plain ZeRO-3 checkpoints only"
            )
        flats = []
        for g in groups:
            at, flat = 0, []
            for n, s in g:
                flat.append((n, tuple(s), at))
                at += math.ceil(_numel(s) / world)
            flats.append(flat)
        hypers = [{k: v for k, v in pg.items() if k != "params"} for pg in inner["param_groups"]]
        return Plan(folder, "zero3", 3, world, world, dtype, flats, [owner[k] for k in range(len(groups))], hypers, {},
                    {}, m0, osd)
    if "single_partition_of_fp32_groups" not in osd:
        raise DeepSpeedCheckpointError(f"{folder.optim_files[0]} is not a ZeRO optimizer file DeepSpeed 0.x writes (no fp32 partitions)")
    base = osd["base_optimizer_state"]
    if isinstance(base, list):
        raise DeepSpeedCheckpointError(
            f"{folder.path} was saved with zero_optimization.elastic_checkpoint, whose optimizer hyper-parameters are not "
            "stored; save it again with elastic_checkpoint off (DeepSpeed's default) and convert that"
        )
    kind = "zero12" if "zero_stage" in osd else "bf16"
    stage = int(osd["zero_stage"]) if kind == "zero12" else int(((m0.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 1))
    pads = osd.get("param_alignment_paddings") if kind == "zero12" else None
    flats = []
    for gi, g in enumerate(groups):
        at, flat = 0, []
        for pi, (n, s) in enumerate(g):
            flat.append((n, tuple(s), at))
            at += _numel(s) + (int(pads[gi][pi]) if pads else 0)
        flats.append(flat)
    parts = osd["single_partition_of_fp32_groups"]
    gpads = osd.get("group_paddings") or [0] * len(parts)
    partition = [int(t.numel()) + (int(gp) if kind == "zero12" else 0) for t, gp in zip(parts, gpads)]
    if len(parts) != len(groups) or len(base["param_groups"]) != len(groups):
        raise DeepSpeedCheckpointError(
            f"{folder.optim_files[0]} has {len(parts)} fp32 partitions for {len(groups)} parameter groups; the checkpoint is damaged"
        )
    hypers = [{k: v for k, v in pg.items() if k != "params"} for pg in base["param_groups"]]
    return Plan(folder, kind, stage, world, world, dtype, flats, list(range(len(groups))), hypers, {}, {}, m0, osd,
                partition)


def read_share(p: Plan, rank: int) -> Share:
    """Rank ``rank``'s fp32 flats, optimizer state and frozen slices, with what each holds."""
    if p.stage == 0 and p.kind != "bf16":
        return _stage0_share(p)
    osd = p.optim0 if rank == 0 else load_pickle(p.folder.optim_files[rank]).get("optimizer_state_dict")
    where = p.folder.optim_files[rank]
    if not isinstance(osd, dict):
        raise DeepSpeedCheckpointError(f"{where} has no 'optimizer_state_dict'; it is not a DeepSpeed ZeRO optimizer file")
    if p.kind == "zero3":
        masters = list(osd["fp32_flat_groups"])
        inner = osd["optimizer_state_dict"]
        states = [inner["state"].get(k, inner["state"].get(str(k), {})) for k in range(len(masters))]
        if p.autoep is not None:
            try:
                check_partitions(osd, p.autoep, rank, p.expert_flats, where)
            except AutoEPError as e:
                raise DeepSpeedCheckpointError(str(e)) from None
        pieces, frozen = [], []
        for k, flat in enumerate(p.flats):
            count, part = _partition(p, k, rank)
            for n, s, at in flat:
                c = math.ceil(_numel(s) / count)
                a, b = part * c, min(_numel(s), (part + 1) * c)
                if a < b:
                    pieces.append(Piece(n, a, b, k, at))
            if masters[k].numel() != sum(math.ceil(_numel(s) / count) for _, s, _ in flat):
                raise DeepSpeedCheckpointError(f"{where}: fp32 flat {k} has {masters[k].numel()} elements, not what "
                                               "its parameters' ZeRO-3 slices add up to; the checkpoint is damaged")
        model = p.model0 if rank == 0 else load_pickle(p.folder.model_files[rank])
        fragments = model.get("frozen_param_fragments") or {}
        for n, (shape, _) in p.frozen.items():
            c = math.ceil(_numel(shape) / p.world)
            a, b = rank * c, min(_numel(shape), (rank + 1) * c)
            if a < b:
                src = p.source.get(n, n)
                if src not in fragments:
                    raise DeepSpeedCheckpointError(f"{p.folder.model_files[rank]} lacks its slice of the frozen parameter '{src}'")
                frozen.append((n, a, b, fragments[src].reshape(-1)[: b - a]))
        return Share(masters, states, _model_pieces(p, rank, pieces), frozen)
    masters = list(osd["single_partition_of_fp32_groups"])
    base = osd["base_optimizer_state"]
    states = [base["state"].get(int(pg["params"][0]), {}) for pg in base["param_groups"]]
    pieces = []
    for g, flat in enumerate(p.flats):
        part = _partition(p, g, rank)[1]
        lo, hi = part * p.partition[g], (part + 1) * p.partition[g]
        for n, s, off in flat:
            x, y = max(off, lo), min(off + _numel(s), hi)
            if x < y:
                if y - lo > masters[g].numel():
                    raise DeepSpeedCheckpointError(f"{where}: partition {g} ends before parameter '{n}' does; the checkpoint is damaged")
                pieces.append(Piece(n, x - off, y - off, g, x - lo))
    frozen = []
    if rank == 0:
        frozen = _whole_frozen(p)
    return Share(masters, states, _model_pieces(p, rank, pieces), frozen)


def _partition(p: Plan, flat: int, rank: int) -> tuple[int, int]:
    """``(partitions, this rank's)`` of a flat: over all ranks, or for AutoEP's experts over the ranks holding them."""
    if p.autoep is not None and p.expert_flats[flat]:
        return p.autoep.edp_size, p.autoep.edp_rank(rank)
    return p.world, rank


def _model_pieces(p: Plan, rank: int, pieces: list[Piece]) -> list[Piece]:
    """A share's pieces under the model's names: AutoEP's expert ranges as ranges of this rank's EP block of the fused
    tensors (``w1``/``w3`` cut at expert boundaries), its router and shared experts renamed; the rest as they are."""
    ep = p.autoep
    if ep is None:
        return pieces
    out = []
    shapes = {n: tuple(s) for flat in p.flats for n, s, _ in flat}
    for pc in pieces:
        if not p.expert_flats[pc.flat]:
            out.append(Piece(p.model_name(pc.name), pc.a, pc.b, pc.flat, pc.at))
            continue
        base, _ = ep.expert_names(pc.name, shapes[pc.name])
        name = ep.stored(base, ep.ep_rank(rank))
        out += [Piece(name, x, y, pc.flat, pc.at + off) for x, y, off in ep.expert_ranges(pc.name, shapes[pc.name], pc.a, pc.b)]
    return out


def _whole_frozen(p: Plan) -> list[tuple[str, int, int, torch.Tensor]]:
    """ZeRO 0-2: frozen parameters whole, from the module state dict or ZeRO 2's fragments."""
    fragments = p.model0.get("frozen_param_fragments") or {}
    module = p.model0["module"]
    out = []
    for n, (shape, _) in p.frozen.items():
        src = p.source.get(n, n)
        t = fragments.get(src, module.get(src))
        if t is None:
            raise DeepSpeedCheckpointError(f"{p.folder.model_files[0]} has no values for the frozen parameter '{n}'")
        out.append((n, 0, _numel(shape), t.reshape(-1)))
    return out


# --------------------------------------------------------------------------------------- ZeRO 0


def _module_params(m0: dict) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """The module's parameters in order (its state dict without buffers), and tied repeats -> the first name.

    ``torch.save`` keeps storage sharing, so a tied weight saved under two names reads back as
    one storage.
    """
    buffers = set(m0.get("buffer_names") or [])
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out, aliases = [], {}
    for n, t in m0["module"].items():
        if n in buffers or not torch.is_tensor(t):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen and t.numel() > 0:
            aliases[n] = seen[key]
            continue
        seen[key] = n
        out.append((n, t))
    return out, aliases


_PER_PARAM = ("torch", "fp16_unfused")  # ZeRO 0 kinds whose optimizer holds one tensor per parameter


def _stage0_plan(folder: Folder, m0: dict, world: int, dtype: torch.dtype, hint: list[list[str]] | None) -> Plan:
    """ZeRO 0: a torch optimizer state dict, or DeepSpeed's fp16/bf16 wrapper (fp32 copies per parameter or per group)."""
    opt = m0.get("optimizer")
    if not isinstance(opt, dict):
        raise DeepSpeedCheckpointError(
            f"{folder.path} has no optimizer state (no *_optim_states.pt files and no 'optimizer' entry in "
            f"{folder.model_files[0]}); it was saved without an optimizer"
        )
    kind = "fp16_optimizer" if "fp32_groups_flat" in opt else "fp16_unfused" if "fp32_groups" in opt else "torch"
    inner = opt if kind == "torch" else opt.get("optimizer_state_dict")
    if not isinstance(inner, dict) or "param_groups" not in inner:
        raise DeepSpeedCheckpointError(f"{folder.model_files[0]}: its 'optimizer' entry is not an optimizer state dict")
    params, _ = _module_params(m0)
    if kind == "torch":
        sizes = [[_state_numel(inner["state"], i) for i in pg["params"]] for pg in inner["param_groups"]]
    elif kind == "fp16_unfused":
        sizes = [[int(t.numel()) for t in g] for g in opt["fp32_groups"]]
    else:
        sizes = [[int(t.numel())] for t in opt["fp32_groups_flat"]]
    names = _stage0_names(folder, kind, inner["param_groups"], sizes, params, hint)
    shape = dict(params)
    flats = []
    for g in names:
        at, flat = 0, []
        for n in g:
            flat.append((n, tuple(shape[n].shape), 0 if kind in _PER_PARAM else at))
            at += shape[n].numel()
        flats.append(flat)
    if kind in _PER_PARAM:  # one flat per parameter
        flat_group = [g for g, names_g in enumerate(names) for _ in names_g]
        flats = [[f] for flat in flats for f in flat]
    else:
        flat_group = list(range(len(names)))
    hypers = [{k: v for k, v in pg.items() if k not in ("params", "param_names")} for pg in inner["param_groups"]]
    return Plan(folder, kind, 0, world, 1, dtype, flats, flat_group, hypers, {}, {}, m0, opt)


def _stage0_names(folder: Folder, kind: str, groups: list[dict], sizes: list[list[int | None]], params: list,
                  hint: list[list[str]] | None) -> list[list[str]]:
    """Which parameter each position of a ZeRO-0 optimizer state is, or a refusal if that cannot be known.

    Tried in order: the names torch saved with the param groups; the loading run's own groups
    (``hint``); with one group, the module's parameters in order, or the only subsequence of
    them whose sizes fit. A candidate must match every recorded size.
    """
    shapes = dict(params)
    candidates: list[list[list[str]]] = []
    if all("param_names" in pg for pg in groups):
        candidates.append([list(pg["param_names"]) for pg in groups])
    if hint is not None and len(hint) == len(groups):
        candidates.append([list(g) for g in hint])
    if len(groups) == 1:
        candidates += _unique_embedding(params, sizes[0], kind)
    for names in candidates:
        if all(n in shapes for g in names for n in g) and _fits(names, sizes, shapes, kind):
            return names
    raise DeepSpeedCheckpointError(
        f"{folder.model_files[0]} is a ZeRO-0 checkpoint whose optimizer state is stored by position only, and which "
        "parameter each position holds cannot be worked out from it; load it with engine.load_checkpoint in a run whose "
        "optimizer has the same param groups in the same order"
    )


def _state_numel(state: dict, i: int) -> int | None:
    st = state.get(i, state.get(str(i)))
    t = next((v for v in (st or {}).values() if torch.is_tensor(v) and v.dim() > 0), None)
    return None if t is None else int(t.numel())


def _fits(names: list[list[str]], sizes: list[list[int | None]], shapes: dict, kind: str) -> bool:
    if len(names) != len(sizes):
        return False
    if kind in _PER_PARAM:
        return all(len(g) == len(s) and all(z is None or z == shapes[n].numel() for n, z in zip(g, s))
                   for g, s in zip(names, sizes))
    return all(sum(shapes[n].numel() for n in g) == s[0] for g, s in zip(names, sizes))


def _unique_embedding(params: list[tuple[str, torch.Tensor]], sizes: list[int | None], kind: str) -> list[list[list[str]]]:
    """One group: the module's parameters in order, or the only subsequence of them whose sizes fit."""
    if kind not in _PER_PARAM:
        return [[[n for n, _ in params]]]
    if len(sizes) == len(params):
        return [[[n for n, _ in params]]]
    if any(z is None for z in sizes):
        return []
    numel = [t.numel() for _, t in params]
    m, k = len(numel), len(sizes)
    ways = [[0] * (k + 1) for _ in range(m + 1)]  # ways[i][j]: embeddings of sizes[j:] into params[i:]
    for i in range(m + 1):
        ways[i][k] = 1
    for i in range(m - 1, -1, -1):
        for j in range(k - 1, -1, -1):
            ways[i][j] = min(2, ways[i + 1][j] + (ways[i + 1][j + 1] if numel[i] == sizes[j] else 0))
    if ways[0][0] != 1:
        return []
    out, i = [], 0
    for j in range(k):
        while not (numel[i] == sizes[j] and ways[i + 1][j + 1] == 1):
            i += 1
        out.append(params[i][0])
        i += 1
    return [[out]]


def _stage0_share(p: Plan) -> Share:
    module = p.model0["module"]
    opt = p.optim0 or {}
    inner = opt if p.kind == "torch" else opt["optimizer_state_dict"]
    order = [int(i) for pg in inner["param_groups"] for i in pg["params"]]  # torch's numbering, group by group
    state = inner["state"]
    if p.kind in _PER_PARAM:
        if p.kind == "torch":
            masters = [module[flat[0][0]].reshape(-1).float() for flat in p.flats]
        else:
            masters = [t.reshape(-1) for g in opt["fp32_groups"] for t in g]
        states = [state.get(i, state.get(str(i), {})) for i in order]
        states = [{k: (v.reshape(-1) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in st.items()} for st in states]
    else:
        masters = [t.reshape(-1) for t in opt["fp32_groups_flat"]]
        states = [state.get(i, {}) for i in order]
    pieces = [Piece(n, 0, math.prod(s), f, at) for f, flat in enumerate(p.flats) for n, s, at in flat]
    return Share(masters, states, pieces, _whole_frozen(p))
