"""The user's optimizer param groups as :class:`hf_zero.zero.optimizer.ShardedOptimizer` reads and rewrites them.

Before any buffer exists the optimizer takes, from the param groups, the trainable ``(name, parameter)`` pairs of
each (checked: no parameter twice, none outside the model, a trainable one in no group frozen as DeepSpeed leaves it
untrained); once the groups exist, each param group is re-pointed at its masters. Apart from the optimizer because this is the contract with
the user's torch optimizer, which the shard groups and the step never see.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from hf_zero.parallel.tp_split import checkpoint_name
from hf_zero.zero.grouping import NamedParams


def trainable_by_param_group(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[NamedParams]:
    """The trainable ``(name, parameter)`` pairs of each optimizer param group, checked before any work is done."""
    # a tensor-parallel slice is named per rank, so checkpoints keep every rank's slice (hf_zero/parallel/tp_split.py)
    names = {id(p): checkpoint_name(n, p) for n, p in module.named_parameters(remove_duplicate=True)}
    seen: set[int] = set()
    group_named: list[NamedParams] = []
    for gi, pg in enumerate(optimizer.param_groups):
        named = []
        for p in pg["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter appears twice in the optimizer's param groups (group {gi})")
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; build the optimizer from model.parameters()"
                )
            seen.add(id(p))
            if p.requires_grad:
                named.append((names[id(p)], p))
        group_named.append(named)
    missing = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        # DeepSpeed accepts such a parameter and never steps it (its gradient is computed and kept, unused); here
        # it is frozen outright, so that it is laid out, cast and saved as the frozen parameter it is in effect.
        warnings.warn(
            f"{len(missing)} parameter(s) require grad but are in no optimizer param group ("
            + ", ".join(f"'{n}'" for n, _ in missing[:3]) + (", ..." if len(missing) > 3 else "")
            + "): as under DeepSpeed they are not trained; hf_zero freezes them (requires_grad=False). Add them to "
            "a param group (or model_parameters) to train them", stacklevel=2)
        for _, p in missing:
            p.requires_grad_(False)
    return group_named


def point_optimizer_at(optimizer: torch.optim.Optimizer, group_masters: list[list[torch.Tensor]]) -> None:
    """Re-point each param group at its masters and start the optimizer's state afresh."""
    for pg, masters in zip(optimizer.param_groups, group_masters):
        pg["params"] = masters
        if (
            getattr(optimizer, "hf_zero_fuse_on_device", False)
            and pg.get("fused") is None
            and not pg.get("foreach")
            and masters
            and all(m.is_cuda for m in masters)
        ):
            pg["fused"] = True  # the config's Adam, built on zero.Init's meta parameters
    optimizer.state = defaultdict(dict)
