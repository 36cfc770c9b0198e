"""What a ZeRO engine hangs on the user's module, and how ``engine.destroy()`` takes it off again.

:func:`mark_stage3` sets DeepSpeed's ``ds_*`` attributes (``hf_zero/zero/param_attrs.py``) on every
parameter of a stage-3 engine, once its shard groups exist (an offloaded group has moved its master to
host memory by then, so ``ds_tensor`` is where the values live).

:func:`detach` is DeepSpeed's ``destroy``: the engine's module and gradient hooks come off, the
gradients, masters, optimizer state and gathered buffers are released (also while the caller still
holds the engine or the optimizer ``initialize`` returned), and the parameters are left usable
without the engine: at stages 0-2 whole (the views of one flat buffer they already were), at stage 3
as ``zero.Init``'s per-rank slices (``hf_zero/zero/preshard.py``), which ``GatheredParameters`` gathers
and a new ``initialize`` shards again, as DeepSpeed leaves its partitioned parameters. Converting a
stage-3 group gathers it once (its shards are cut by unit, the slices by parameter), so at stage 3
every rank calls it, as every rank calls DeepSpeed's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hf_zero.zero.param_attrs import ZeroParamStatus, clear, mark
from hf_zero.zero.preshard import is_presharded, preshard_, slice_of
from hf_zero.zero.sharded_group import DS_STATUS, ShardedParamGroup


def link(zo: Any) -> None:
    """Let each shard group of ``zo`` (a ShardedOptimizer) find it, for ``deepspeed.utils``' per-parameter
    accessors (``hf_zero/zero/accessors.py``), which start from a parameter (weakly: no cycle to keep)."""
    ref = weakref.ref(zo)
    for g in zo.groups:
        g.hf_zero_owner = ref


def mark_stage3(module: torch.nn.Module, zo: Any) -> None:
    """DeepSpeed's ``ds_*`` attributes on the parameters of ``module``, sharded by ``zo`` (a stage-3 ShardedOptimizer)."""
    done: set[int] = set()
    for g in zo.groups:
        values = g.owned_values()  # the master, or a frozen group's shard
        sharded = isinstance(g, ShardedParamGroup)
        status = DS_STATUS[g.state] if sharded else ZeroParamStatus.AVAILABLE
        for s, at, n in g.partitions():
            mark(s.param, s.shape, values[at : at + n], status, persist=not sharded)
            done.add(id(s.param))
    for p in module.parameters():  # frozen and too small to shard: whole on every rank
        if id(p) not in done:
            mark(p, p.shape, p.data.view(-1), ZeroParamStatus.AVAILABLE, persist=True)
    mark_synced_generation(module)


# The attributes FSDP2's fully_shard sets on the modules it manages; transformers' ``is_fsdp_managed_module`` reads the
# first, torch.compile (dynamo) both (a module with the first and without the second is refused by dynamo).
_MANAGED = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def mark_synced_generation(module: torch.nn.Module) -> None:
    """Make transformers' ``generate`` turn ``synced_gpus`` on by itself for the models under ``module``.

    Stage 3 gathers each unit with a collective in every forward, so ranks must run as many forwards as each
    other: with ``synced_gpus`` a rank whose sequences are done keeps running forwards until every rank's are.
    transformers turns it on when not passed, under DeepSpeed's ZeRO-3 (``is_deepspeed_zero3_enabled()``, which
    reads DeepSpeed's own config object: setting that would also make ``from_pretrained`` and the Trainer import
    the ``deepspeed`` package) or for a module FSDP manages (``is_fsdp_managed_module(self)``): the attribute
    fully_shard sets is the one switch that means "parameters are sharded, keep the ranks in step" and nothing
    else to transformers, Accelerate and TRL; for torch.compile it means hooks that change parameters, which is
    true here too. Set on each module with a ``generate`` (the model, a peft model's base model); what was
    already set (a model FSDP manages) is left as it was. :func:`detach` takes it off.
    """
    for m in module.modules():
        if callable(getattr(type(m), "generate", None)) and not getattr(m, _MANAGED[0], False):
            for name in _MANAGED:
                setattr(m, name, True)
            m.__dict__["_hf_zero_synced_generation"] = True


def unmark_synced_generation(module: torch.nn.Module) -> None:
    """Undo :func:`mark_synced_generation`."""
    for m in module.modules():
        if m.__dict__.pop("_hf_zero_synced_generation", False):
            for name in _MANAGED:
                m.__dict__.pop(name, None)


def detach(module: torch.nn.Module, zo: Any) -> None:
    """Undo what ``zo`` (a ShardedOptimizer) did to ``module``; see the module doc. Safe to call twice."""
    zo.wait_params()
    for handle in zo._hooks:  # the gradient hooks of stages 0-2 buckets
        handle.remove()
    zo._hooks = []
    if zo.overlap is not None:
        for handle in [*zo.overlap.forward_hooks, *zo.overlap.dict_hooks]:
            handle.remove()
        zo.overlap = None
    if zo.runtime is not None:
        zo.runtime.release_inference()
        for handle in zo.runtime.handles:  # forward hooks of every unit and the root, and the gradient hooks
            handle.remove()
        zo.runtime = None
    for g in zo.stage3_groups:
        g.gather(None)
        g.wait()
        for s in g.slots:
            p = s.param
            p.__dict__.pop("hf_zero_group", None)
            p.grad = None
            # the gathered buffer is whole on every rank: each keeps its slice, as zero.Init cut it
            preshard_(p, slice_of(p.data, g.group, g.device), g.group)
        g.reshard()
    for g in zo.flat_groups:
        g.wait()
        for s in g.slots:
            s.param.grad = None
            s.param.__dict__.pop("hf_zero_flat", None)
    for p in module.parameters():
        if not is_presharded(p):
            clear(p)
    unmark_synced_generation(module)
    # The optimizer's state and its param groups point at the masters: without them the masters go too, even
    # while the caller holds the optimizer initialize returned (the client's own at stage 0 in fp32).
    opt = zo.optimizer
    opt.state.clear()
    for pg in opt.param_groups:
        pg["params"] = []
    zo.flat_groups, zo.stage3_groups = [], []
    zo._group_of, zo._bucket_of = {}, {}
    zo.runner.release()  # the step runner's hold on the groups, and a streamed step's pinned host buffers
