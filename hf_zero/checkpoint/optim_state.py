"""Optimizer state on load: which saved param group each of this run's groups continues, and its state by name.

The saved optimizer state is stored by parameter name and element range (``optim.exp_avg|<name>``,
and per-parameter scalars such as Adam's ``step``), so a run of any world size, ZeRO stage or
pipeline layout rebuilds torch's state for exactly the masters it owns (:func:`load_optimizer`).
The param groups' hyper-parameters and the scheduler's per-group lists follow the parameters too
(:func:`optimizer_plan`): by position where the groups are the same, by name across layouts.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_zero.checkpoint.format import CheckpointReader, from_json, saved_optimizers
from hf_zero.checkpoint.state import TrainState
from hf_zero.checkpoint.tp_reshard import base_name
from hf_zero.errors import CheckpointError

# Keys that say how an optimizer steps (fused on GPU, loops on CPU), not what it computes: they
# stay this run's own on load and are not compared across groups.
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_plan(state: TrainState, meta: dict, path: str) -> tuple[list[dict | None], Any]:
    """The saved hyper-parameters for each of this run's param groups, and the scheduler state to load.

    Where this run's optimizer has the saved one's groups (no pipeline on either side, or this
    stage of the same pipeline) they match by position, as the optimizer's own state dict does.
    Across layouts (another number of stages, a pipeline into a plain engine or back) a group
    takes the hyper-parameters of the saved group that held its parameters, found by name; a
    group without trainable parameters keeps its own (``None``).
    """
    zo, stage = state.optimizer, state.layout.pipe_stage
    assert zo is not None
    here = [set(names) for names in zo.group_names]
    saved = saved_optimizers(meta)
    first = [saved[stage]] if stage is not None and stage < len(saved) else []
    for v in first + saved:
        if len(v["param_groups"]) == len(here) and all(set(a) == b for a, b in zip(v["group_names"], here)):
            return list(v["param_groups"]), v["lr_scheduler"]
    if stage is None and not meta.get("pipeline"):  # the same layout, other names: by position, as always
        if len(saved[0]["param_groups"]) != len(here):
            raise CheckpointError(
                f"{path} has {len(saved[0]['param_groups'])} optimizer param groups and this run has {len(here)}; "
                "build the optimizer the same way, or pass load_optimizer_states=False"
            )
        return list(saved[0]["param_groups"]), saved[0]["lr_scheduler"]
    where = {n: (vi, gi) for vi, v in enumerate(saved) for gi, names in enumerate(v["group_names"]) for n in names}
    for n, at in list(where.items()):  # a slice's group is its parameter's, at any tensor-parallel degree
        where.setdefault(base_name(n), at)
    hypers: list[dict | None] = []
    picks: list[tuple[int, int] | None] = []
    for i, names in enumerate(zo.group_names):
        names = [n if n in where else base_name(n) for n in names]
        hits = sorted({where[n] for n in names if n in where})
        lost = [n for n in names if n not in where]
        if lost:
            raise CheckpointError(
                f"{path}: parameter '{lost[0]}' is trainable here but was not in any optimizer param group when saved; "
                "train the same parameters, or pass load_optimizer_states=False"
            )
        if not hits:
            hypers.append(None)
            picks.append(None)
            continue
        values = [_plain(saved[vi]["param_groups"][gi]) for vi, gi in hits]
        if any(v != values[0] for v in values[1:]):
            raise CheckpointError(
                f"{path}: optimizer param group {i} here holds parameters that were saved in param groups with "
                "different hyper-parameters; split the param groups as they were, or pass load_optimizer_states=False"
            )
        vi, gi = hits[0]
        hypers.append(saved[vi]["param_groups"][gi])
        picks.append((vi, gi))
    # A scheduler's per-group lists (base_lrs, _last_lr) follow the groups they belong to.
    source = next((p[0] for p in picks if p is not None), stage if stage is not None and stage < len(saved) else 0)
    state = saved[source]["lr_scheduler"]
    count = len(saved[source]["param_groups"])
    index = [p[1] if p is not None and p[0] == source else 0 for p in picks]
    if isinstance(state, dict):
        state = {k: [v[j] for j in index] if isinstance(v, list) and len(v) == count else v for k, v in state.items()}
    return hypers, state


def _plain(hyper: dict) -> dict:
    """Hyper-parameters without the keys that only say how the step runs (compared across groups)."""
    return {k: v for k, v in hyper.items() if k not in _KERNEL_KEYS}


def load_optimizer(state: TrainState, reader: CheckpointReader, hypers: list[dict | None]) -> None:
    """Rebuild torch's optimizer state for this rank's masters, then let torch place it."""
    zo = state.optimizer
    assert zo is not None
    opt = zo.optimizer
    master_index = {id(m): i for i, m in enumerate(m for pg in opt.param_groups for m in pg["params"])}
    state_keys = sorted({kind.removeprefix("optim.") for kind, _ in reader.index if kind.startswith("optim.")})
    # A dotted key is a step runner's own state (ZenFlow's "zenflow.grad_sum", ...): loaded only into a run whose
    # runner keeps that namespace, never left in another optimizer's state
    own = zo.state_namespace

    def taken(k: str) -> bool:
        return "." not in k or (own is not None and k.startswith(own))

    state_keys = [k for k in state_keys if taken(k)]
    new_state: dict[int, dict[str, Any]] = {}
    requests: list[tuple[str, str, int, int, torch.Tensor]] = []  # read into place, the files side by side
    for g in zo.groups:
        if g.master is None:
            continue
        st: dict[str, Any] = {}
        held = opt.state.get(g.master, {})
        for k in state_keys:
            parts = [r for r in g.owned() if (f"optim.{k}", r.slot.name) in reader.index]
            if not parts:
                continue
            # Into the state tensor the optimizer has (no second copy of the state on the device, none on the host),
            # else a new one beside the master; elements no saved range covers start at zero, as a fresh state does.
            mine = held.get(k)
            if not (torch.is_tensor(mine) and mine.shape == g.master.shape and mine.device == g.master.device
                    and mine.is_floating_point()):
                mine = torch.empty(g.master.shape, dtype=torch.float32, device=g.master.device)
            if sum(r.hi - r.lo for r in parts) != mine.numel():
                mine.zero_()
            requests += [(f"optim.{k}", r.slot.name, r.lo, r.hi, mine[r.at : r.at + r.hi - r.lo]) for r in parts]
            st[k] = mine
        scal: dict[str, Any] = {}
        for r in g.owned():
            for k, v in reader.scalars.get(r.slot.name, {}).items():
                if not taken(k):
                    continue
                prev = scal.get(k)
                if prev is not None and prev["value"] != v["value"]:
                    # Parameters stepped a different number of times share this master now: keep the most.
                    v = v if v["value"] > prev["value"] else prev
                scal[k] = v
        for k, v in scal.items():
            if "dtype" in v:  # a one-element tensor keeps its shape (a step counter of shape [1] stays one)
                st[k] = torch.tensor(v["value"], dtype=getattr(torch, v["dtype"])).reshape(v.get("shape", []))
            else:
                st[k] = from_json(v["value"])
        if st:
            new_state[master_index[id(g.master)]] = st
    reader.read_many(requests)
    groups = []
    for pg, saved in zip(opt.param_groups, hypers):
        d = dict(from_json(saved)) if saved is not None else {k: v for k, v in pg.items() if k != "params"}
        for k in _KERNEL_KEYS:  # how this run's optimizer steps (fused on GPU, loops on CPU) stays its own
            if k in pg:
                d[k] = pg[k]
            else:
                d.pop(k, None)
        for k, v in d.items():  # JSON has no tuples: a hyper-parameter the optimizer holds as one (betas) is one again
            if isinstance(pg.get(k), tuple) and isinstance(v, list):
                d[k] = tuple(v)
        d["params"] = [master_index[id(m)] for m in pg["params"]]
        groups.append(d)
    opt.load_state_dict({"state": new_state, "param_groups": groups})
