"""Turning a transformers MoE model's experts into expert-parallel ones, in place, before the engine exists.

transformers 5 keeps each MoE layer's experts in one module of 3-D parameters (``MixtralExperts``,
``Qwen3MoeExperts``, ``DeepseekV3Experts``, ``GptOssExperts``, ...: every class its ``use_experts_implementation``
decorates), called as ``experts(hidden_states, top_k_index, top_k_weights)`` by the model's MoE block after the
model's own router. Only that module changes: its parameters keep this rank's ``E / N`` experts (the same parameter
objects, so an optimizer already built on them stays valid, and the same names), its ``num_experts`` says so, and
its forward sends the pairs through ``hf_zero/expert/dispatch.py`` and runs the received ones with the class's own
forward (or transformers' grouped GEMM, ``use_grouped_mm``). The router, the aux loss and shared experts are the
model's code, untouched.

PEFT's LoRA on the fused experts (``LoraConfig(target_parameters=["experts.gate_up_proj", ...])``, ``ParamWrapper``
layers around the experts module) is split with them: each rank keeps its experts' factors, in PEFT's layout for its
local experts, so PEFT's own forward merges the delta of the local experts into the local block
(:func:`_split_adapters`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.config.schema import EXPERT_PRESETS
from hf_zero.errors import ConfigError, UsageError
from hf_zero.expert.dispatch import dispatch_combine
from hf_zero.expert.groups import ExpertGroups, expert_groups
from hf_zero.expert.slices import ExpertSlice
from hf_zero.expert.slices import mark as mark_slice
from hf_zero.parallel import ParallelGrid
from hf_zero.parallel.tp_split import TPSplit, cut, mark_expert_cut
from hf_zero.training.module_setup import broadcast_module, move_to_device
from hf_zero.zero.attach import mark_synced_generation
from hf_zero.zero.group import SubGroup, mark_subgroup
from hf_zero.zero.preshard import full_shape, is_presharded, materialize_

logger = logging.getLogger("hf_zero")

ATTR = "hf_zero_ep"  # on an expert-parallel experts module: its ExpertShard


class ExpertShard:
    """What an experts module holds after the split: experts ``[first, first + local)`` of ``total``."""

    def __init__(self, first: int, local: int, total: int, groups: ExpertGroups, use_grouped_mm: bool,
                 names: list[str]) -> None:
        self.first, self.local, self.total, self.groups, self.use_grouped_mm = first, local, total, groups, use_grouped_mm
        self.names = names  # the module's own parameters (read by name: PEFT's LoRA parametrizes them in its forward)


def is_experts_module(module: torch.nn.Module) -> bool:
    """A transformers fused experts module: decorated by ``use_experts_implementation`` (which sets
    ``_is_expert_parallel``), with ``num_experts`` and every parameter stacked per expert along dim 0."""
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    shapes = [full_shape(p) for p in params]  # a zero.Init parameter's data is empty: its whole shape is kept apart
    return (hasattr(module, "_is_expert_parallel") and isinstance(n, int) and bool(params)
            and all(len(s) >= 2 and s[0] == n for s in shapes))


def find_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every fused experts module of ``model``, by name."""
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m) or hasattr(m, ATTR)]


def _model_config(model: torch.nn.Module) -> Any:
    return getattr(model, "config", None)


def _check(model: torch.nn.Module, cfg: Any, grid: ParallelGrid, found: list[tuple[str, torch.nn.Module]]) -> None:
    """Everything the section, the world and the model must agree on, one sentence each, before anything changes."""
    ep, world = cfg.expert_parallel, dist.get_world_size()
    if world % ep.size:
        raise ConfigError(f"expert_parallel.autoep_size: got {ep.size}, which does not divide the world size {world}; "
                          "choose a divisor of it")
    for axis, what in (("pp", "a pipeline"), ("tp", "tensor_parallel.autotp_size"), ("sp", "sequence_parallel_size")):
        if grid.size(axis) > 1:
            raise ConfigError(f"expert_parallel.autoep_size: got {ep.size} together with {what} ({axis} "
                              f"{grid.size(axis)}), which hf_zero does not combine with expert parallelism yet; use one")
    if grid.hybrid:
        raise ConfigError(f"expert_parallel.autoep_size: got {ep.size} together with hybrid sharding "
                          "(zero_optimization.mics_shard_size), which hf_zero does not combine yet; remove one")
    if cfg.compile.enabled:
        raise ConfigError('expert_parallel: compiled blocks cannot hold the experts\' all-to-all yet; set "compile": '
                          '{"enabled": false} or disable expert_parallel')
    name = type(model).__name__
    if not found:
        raise UsageError(f"expert_parallel is enabled but {name} has no transformers experts module (a class decorated "
                         "by use_experts_implementation, such as MixtralExperts); disable the section for this model")
    mc = _model_config(model)
    model_type = getattr(mc, "model_type", None)
    if ep.preset_model is not None and model_type not in EXPERT_PRESETS[ep.preset_model]:
        raise ConfigError(f"expert_parallel.preset_model: got '{ep.preset_model}', but the model's model_type is "
                          f"'{model_type}' (the preset covers {', '.join(EXPERT_PRESETS[ep.preset_model])}); remove "
                          "preset_model or name the model's family")
    top_k = getattr(mc, "num_experts_per_tok", None)
    if ep.top_k is not None and top_k is not None and ep.top_k != top_k:
        raise ConfigError(f"expert_parallel.top_k: got {ep.top_k}, but the model routes each token to its "
                          f"num_experts_per_tok = {top_k} experts with its own router; remove top_k or set it to {top_k}")
    for mname, m in found:
        _check_adapters(model, mname, m)
        if hasattr(m, ATTR):
            raise UsageError(f"'{mname}' is already split for expert parallelism (the model went through initialize "
                             "before); build the model again for a second engine")
        if m.num_experts % ep.size:
            raise ConfigError(f"expert_parallel.autoep_size: got {ep.size}, which does not divide the {m.num_experts} "
                              f"experts of '{mname}'; choose a divisor of {m.num_experts}")
        if any(p.is_meta and not is_presharded(p) for p in m.parameters()):
            raise UsageError(f"expert_parallel: '{mname}' has parameters on the meta device; load real weights first")


def adapter_wrappers(model: torch.nn.Module, mname: str) -> list[tuple[str, torch.nn.Module]]:
    """PEFT's parameter-targeted LoRA layers around the experts module ``mname``, by name, outermost first.

    ``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])`` wraps the experts module in one
    ``ParamWrapper`` per targeted parameter, nested through ``base_layer`` (``mlp.experts.base_layer.base_layer`` is
    then the experts module itself); each wraps one fused parameter and holds its adapters.
    """
    parts, out = mname.split("."), []
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] != "base_layer":
            break
        name = ".".join(parts[:i])
        wrapper = model.get_submodule(name)
        if hasattr(wrapper, "lora_A") and hasattr(wrapper, "parameter_name"):
            out.append((name, wrapper))
    return out[::-1]


def _check_adapters(model: torch.nn.Module, mname: str, experts: torch.nn.Module) -> None:
    """What PEFT's adapters on the experts must be for each EP rank to keep its experts' factors alone: per expert
    (PEFT's ``num_experts`` equal to the module's; a 2-D per-expert tensor such as gpt-oss's biases gets one matrix
    shared by every expert) and nothing but ``lora_A`` / ``lora_B`` weights (PEFT's ParamWrapper already refuses
    dropout, DoRA and LoRA biases)."""
    for wname, w in adapter_wrappers(model, mname):
        if getattr(w, "num_experts", None) != experts.num_experts:
            raise UsageError(f"expert_parallel: the LoRA of '{wname}' on {w.parameter_name!r} has factors shared by "
                             f"all {experts.num_experts} experts (PEFT reads that tensor as one matrix), which EP ranks "
                             "cannot split; target only the 3-D expert weights in target_parameters")
        other = [n for n, _ in w.named_parameters() if not n.startswith("base_layer.")
                 and not (n.startswith(("lora_A.", "lora_B.")) and n.endswith(".weight"))]
        if other:
            raise UsageError(f"expert_parallel: '{wname}.{other[0]}' is an adapter tensor hf_zero does not know how "
                             "to split over EP ranks (it splits lora_A and lora_B of a LoRA); use a plain LoRA on "
                             "the experts or disable expert_parallel")


def _split_adapters(model: torch.nn.Module, mname: str, where: ExpertSlice, groups: ExpertGroups,
                    sub: SubGroup) -> None:
    """Keep this rank's experts' factors of every PEFT adapter on the experts module ``mname``, in PEFT's own layout
    for ``where.local`` experts, so PEFT's ParamWrapper merges a delta for the local experts only into the local block.

    PEFT (``peft/tuners/lora/layer.py``, ``ParamWrapper.get_delta_factors``) reads ``lora_A`` ``(r*E, in)`` as
    ``(E, r, in)`` (expert ``e``'s rows ``[e*r, (e+1)*r)``) and ``lora_B`` ``(out, r*E)`` as ``(out, r, E)`` (expert
    ``e``'s columns ``e, E+e, ...``): the rank keeps the block of those views' experts axis and the wrapper's
    ``num_experts`` becomes the local count. The factors are then marked as the experts are: sharded by ZeRO over the
    expert-data-parallel group, stored per EP rank, gathered whole for ``save_pretrained``.
    """
    total, local = where.total, where.local
    for _, w in adapter_wrappers(model, mname):
        for adapter in list(w.lora_A):
            a, b = w.lora_A[adapter], w.lora_B[adapter]
            r = a.weight.shape[0] // total
            _cut_adapter(a.weight, (total, r, a.weight.shape[1]), 0, (r * local, a.weight.shape[1]), where, groups, sub)
            _cut_adapter(b.weight, (b.weight.shape[0], r, total), 2, (b.weight.shape[0], r * local), where, groups, sub)
            a.out_features = b.in_features = r * local
        w.num_experts = local


def _cut_adapter(p: torch.Tensor, view: tuple[int, ...], dim: int, local_shape: tuple[int, ...], where: ExpertSlice,
                 groups: ExpertGroups, sub: SubGroup) -> None:
    shape = tuple(p.shape)
    mark_expert_cut(p, TPSplit(dim, groups.ep_rank, groups.ep_size, shape, view))
    p.data = cut(p.data, dim, groups.ep_rank, groups.ep_size, view).reshape(local_shape).clone()
    mark_subgroup(p, sub)
    mark_slice(p, ExpertSlice(where.first, where.local, where.total, where.group, where.size, dim, view, shape))


def _forward(module: torch.nn.Module, shard: ExpertShard, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under expert parallelism (``hf_zero/expert/dispatch.py``)."""
    if shard.use_grouped_mm:  # one grouped GEMM over the local experts (transformers' own, bias and gate included)
        from transformers.integrations.moe import grouped_mm_experts_forward as own
    else:  # DeepSpeed's use_grouped_mm false: the sequential loop, the class's own code under its decorator
        own = getattr(type(module).forward, "__wrapped__", type(module).forward)

    def run_local(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return own(module, x, index, weight)

    g = shard.groups
    return dispatch_combine(hidden_states, top_k_index, top_k_weights, local_experts=shard.local, group=g.ep_group,
                            group_size=g.ep_size, run_local=run_local,
                            weights=[getattr(module, n) for n in shard.names])


def setup(model: torch.nn.Module, cfg: Any, grid: ParallelGrid, device: torch.device) -> ExpertGroups | None:
    """Split ``model``'s experts over EP groups of ``expert_parallel.autoep_size`` ranks, in place; None when the
    section is off (or its size is 1: every rank keeps every expert, as DeepSpeed runs it).

    Every rank calls this before the engine exists: the whole model is first made the same on every rank (rank 0's
    weights), then each rank keeps its experts. Their parameters are marked to be sharded by ZeRO over the
    expert-data-parallel group, their gradients averaged over the whole world (``hf_zero/zero/group.py`` SubGroup).
    """
    ep = cfg.expert_parallel
    if not ep.enabled:
        return None
    found = find_experts(model)
    if not ep.active:
        if dist.get_rank() == 0:
            logger.warning("expert_parallel.autoep_size is 1: every rank holds every expert and nothing is sent")
        return None
    _check(model, cfg, grid, found)
    groups = expert_groups(ep.size)
    # A model built under zero.Init holds its experts as per-rank slices of the whole world's: made whole (one
    # experts module at a time, each rank then keeping its own experts), while the rest stays sliced for ZeRO.
    for _, m in found:
        own = [p for p in m.parameters(recurse=False) if is_presharded(p)]
        if own:
            materialize_(own, device)
    move_to_device(model, device)
    broadcast_module(model, None)  # every rank's experts are cut from the same whole weights
    sub = SubGroup(groups.edp_group, grid.zero_size)
    with torch.no_grad():
        for mname, m in found:
            names = [n for n, _ in m.named_parameters(recurse=False)]
            total = m.num_experts
            local = total // ep.size
            first = groups.ep_rank * local
            where = ExpertSlice(first, local, total, groups.ep_group, ep.size)
            for p in m.parameters(recurse=False):
                # named per EP rank in resume checkpoints, with its global expert range (hf_zero/parallel/tp_split.py)
                mark_expert_cut(p, TPSplit(0, groups.ep_rank, ep.size, tuple(p.shape)))
                p.data = p.data.narrow(0, first, local).clone()
                mark_subgroup(p, sub)
                mark_slice(p, where)
            m.num_experts = local
            _split_adapters(model, mname, where, groups, sub)
            shard = ExpertShard(first, local, total, groups, ep.use_grouped_mm, names)
            setattr(m, ATTR, shard)
            m.forward = _bound(m, shard)
    # Every forward now exchanges tokens within the EP group, so generate must keep the ranks' forwards in step
    # (synced_gpus), as stage 3's gathers need; engine.destroy() takes the mark off with the engine's others.
    mark_synced_generation(model)
    if dist.get_rank() == 0:
        logger.info("expert parallelism: %d experts modules split over EP groups of %d (expert data parallel %d)",
                    len(found), ep.size, groups.edp_size)
    return groups


def _bound(module: torch.nn.Module, shard: ExpertShard) -> Any:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return _forward(module, shard, hidden_states, top_k_index, top_k_weights)
    return forward
