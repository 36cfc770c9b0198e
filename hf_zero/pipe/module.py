"""``LayerSpec``, ``TiedLayerSpec`` and ``PipelineModule``: a model as a list of layers cut into stages.

DeepSpeed's contract, kept: the forward pass is the layers applied one after the other (the
output of one is the input of the next: a tensor or a tuple of tensors); a ``LayerSpec`` is
built only on the stage that owns it, so no process ever materialises the whole model; layers
sharing a weight (an embedding and the LM head) are ``TiedLayerSpec``s with one key, each stage
holding one copy kept equal to the others (same start, gradients summed before every step).

The process layout is the run's grid (``hf_zero/parallel/grid.py``) with a ``pp`` axis, outermost: global
rank ``pipe_stage * dp + dp_rank``, as DeepSpeed's ``PipeDataParallelTopology`` numbers them, so a stage's
data-parallel replicas are neighbours. The module cuts the grid when it is built (its stage must be known
before its layers are); ``initialize`` takes it from there. Every rank makes every group in the same order.

hf_zero adds one thing: a spec may carry ``module_path`` (``NamedLayerSpec``, or
``TiedLayerSpec(..., module_path=...)``). The built module is then registered at that dotted
path instead of under its layer index, so a stage's ``state_dict()`` uses the original model's
names (``model.layers.3.self_attn.q_proj.weight``) and the consolidated checkpoint loads with
``from_pretrained`` without any renaming.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.distributed import dist as hz_dist
from hf_zero.errors import PipelineError
from hf_zero.parallel import GridShape, grid_for
from hf_zero.parallel.topology import PipelineParallelGrid, ProcessTopology, shape_of_topology

logger = logging.getLogger("hf_zero")


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 784, 128)`` builds ``nn.Linear(784, 128)`` on its stage only."""

    module_path: str | None = None
    forward_fn: Callable | None = None

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(f"LayerSpec needs a torch.nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the module (called once, on the stage that owns the layer)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class NamedLayerSpec(LayerSpec):
    """hf_zero's: a ``LayerSpec`` registered at ``module_path`` and run as ``forward_fn(module, x)``.

    This is how a transformers model is split without renaming its weights.
    """

    def __init__(self, module_path: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.module_path = module_path
        self.forward_fn = forward_fn


class TiedLayerSpec(LayerSpec):
    """A layer whose weight is shared with every other ``TiedLayerSpec`` of the same ``key``.

    The module is built once per stage; ``forward_fn(module, x)`` (if given) replaces
    ``module(x)``, so an LM head can reuse an embedding's weight as ``x @ module.weight.T``.
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str = "weight", module_path: str | None = None, **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = tied_weight_attr
        self.module_path = module_path


# ---------------------------------------------------------------- partitioning


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts whose sizes differ by at most one."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous, non-empty parts minimising the heaviest part.

    Binary search on the heaviest part's weight with a greedy fill, then the heaviest
    multi-layer parts are split until there are ``num_parts`` (splitting never raises the
    maximum), so every stage gets at least one layer.
    """
    n = len(weights)

    def fill(cap: int) -> list[int] | None:
        bounds, total = [0], 0
        for i, w in enumerate(weights):
            if total + w > cap and i > bounds[-1]:
                bounds.append(i)
                total = 0
            total += w
        bounds.append(n)
        return bounds if len(bounds) - 1 <= num_parts else None

    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    bounds = fill(lo)
    assert bounds is not None
    while len(bounds) - 1 < num_parts:
        parts = [(sum(weights[a:b]), b - a, k) for k, (a, b) in enumerate(zip(bounds, bounds[1:])) if b - a > 1]
        _, _, k = max(parts)
        a, b = bounds[k], bounds[k + 1]
        cut = min(range(a + 1, b), key=lambda c: max(sum(weights[a:c]), sum(weights[c:b])))
        bounds.insert(k + 1, cut)
    return bounds


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _count_params(layer: Any) -> int:
    """Trainable parameters of a layer; a spec is built on the meta device, so nothing is allocated."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _compute_weights(specs: list[Any]) -> list[int]:
    """Per-layer cost for ``partition_method="compute"``: trainable parameters, except lookups.

    A matmul layer costs about 2 FLOPs per weight per token forward (and twice that backward),
    so its parameter count is its share of the compute; an embedding lookup has many weights
    and next to no FLOPs. ``"parameters"`` would give the stage holding the embedding fewer
    blocks and leave the LM head's stage the slowest; here embeddings weigh nothing, except a
    tied weight's later uses (a ``TiedLayerSpec`` key seen before: the LM head), which are matmuls.
    """
    weights, seen = [], set()
    for layer in specs:
        n = _count_params(layer)
        if isinstance(layer, TiedLayerSpec):
            lookup = layer.key not in seen and issubclass(layer.typename, nn.Embedding)
            seen.add(layer.key)
        else:
            lookup = isinstance(layer, nn.Embedding) or (isinstance(layer, LayerSpec) and issubclass(layer.typename, nn.Embedding))
        weights.append(0 if lookup else n)
    return weights


# ---------------------------------------------------------------- topology


def _install(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at a dotted ``path`` under ``root``, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


# ---------------------------------------------------------------- the module


class PipelineModule(nn.Module):
    """The layers this process's stage owns, built from ``layers``; see the module docstring.

    ``partition_method``: ``"parameters"`` balances trainable parameter counts (DeepSpeed's
    default), ``"compute"`` balances them with embedding lookups counted as free (a proxy for
    FLOPs: the LM head's stage gets fewer blocks), ``"uniform"`` balances layer counts,
    ``"type:<regex>"`` balances the layers whose class name matches (``"type:DecoderLayer"`` puts
    equally many transformer blocks on each stage).
    ``activation_checkpoint_interval=k`` recomputes every run of ``k`` layers in backward
    (``torch.utils.checkpoint``, non-reentrant) instead of keeping their activations.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
    ) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule needs num_stages (the number of pipeline stages) or a topology")
        specs = list(layers)
        if topology is not None:  # DeepSpeed's alternative to num_stages: its pipe axis, checked against the world
            hz_dist.init_distributed()
            num_stages = self._stages_of(topology, num_stages, dist.get_world_size())
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PipelineError(f"PipelineModule(num_stages=...) must be a positive integer, got {num_stages!r}")
        if num_stages > len(specs):
            raise PipelineError(
                f"PipelineModule(num_stages={num_stages}) has more stages than layers ({len(specs)}); every stage needs at least one layer"
            )
        hz_dist.init_distributed()  # the tutorial builds the module before initialize(); DeepSpeed's needs init_distributed first
        world = dist.get_world_size()
        if world % num_stages:
            raise PipelineError(
                f"PipelineModule(num_stages={num_stages}) does not divide the world size {world}; "
                "world size = stages x data-parallel degree"
            )
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise PipelineError(
                f"PipelineModule(activation_checkpoint_interval=...) must be an integer >= 0, got {activation_checkpoint_interval!r}"
            )
        self.num_stages = num_stages
        self._user_topology: ProcessTopology | None = topology
        # The grid of the run, with DeepSpeed's PipelineParallelGrid methods (hf_zero/parallel/topology.py): what
        # DeepSpeed's `_grid`, `mpu()` and the engine's `grid` are.
        self.grid = PipelineParallelGrid.over(grid_for(GridShape.fill(world, pp=num_stages), hz_dist.get_device().type),
                                              topology)
        self.global_rank = dist.get_rank()
        self.stage_id, self.dp_rank, self.dp = self.grid.pipe_stage, self.grid.dp_rank, self.grid.dp_size
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._layer_specs = specs
        self.parts = self._partition(partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self._make_groups()
        self.forward_funcs: list[Callable] = []
        self.tied_lookup: dict[str, nn.Module] = {}  # key -> this stage's copy (registered by _build)
        self.tied_weight_attrs: dict[str, str] = {}
        self._build()
        self.to(hz_dist.get_device())
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # ------------------------------------------------------------ setup

    def _partition(self, method: str) -> list[int]:
        if not isinstance(method, str):
            raise PipelineError(f"PipelineModule(partition_method=...) must be a string, got {method!r}")
        specs, p = self._layer_specs, self.num_stages
        lowered = method.lower()
        if lowered == "uniform":
            return partition_uniform(len(specs), p)
        if lowered == "parameters":
            return partition_balanced([_count_params(layer) for layer in specs], p)
        if lowered == "compute":
            return partition_balanced(_compute_weights(specs), p)
        if lowered.startswith("type:"):
            pattern = method.split(":", 1)[1]
            try:
                regex = re.compile(pattern, re.IGNORECASE)
            except re.error as e:
                raise PipelineError(f"PipelineModule(partition_method={method!r}): {pattern!r} is not a regular expression ({e})") from None
            hits = [1 if regex.search(_layer_name(layer)) else 0 for layer in specs]
            if not any(hits):
                names = ", ".join(dict.fromkeys(_layer_name(layer) for layer in specs))
                raise PipelineError(f"PipelineModule(partition_method={method!r}) matches no layer; the layers are {names}")
            return partition_balanced(hits, p)
        raise PipelineError(
            f"PipelineModule(partition_method={method!r}) is unknown; expected 'parameters', 'compute', 'uniform' or 'type:<regex>'"
        )

    def _make_groups(self) -> None:
        """The stage's data-parallel group and the pipeline's (the grid's), and a 2-rank group per neighbouring pair
        of stages, made on every rank in the same order (``new_group`` is collective)."""
        grid = self.grid
        self.dp_group = grid.zero_group  # the stage's replicas: what ZeRO shards over
        self.pipe_group = grid.group("pp")
        self.p2p_groups: dict[int, Any] = {}  # neighbour stage -> 2-rank group
        for d in range(self.dp):
            for s in range(self.num_stages - 1):
                pair = dist.new_group([grid.rank_at(pp=s, dp_shard=d), grid.rank_at(pp=s + 1, dp_shard=d)])
                if d == self.dp_rank and s == self.stage_id:
                    self.p2p_groups[s + 1] = pair
                if d == self.dp_rank and s + 1 == self.stage_id:
                    self.p2p_groups[s] = pair
        self._connect_neighbours()

    def adopt_grid(self, grid: Any) -> None:
        """Take the run's whole grid once the config is read (``initialize``): the same ``pp`` axis, its ranks per
        stage cut into ``dp_replicate x dp_shard x tp`` (hybrid sharding, tensor parallelism).

        The module was built on ``pp`` alone (its stage had to be known before its layers). ``pp`` is the outermost
        axis, so a rank's stage and its index inside the stage do not depend on how the stage's ranks are cut: the
        point-to-point pairs and tie groups made then (ranks of neighbouring stages at the same index) join exactly
        the ranks with the same coordinate on every other axis, as each tensor-parallel rank must talk to its
        counterpart. Only the stage's groups (data-parallel, ZeRO) and ranks are re-read."""
        if grid.size("pp") != self.num_stages or grid.pipe_stage != self.stage_id or grid.size() != self.grid.size():
            raise PipelineError(f"the run's grid {grid.shape.describe()} does not match the PipelineModule's "
                                f"{self.num_stages} stages over {self.grid.size()} ranks")
        if self._user_topology is not None and grid.size("tp") > 1:
            raise PipelineError(f"the config's tensor_parallel.autotp_size {grid.size('tp')} adds a model axis the "
                                "PipelineModule's topology does not have; build the module with num_stages instead "
                                "of topology=, or leave tensor parallelism out")
        self.grid = PipelineParallelGrid.over(grid, self._user_topology)
        self.dp_rank, self.dp = grid.dp_rank, grid.dp_size
        self.dp_group = grid.zero_group
        self.pipe_group = grid.group("pp")

    @staticmethod
    def _stages_of(topology: Any, num_stages: int | None, world: int) -> int:
        """The number of stages of DeepSpeed's ``topology=`` argument (its ``pipe`` axis), refusing what hf_zero's grid
        cannot be: another axis order, a size other than the world's, or a ``model`` axis (layers sliced by the user)."""
        shape = shape_of_topology(topology, world)
        if shape.tp > 1:
            raise PipelineError(
                f"PipelineModule(topology=...) with a model axis of {shape.tp} (layers you slice yourself) is not "
                "supported yet; give a PipeDataParallelTopology or num_stages, and set \"tensor_parallel\": "
                "{\"autotp_size\": N} in the config for hf_zero's tensor parallelism")
        if num_stages is not None and num_stages != shape.pp:
            raise PipelineError(f"PipelineModule(num_stages={num_stages}) disagrees with its topology's pipe axis of "
                                f"{shape.pp}; give one of the two")
        return shape.pp

    # DeepSpeed's names for the grid: PipelineModule._grid, mpu() and topology()
    @property
    def _grid(self) -> PipelineParallelGrid:
        return self.grid

    @property
    def _topo(self) -> ProcessTopology:
        return self.grid.topology()

    def mpu(self) -> PipelineParallelGrid:
        """The grid, the model-parallel unit (mpu) DeepSpeed's engine and Megatron-style code read ranks and groups from."""
        return self.grid

    def topology(self) -> ProcessTopology:
        """The ``ProcessTopology`` mapping pipeline and data coordinates (and tensor slices) to global ranks."""
        return self.grid.topology()

    def rank_of(self, stage: int) -> int:
        """The global rank of pipeline stage ``stage`` in this rank's data-parallel replica."""
        return self.grid.rank_at(pp=stage)

    def _connect_neighbours(self) -> None:
        """One tiny exchange in both directions with each neighbour, lower pair first, before any real traffic.

        NCCL connects a direction of a pair lazily, on its first send/recv, and that setup can block
        the host until the peer joins. In GPipe the first backward-direction message comes only after
        every forward, while the peer's host may be waiting on its GPU for a forward activation: set up
        both directions now, when both ranks are here.
        """
        device = hz_dist.get_device()
        for peer_stage in sorted(self.p2p_groups):
            rank = self.rank_of(peer_stage)
            out, inp = torch.zeros(1, device=device), torch.zeros(1, device=device)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, rank, self.p2p_groups[peer_stage]),
                                            dist.P2POp(dist.irecv, inp, rank, self.p2p_groups[peer_stage])])
            for w in works:
                w.wait()

    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise PipelineError(f"layer {idx} is itself a PipelineModule; nest plain modules or LayerSpecs instead")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_lookup:
                    module = layer.build()
                    self.tied_lookup[layer.key] = module
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                    # At its path the module keeps the model's names; otherwise DeepSpeed's "tied_modules.<key>".
                    _install(self, layer.module_path or f"tied_modules.{layer.key}", module)
                module = self.tied_lookup[layer.key]
                self.forward_funcs.append(partial(layer.forward_fn, module) if layer.forward_fn else module)
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                _install(self, layer.module_path or str(idx), module)
                self.forward_funcs.append(partial(layer.forward_fn, module) if layer.forward_fn else module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise PipelineError(f"layer {idx} is a {type(layer).__name__}; expected a LayerSpec, an nn.Module or a callable")

    def _index_tied_modules(self) -> dict[str, dict]:
        """For each tie key: the ranks (same data-parallel replica, stages holding the key) and their group."""
        comms: dict[str, dict] = {}
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        for key in keys:
            stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for d in range(self.dp):
                ranks = [self.grid.rank_at(pp=s, dp_shard=d) for s in stages]
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if self.global_rank in ranks and len(ranks) > 1:
                    comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                  "module": self.tied_lookup[key]}
        return comms

    def _synchronize_tied_weights(self) -> None:
        """Start every copy of a tied weight from the first stage's value."""
        with torch.no_grad():
            for comm in self.tied_comms.values():
                dist.broadcast(getattr(comm["module"], comm["weight_attr"]).data, src=comm["ranks"][0], group=comm["group"])

    # ------------------------------------------------------------ queries

    def tied_weights(self) -> list[tuple[torch.nn.Parameter, Any, bool]]:
        """(weight, tie group, is this stage the first holder) for each tie that spans stages."""
        return [(getattr(c["module"], c["weight_attr"]), c["group"], c["ranks"][0] == self.global_rank)
                for c in self.tied_comms.values()]

    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        for s in range(self.num_stages):
            if self.parts[s] <= layer_idx < self.parts[s + 1]:
                return s
        raise PipelineError(f"layer {layer_idx} is not a layer of this PipelineModule (it has {len(self._layer_specs)})")

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def describe(self) -> str:
        """Which layers each stage holds, one line per stage."""
        lines = []
        for s in range(self.num_stages):
            names = [_layer_name(layer) for layer in self._layer_specs[self.parts[s]:self.parts[s + 1]]]
            lines.append(f"stage {s}: layers {self.parts[s]}-{self.parts[s + 1] - 1} ({', '.join(names)})")
        return "\n".join(lines)

    # ------------------------------------------------------------ forward

    def _run(self, start: int, stop: int, x: Any) -> Any:
        for f in self.forward_funcs[start:stop]:
            x = f(x)
        return x

    def _checkpointable(self, funcs: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(getattr(f, "args", [f])[0]).__name__ in self.checkpointable_layers for f in funcs)
        mods = [f if isinstance(f, nn.Module) else (f.args[0] if isinstance(f, partial) and f.args else None) for f in funcs]
        return any(isinstance(m, nn.Module) and next(m.parameters(), None) is not None for m in mods)

    def forward(self, x: Any) -> Any:
        """This stage's layers applied in order to ``x`` (the previous stage's output, or the inputs)."""
        k = self.activation_checkpoint_interval
        n = len(self.forward_funcs)
        if k == 0 or not (self.training and torch.is_grad_enabled()):
            return self._run(0, n, x)
        from torch.utils.checkpoint import checkpoint

        ckpt = self.activation_checkpoint_func
        for start in range(0, n, k):
            stop = min(start + k, n)
            if self._checkpointable(self.forward_funcs[start:stop]):
                fn = partial(self._run, start, stop)
                x = ckpt(fn, x) if ckpt is not None else checkpoint(fn, x, use_reentrant=False)
            else:
                x = self._run(start, stop, x)
        return x
