"""Tensor parallelism (DeepSpeed's AutoTP training, ``"tensor_parallel": {"autotp_size": N}``): ``world = dp x tp``.

Ranks ``k*N .. k*N+N-1`` form tensor-parallel group ``k``; they hold different slices of the same
linear layers and work on the same samples. The ranks at the same position of their groups form a
data-parallel group, and ZeRO (stages 0-2) shards and reduces over that group only: every rank of
it holds the same slices.

Which layers are split, and how, is the model's own plan (``config.base_model_tp_plan``, the table
transformers' own tensor parallelism reads): a ``"colwise"`` linear layer keeps rows
``[r*out/N, (r+1)*out/N)`` of its weight (and its bias), so it computes its slice of the output
features from the whole input; the gradient of that input is the sum of every rank's part, an
all-reduce over the group in backward. A ``"rowwise"`` layer keeps the matching columns, takes
the sliced features the colwise layers before it produced, and its output is the sum of the
ranks' partial products: an all-reduce in forward, then the bias once. In a transformers block
that is Megatron's split: q/k/v and gate/up colwise, o/down rowwise, so attention runs on
``heads / N`` local heads (transformers' attention reshapes with ``-1`` heads) with one
all-reduce per sub-layer forward and backward. Everything else (embeddings, norms, the LM head)
stays whole on every rank and, since its inputs and output gradients are the same on every rank
of the group, gets the same gradient there.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_zero.errors import ConfigError, UsageError
from hf_zero.parallel import GridShape, ParallelGrid, grid_for
from hf_zero.parallel.grid import AXES, device_type_of_default_group
from hf_zero.parallel.tp_split import TPSplit, mark
from hf_zero.training import peft_model as hz_peft
from hf_zero.training.module_setup import broadcast_module, move_to_device
from hf_zero.zero.preshard import is_presharded

logger = logging.getLogger("hf_zero")

SPLIT_STYLES = {"colwise": 0, "local_colwise": 0, "rowwise": 1, "local_rowwise": 1}  # style -> the weight's split dim


@dataclass(frozen=True)
class TensorParallelGroups:
    """This rank's place in the ``dp x tp`` grid; ``parent`` is the group of the ranks holding the same layers, which
    the split starts from (None: the world; under a pipeline, the stage's ranks). ``dp_group`` (what ZeRO shards
    over) is a group even when it holds this rank alone."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup
    parent: dist.ProcessGroup | None
    tp_ranks: tuple[int, ...]


def view_of(grid: ParallelGrid) -> TensorParallelGroups | None:
    """The ``tp`` axis of the run's grid (:mod:`hf_zero.parallel.grid`) as this rank sees it; None when it is 1.

    Consecutive ranks share a group (``tp`` is the grid's innermost axis) so that, with one process per GPU, the
    per-layer all-reduces stay inside a node. ZeRO shards over the ranks holding the same slices (the grid's ZeRO
    group), a group even when it holds this rank alone.
    """
    tp = grid.size("tp")
    if tp == 1:
        return None
    tp_group = grid.group("tp")
    # the ranks holding the same layers: the world, or under a pipeline this rank's stage (every axis but pp)
    parent = grid.group(*(a for a in AXES if a != "pp"))
    return TensorParallelGroups(tp_size=tp, tp_rank=grid.rank("tp"), tp_group=dist.group.WORLD if tp_group is None else tp_group,
                                dp_size=grid.zero_size, dp_rank=grid.zero_rank, dp_group=grid.zero_group or dist.group.WORLD,
                                parent=parent, tp_ranks=grid.ranks("tp"))


def make_groups(tp_size: int, group: dist.ProcessGroup | None = None) -> TensorParallelGroups:
    """The ``dp x tp`` view of a grid of the whole world with ``tp_size`` consecutive ranks per tensor-parallel group."""
    if group is not None:
        raise ConfigError("tensor parallelism is cut from the whole world's grid; leave make_groups(group=...) unset")
    n = dist.get_world_size()
    if n % tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size: got {tp_size}, which does not divide the {n} ranks of this run; "
                          f"launch a multiple of {tp_size} processes or choose a divisor of {n}")
    view = view_of(grid_for(GridShape.fill(n, tp=tp_size), device_type_of_default_group()))
    if view is None:
        raise ConfigError(f"tensor_parallel.autotp_size: got {tp_size}; a tensor-parallel view needs a degree above 1")
    return view


def degree_of(config: Any) -> int:
    """``tensor_parallel.autotp_size`` of a raw (checked) config dict; 1 without one."""
    section = (config or {}).get("tensor_parallel") if isinstance(config, dict) else None
    size = (section or {}).get("autotp_size") if isinstance(section, dict) else None
    return size if isinstance(size, int) and size > 1 else 1


def data_parallel_place(tp_size: int, rank: int, world: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of global ``rank`` in a world of ``world`` ranks, for loaders built before the groups."""
    return rank // tp_size, max(world // tp_size, 1)


# ------------------------------------------------------------------ the two collectives


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the group (before a colwise layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """Forward sums the ranks' partial outputs over the group (after a rowwise layer); identity backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _colwise_forward(module: torch.nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    return F.linear(_CopyToGroup.apply(x, group), module.weight, module.bias)


def _rowwise_forward(module: torch.nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    y = _SumOverGroup.apply(F.linear(x, module.weight), group)
    return y if module.bias is None else y + module.bias


# ------------------------------------------------------------------ the plan


def _pattern(key: str) -> re.Pattern:
    """A plan key (``layers.*.self_attn.q_proj``) as a regex over module names: ``*`` is one name component."""
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def _plan_of(model: torch.nn.Module, tp: int) -> tuple[torch.nn.Module, dict[str, str]]:
    """The base model and its tensor-parallel plan, or one sentence saying why this model cannot be split."""
    what = f"tensor_parallel.autotp_size: got {tp}, but"
    if hz_peft.is_peft_model(model):
        raise UsageError(f"{what} tensor parallelism of a peft model is not supported yet; train the adapters with "
                         "autotp_size 1 (ZeRO alone)")
    if any(is_presharded(p) for p in model.parameters()):
        raise UsageError(f"{what} a model built under zero.Init cannot be split yet; build it without zero.Init")
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", None)
    if base is None:  # a pipeline stage of a transformers model (split_causal_lm) names its base model's path
        prefix = getattr(model, "base_model_prefix", None)
        base = model._modules.get(prefix, torch.nn.Module()) if isinstance(prefix, str) else model
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise UsageError(f"{what} {type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan), which "
                         "says which linear layers to split; use a model that has one (Llama, Qwen2, Mistral, Gemma, ...) "
                         "or autotp_size 1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, key, None)
        if isinstance(heads, int) and heads % tp:
            raise UsageError(f"{what} the model's {key} is {heads}, which {tp} does not divide; each rank must hold whole "
                             f"heads, so choose an autotp_size that divides {heads}")
    return base, plan


def planned_layers(base: torch.nn.Module, plan: dict[str, str]) -> list[tuple[str, torch.nn.Module, str, str]]:
    """``(module name, module, plan key, style)`` of every module of ``base`` that a key of ``plan`` names, first key
    that matches; what :func:`apply` splits, and what ``hf-zero plan`` counts the tensor-parallel all-reduces of."""
    matchers = [(_pattern(k), k, style) for k, style in plan.items()]
    picked: list[tuple[str, torch.nn.Module, str, str]] = []
    for name, mod in base.named_modules():
        for rx, key, style in matchers:
            if rx.match(name):
                picked.append((name, mod, key, style))
                break
    return picked


def apply(model: torch.nn.Module, groups: TensorParallelGroups, device: torch.device) -> int:
    """Split ``model``'s linear layers by its plan, in place; returns how many were split.

    Every rank of ``groups.parent`` calls this before the engine exists: the whole model is first
    made the same on every rank (rank 0's weights), then each rank keeps its slices. The
    parameters stay the same objects (their data is replaced), so an optimizer already built on
    them stays valid.
    """
    tp, r = groups.tp_size, groups.tp_rank
    base, plan = _plan_of(model, tp)
    picked = planned_layers(base, plan)
    for name, mod, key, style in picked:
        if style not in SPLIT_STYLES:
            raise UsageError(f"tensor_parallel.autotp_size: {type(model).__name__}'s plan splits '{key}' as '{style}', "
                             "which hf_zero does not run yet (it runs 'colwise' and 'rowwise'); use autotp_size 1")
        if type(mod) is not torch.nn.Linear:
            raise UsageError(f"tensor_parallel.autotp_size: the plan splits '{name}', a {type(mod).__name__}, and hf_zero "
                             "splits torch.nn.Linear layers only; use autotp_size 1")
        dim = SPLIT_STYLES[style]
        if mod.weight.shape[dim] % tp:
            raise UsageError(f"tensor_parallel.autotp_size: '{name}' has {mod.weight.shape[dim]} "
                             f"{'output' if dim == 0 else 'input'} features, which {tp} does not divide; choose an "
                             "autotp_size that divides it")
    split_ids = {id(p) for _, mod, _, _ in picked for p in mod.parameters(recurse=False)}
    picked_ids = {id(mod) for _, mod, _, _ in picked}
    shared = [n for n, m in model.named_modules()
              if id(m) not in picked_ids and any(id(p) in split_ids for p in m.parameters(recurse=False))]
    if shared:
        raise UsageError(f"tensor_parallel.autotp_size: a weight the plan splits is shared with '{shared[0]}'; untie it "
                         "or use autotp_size 1")
    move_to_device(model, device)
    broadcast_module(model, groups.parent)  # every slice is cut from the same whole weights
    with torch.no_grad():
        for _, mod, _, style in picked:
            dim = SPLIT_STYLES[style]
            for pname, p in list(mod.named_parameters(recurse=False)):
                if pname == "bias" and dim == 1:
                    continue  # a rowwise layer adds its whole bias once, after the sum
                full = tuple(p.shape)
                n = full[0 if pname == "bias" else dim] // tp
                p.data = p.data.narrow(0 if pname == "bias" else dim, r * n, n).clone()
                mark(p, TPSplit(dim=0 if pname == "bias" else dim, rank=r, size=tp, full_shape=full))
            if dim == 0:
                mod.out_features //= tp
                mod.forward = functools.partial(_colwise_forward, mod, groups.tp_group)
            else:
                mod.in_features //= tp
                mod.forward = functools.partial(_rowwise_forward, mod, groups.tp_group)
    _check_inputs_once(model, groups)
    return len(picked)


def _check_inputs_once(model: torch.nn.Module, groups: TensorParallelGroups) -> None:
    """On the first forward, check that the ranks of each tensor-parallel group got the same batch.

    They must (their slices compute parts of one result); hf_zero's loaders and Trainer make sure of
    it, a script's own loader may not. Every rank of the group compares, and all raise the same sentence.
    """
    handle: list[Any] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        handle[0].remove()
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        device = next(module.parameters()).device
        mine = torch.stack([t.detach().double().sum() for t in tensors]).sum() if tensors else torch.zeros((), dtype=torch.float64)
        both = torch.stack([mine, -mine]).to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=groups.tp_group)
        if float(both[0]) != -float(both[1]):
            raise UsageError(f"tensor parallelism: the ranks of tensor-parallel group {list(groups.tp_ranks)} got different "
                             "batches; every rank of a group must get the same one (hf_zero's loaders and Trainer "
                             "shard data over the data-parallel ranks only: use them, or give your loader "
                             "num_replicas=dp size and rank=global rank // autotp_size)")

    handle.append(model.register_forward_pre_hook(hook, with_kwargs=True))


def setup(model: torch.nn.Module, config: Any, grid: ParallelGrid, device: torch.device) -> TensorParallelGroups | None:
    """The split for the grid's ``tp`` axis (``config.tensor_parallel_size``); None when it is 1."""
    groups = view_of(grid)
    if groups is None:
        return None
    count = apply(model, groups, device)
    if dist.get_rank() == 0:
        logger.info("tensor parallelism: degree %d (data-parallel %d), %d linear layers split by %s's plan",
                    groups.tp_size, groups.dp_size, count, type(model).__name__)
    return groups
