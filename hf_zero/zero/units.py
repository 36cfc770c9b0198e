"""Stage 3's units: the modules whose shard groups are gathered and released together, and how they are found.

A *unit* is a transformer block (for ``transformers`` models, an instance of a class named in
``_no_split_modules``); in any other model :func:`find_units` walks down through containers whose own
``forward`` never runs (``ModuleList``, ``ModuleDict``) or that only chain their children (``Sequential``).
An input embedding no other module shares is a unit too (:func:`input_embedding_unit`); whatever belongs to
no unit is the root unit. :func:`side_entries` names the modules that code runs on their own, outside the
root's forward (an encoder ``generate`` runs first). :func:`assign_units` gives each parameter its unit (a
parameter two units share goes to the root), which the optimizer builds stage 3's groups from and ``hf-zero plan``
counts by. :class:`Unit` holds one unit's groups
(:class:`hf_zero.zero.sharded_group.ShardedParamGroup`) and the counters that
:class:`hf_zero.zero.stage3.Stage3Runtime`'s hooks keep on it. Block checkpointing and compiling
(:mod:`hf_zero.training.recompute`, :mod:`hf_zero.training.compile`) wrap the same units, so they read :func:`find_units` too.
"""

from __future__ import annotations

import torch

from hf_zero.zero.sharded_group import ShardedParamGroup, ShardState

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def _has_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _holds_container(module: torch.nn.Module) -> bool:
    """Whether a container of parameterised modules sits somewhere under ``module``."""
    return any(isinstance(m, _CONTAINERS) and _has_params(m) for m in module.modules() if m is not module)


def _descend(module: torch.nn.Module, prefix: str, inside: bool, out: list[tuple[str, torch.nn.Module]]) -> None:
    for name, child in module.named_children():
        if not _has_params(child):
            continue
        if isinstance(child, _CONTAINERS) or (not inside and _holds_container(child)):
            _descend(child, f"{prefix}{name}.", inside or isinstance(child, _CONTAINERS), out)
        else:
            out.append((f"{prefix}{name}", child))


def is_lookup(module: torch.nn.Module) -> bool:
    """A plain ``torch.nn.Embedding``: its weight's gradient is a scatter of the output's gradient by the token ids, and
    nothing upstream needs a gradient, so its backward never reads the weight and stage 3 does not gather it there.
    (Nor does block checkpointing wrap it, :func:`hf_zero.training.recompute.checkpoint_blocks`: a recomputation would read it.)"""
    return type(module) is torch.nn.Embedding


def find_units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose parameters are gathered together: transformer blocks, else what :func:`_descend` finds.

    With ``_no_split_modules`` (``transformers`` models), the outermost instances of those classes.
    Otherwise the tree is walked from the root: a child without parameters is skipped; a ``ModuleList``,
    ``ModuleDict`` or ``Sequential`` is walked into (the first two never run a ``forward`` of their own, so a
    hook on them would gather nothing), and so is a child that holds such a container (a GPT-2 style
    ``transformer`` module iterating its ``h`` list; its own parameters stay with the root unit); every other
    child with parameters is a unit. Below the first container only containers are walked into: its other
    children are units whole, so that a block holding a ``ModuleList`` of experts stays one unit (its experts
    run depending on the data, and a gather per expert would differ from rank to rank).
    """
    names = set(getattr(module, "_no_split_modules", None) or [])
    if names:
        units = [(n, m) for n, m in module.named_modules() if type(m).__name__ in names and m is not module]
        if units:
            # keep outermost blocks only
            out: list[tuple[str, torch.nn.Module]] = []
            for n, m in units:
                if not any(n.startswith(p + ".") for p, _ in out):
                    out.append((n, m))
            return out
    found: list[tuple[str, torch.nn.Module]] = []
    _descend(module, "", isinstance(module, _CONTAINERS), found)
    return found


def input_embedding_unit(
    module: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]
) -> tuple[str, torch.nn.Module] | None:
    """The model's input embedding as a stage-3 unit of its own, when nothing else uses its weight.

    Left in the root unit it would stay gathered for the whole step, as the root does, though
    only the lookup at the start of forward and its gradient at the end of backward use it. As a
    unit it is released in between, which takes its 16-bit size (0.3 GiB for a 13B Llama) off
    the peak at the start of backward. A weight tied to the LM head (GPT-2) stays in the root.
    """
    get = getattr(module, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(emb, torch.nn.Module) or emb is module:
        return None
    name = next((n for n, m in module.named_modules() if m is emb), "")
    if not name or any(name == u or name.startswith(u + ".") or u.startswith(name + ".") for u, _ in units):
        return None  # not found, or already a unit (or inside one, or holding one)
    own = {id(p) for p in emb.parameters()}
    if not own:
        return None
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in own and not n.startswith(name + "."):
            return None  # tied: some other module reads this weight
    return name, emb


def side_entries(root: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Modules that code runs on their own, outside the root's forward, and that read the root unit's parameters.

    ``generate`` of an encoder-decoder model (T5, BART) runs ``model.get_encoder()(...)`` once before decoding: the
    encoder reads the shared embedding and its final norm, which belong to the root unit, though the root's hooks
    never run. Such an entry is the module ``get_encoder()`` returns, unless it is the root, a unit or inside one.
    """
    get = getattr(root, "get_encoder", None)
    try:
        enc = get() if callable(get) else None
    except (NotImplementedError, AttributeError, TypeError):
        return []
    if not isinstance(enc, torch.nn.Module) or enc is root:
        return []
    if not any(m is enc for m in root.modules()):
        return []
    if any(any(m is enc for m in u.modules()) for u in units):
        return []
    return [enc]


def assign_units(module: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], dict[int, int]]:
    """Stage 3's units (the input embedding first when it is one) and each parameter's unit (-1: the root).

    A parameter reachable under two units, or under a unit and outside every unit (a tied embedding and LM
    head, a weight a parent module also holds), must be whole whenever any of them runs: it joins the root
    unit, which stays gathered for the whole step. A unit left with no parameter of its own is dropped.
    """
    unit_mods = find_units(module)
    embedding = input_embedding_unit(module, unit_mods)
    if embedding is not None:
        unit_mods = [embedding, *unit_mods]
    owner: dict[int, int] = {}
    for ui, (_, m) in enumerate(unit_mods):
        for p in m.parameters():
            owner[id(p)] = ui if owner.get(id(p), ui) == ui else -1
    # what the root reaches without passing through a unit (the same module object repeated in a ModuleList,
    # ALBERT's shared layer, is one unit called many times, not a way around it)
    units = {id(m) for _, m in unit_mods}
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in units:
            continue
        seen.add(id(m))
        for p in m._parameters.values():
            if p is not None:
                owner[id(p)] = -1
        stack.extend(c for c in m._modules.values() if c is not None)
    kept = sorted({ui for ui in owner.values() if ui >= 0})
    renumber = {old: new for new, old in enumerate(kept)}
    unit_of = {pid: renumber.get(ui, -1) for pid, ui in owner.items() if ui >= 0}
    return [unit_mods[ui] for ui in kept], unit_of


class Unit:
    """A module whose sharded parameter groups are gathered and released together."""

    def __init__(self, index: int, name: str, module: torch.nn.Module, groups: list[ShardedParamGroup], is_root: bool) -> None:
        self.index, self.name, self.module, self.groups, self.is_root = index, name, module, groups, is_root
        self.trainable_count = sum(len(g.slots) for g in groups if g.trainable)
        self.numel = sum(g.numel for g in groups)
        self.ready = 0
        # Frozen groups (a LoRA base layer, frozen norms) are released once the unit's backward is done: its
        # trainable gradients are reduced (`reduced`) and the gradients of its inputs computed (`pending`: the
        # calls of the unit whose inputs' gradients are still to come, see Stage3Runtime._watch_inputs).
        self.has_frozen = any(not g.trainable for g in groups)
        self.pending = 0
        self.reduced = False
        # False when no op in the backward of the unit's last training forward reads its weights (no output
        # requires grad; or the weights are all frozen and no input needs a gradient; or it is a plain
        # embedding lookup): backward neither gathers it nor prefetches it.
        self.needs_backward = True
        self.lookup_only = is_lookup(module)  # an input embedding: its backward never reads its weight
        # For a unit without trainable groups: whether an input of its last forward required grad.
        self.inputs_need_grad = True
        # Calls of the unit's forward now running (between its pre- and post-hook): a read of its parameters
        # at any other moment of a forward is a read from outside (hf_zero/zero/external.py).
        self.running = 0
        # Read from outside its forward: gathered and released with the root unit from then on (Stage3Runtime.pin).
        self.pinned = False

    def gather(self, stream: torch.cuda.Stream | None) -> None:
        for g in self.groups:
            g.gather_for_compute(stream)

    def wait(self) -> None:
        for g in self.groups:
            g.wait()

    def reshard(self, trainable_only: bool = False) -> None:
        for g in self.groups:
            if g.trainable or not trainable_only:
                g.reshard()

    @property
    def gathered(self) -> bool:
        for g in self.groups:  # a loop, not any(genexpr): _prefetch_after asks this of every unit ahead, every call
            if g.state is not ShardState.SHARDED:
                return True
        return False
