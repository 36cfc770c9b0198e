"""``hf-zero plan``: memory and communication per GPU of a training layout on many machines, and a ranking of layouts.

Everything is counted from the model the engine would build and from the engine's own choices, not from a
generic formula: the stage-3 units and the root unit (:func:`hf_zero.zero.units.assign_units`), the
parameters stage 3 keeps whole (``stage3_param_persistence_threshold``), the linear layers tensor parallelism
splits (:func:`hf_zero.parallel.tensor_parallel.planned_layers`), the pipeline split (:func:`hf_zero.pipe.module.partition_balanced`
over embedding, blocks, final norm and head, as :mod:`hf_zero.pipe.hf` lists them) and the grid's rank order
(:mod:`hf_zero.parallel.grid`: ``tp`` innermost, ``pp`` outermost). Weights, gradients and optimizer state are
:func:`hf_zero.planning.estimate.estimate_memory`'s figures (the ones tests/test_memory.py checks against a run), with
stage 3's persistent parameters added.

Bytes per collective are the *payload* a call is given (an all-gather's gathered output, a reduce-scatter's
input, an all-reduce's tensor, an all-to-all's send buffer, a send's tensor), summed over one optimizer step;
tests/test_planner.py counts the same quantity on gloo ranks running the engine. What a rank puts on the links
(*wire* bytes) follows the ring algorithms NCCL uses for large messages: (n-1)/n of the payload for an
all-gather, a reduce-scatter and an all-to-all, 2(n-1)/n for an all-reduce, all of it for a send (the factors
nccl-tests' "bus bandwidth" is defined with). A group inside one node moves its wire bytes over NVLink; a group
spanning k nodes with m ranks on each runs m rings side by side, each leaving a node through a different GPU's
NIC, so 1/m of a rank's wire bytes cross nodes and the rest stay on NVLink (an all-to-all sends (n-m)/n of its
payload to other nodes). A collective takes max(intra / intra bandwidth, inter / inter bandwidth) seconds, and
the step's communication time is the sum over collectives: nothing overlapped with compute, no latency term.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace

from hf_zero.parallel import AXES, GridShape
from hf_zero.planning import estimate

# The model's half (presets, parameters as the engine classifies them) is planner_facts.py and the printing
# planner_report.py; the names of the first stay importable from here, where the CLI, tests and benchmarks read them.
from hf_zero.planning.facts import PRESETS, ModelFacts, Param, load_config, model_facts

__all__ = [
    "GB", "GIB", "GPUS", "PRESETS", "Machines", "Training", "Param", "ModelFacts", "load_config", "model_facts",
    "refusal", "unfit", "Traffic", "Memory", "Plan", "pipeline_bounds", "bucket_count", "plan", "layouts",
    "rank_layouts", "describe",
]

GIB = 1024**3
GB = 10**9

#: GPU defaults. Memory: what the driver reports for an H100 SXM 80GB (81559 MiB) and an H200 (143771 MiB).
#: NVLink: 4th generation, 900 GB/s per GPU in both directions together (NVIDIA's H100 and H200 datasheets),
#: so 450 GB/s each way, about the bus bandwidth nccl-tests reaches for large all-reduces inside one node.
#: Inter-node: one 400 Gb/s InfiniBand (NDR) adapter per GPU, as in a DGX H100 / HGX H200: 50 GB/s.
GPUS: dict[str, dict[str, float]] = {
    "h100": {"memory_gib": 81559 / 1024, "intra_gbs": 450.0, "inter_gbs": 50.0},
    "h200": {"memory_gib": 143771 / 1024, "intra_gbs": 450.0, "inter_gbs": 50.0},
}

#: Bytes each collective kind's ring moves per byte of payload, for a group of n ranks.
_RING = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}


# ------------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Machines:
    """The cluster: ``nodes`` x ``gpus_per_node`` GPUs of ``memory_gib`` each; bandwidths in GB/s per GPU, each way.

    ``reserve_gib`` is kept free of the plan (CUDA context, NCCL buffers, allocator fragmentation). ``tflops``: the
    dense 16-bit TFLOP/s a GPU achieves in training (400 is about 40% of an H100 SXM's 989), for the compute estimate
    that puts a pipeline's bubble beside the communication time."""

    nodes: int = 1
    gpus_per_node: int = 8
    memory_gib: float = GPUS["h100"]["memory_gib"]
    intra_gbs: float = GPUS["h100"]["intra_gbs"]
    inter_gbs: float = GPUS["h100"]["inter_gbs"]
    reserve_gib: float = 4.0
    tflops: float = 400.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserve_gib) * GIB


@dataclass(frozen=True)
class Training:
    """The step: ``micro_batch`` sequences of ``seq`` tokens per data-parallel rank and micro-step,
    ``grad_accum`` micro-steps per optimizer step, at ZeRO ``zero_stage``.

    ``dtype``: bf16/fp16 (16-bit compute, fp32 masters and optimizer state, gradients reduced in fp32, hf_zero's
    default ``communication_data_type``) or fp32. ``recompute``: ``"full"`` (each block recomputed in backward,
    only its input kept) or ``"none"``. ``attention``: ``"flash"`` (SDPA / flash attention keep no seq x seq
    scores) or ``"eager"``. ``persistence_threshold``: ``stage3_param_persistence_threshold``; ``bucket_numel``:
    ``reduce_bucket_size`` (both hf_zero's defaults)."""

    micro_batch: int = 1
    seq: int = 4096
    zero_stage: int = 3
    grad_accum: int = 1
    dtype: str = "bf16"
    optimizer: str = "adam"
    recompute: str = "full"
    attention: str = "flash"
    persistence_threshold: int = 100_000
    bucket_numel: int = 500_000_000

    @property
    def width(self) -> int:
        """Bytes of one parameter or activation element in the compute dtype."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def reduce_width(self) -> int:
        """Bytes of one gradient element as it is reduced (fp32 in every dtype by default)."""
        return 4


# ------------------------------------------------------------------------------------------------ what runs


def refusal(shape: GridShape, zero_stage: int) -> str | None:
    """Why hf_zero cannot run this layout today (one sentence, the engine's own refusal), or None.

    Mirrors the refusals of hf_zero/pipe/engine.py (a pipeline with ZeRO-3), hf_zero/sequence/setup.py (sequence
    parallelism with a pipeline) and hf_zero/parallel/grid.py (hybrid sharding with tp or sp); tests/test_planner.py
    checks them against the parser and the grid. Tensor parallelism and hybrid sharding run inside a pipeline's stages.
    """
    tp, pp, sp, rep = shape.tp, shape.pp, shape.sp, shape.dp_replicate
    if pp > 1 and zero_stage == 3:
        return "pp x ZeRO-3 is refused"
    if pp > 1 and sp > 1:
        return "pp x sp is refused"
    if rep > 1 and zero_stage == 0:
        return "hybrid sharding needs ZeRO 1-3"
    if rep > 1 and (tp > 1 or sp > 1):
        return "hybrid sharding with tp or sp is not built yet"
    return None


def unfit(facts: ModelFacts, shape: GridShape) -> str | None:
    """Why the model cannot be cut this way at all (not a limit of hf_zero), or None."""
    if shape.tp > 1:
        if not any(p.tp for p in facts.params):
            return "the model has no tensor-parallel plan"
        if facts.heads % shape.tp or facts.kv_heads % shape.tp:
            return f"tp {shape.tp} does not divide {facts.heads} heads / {facts.kv_heads} kv heads"
    if shape.sp > 1 and (facts.heads % shape.sp or (facts.kv_heads % shape.sp and shape.sp % facts.kv_heads)):
        return f"sp {shape.sp} does not split {facts.heads} heads / {facts.kv_heads} kv heads"
    if shape.pp > facts.layers + 3:
        return f"pp {shape.pp} exceeds the {facts.layers + 3} pipeline layers"
    return None


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Traffic:
    """One kind of collective, per GPU and per optimizer step (bytes; see the module docstring)."""

    kind: str
    op: str
    axes: tuple[str, ...]
    group: int
    nodes: int
    calls: int
    payload: int
    intra: float
    inter: float
    seconds: float

    @property
    def wire(self) -> float:
        return self.intra + self.inter


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU: at the optimizer step (weights, gradients, optimizer state), plus the peak activations and
    the working buffers of backward (gathered stage-3 units and the fp32 input of one reduce-scatter)."""

    weights: int
    grads: int
    optim: int
    activations: int
    buffers: int
    formula: str
    activation_formula: str

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optim + self.activations + self.buffers


@dataclass(frozen=True)
class Plan:
    shape: GridShape
    training: Training
    pipe_stage: int
    memory: Memory
    traffic: tuple[Traffic, ...]
    refused: str | None
    fits: bool
    compute: float  # seconds of arithmetic per GPU per step at Machines.tflops, bubble excluded

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.traffic)

    @property
    def intra(self) -> float:
        return sum(t.intra for t in self.traffic)

    @property
    def bubble(self) -> float:
        """The share of a 1F1B pipeline step each stage idles: (pp-1)/(micro-steps+pp-1); 0 without a pipeline."""
        pp = self.shape.pp
        return (pp - 1) / (self.training.grad_accum + pp - 1)

    @property
    def step(self) -> float:
        """Seconds per step if nothing overlapped: the arithmetic, stretched by the bubble, plus the communication."""
        return self.compute / (1 - self.bubble) + self.seconds

    @property
    def inter(self) -> float:
        return sum(t.inter for t in self.traffic)


@functools.lru_cache(maxsize=4096)
def _span(shape: GridShape, axes: tuple[str, ...], gpus_per_node: int) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of the worst group along ``axes``: the most nodes, then the fewest ranks on one.

    Ranks are numbered row-major over the grid's axes, ``tp`` fastest, as hf_zero/parallel/grid.py lays them out."""
    sizes = [getattr(shape, a) for a in AXES]
    along = [i for i, a in enumerate(AXES) if a in axes and sizes[i] > 1]
    others = [i for i in range(len(AXES)) if i not in along]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(AXES))]
    worst = (1, math.prod(sizes[i] for i in along))
    for fixed in itertools.product(*(range(sizes[i]) for i in others)):
        base = sum(c * strides[i] for c, i in zip(fixed, others))
        per_node: dict[int, int] = {}
        for coords in itertools.product(*(range(sizes[i]) for i in along)):
            rank = base + sum(c * strides[i] for c, i in zip(coords, along))
            per_node[rank // gpus_per_node] = per_node.get(rank // gpus_per_node, 0) + 1
        key = (len(per_node), min(per_node.values()))
        if (key[0], -key[1]) > (worst[0], -worst[1]):
            worst = key
    return worst


def _traffic(kind: str, op: str, axes: tuple[str, ...], shape: GridShape, machines: Machines, calls: int,
             payload: int) -> Traffic | None:
    """The wire bytes and time of ``calls`` collectives of ``payload`` bytes in total over the group along ``axes``."""
    n = shape.size(*axes) if axes else 1
    if n <= 1 or payload <= 0 or calls <= 0:
        return None
    if op == "send":  # to a pipeline neighbour: see _plan_stage
        raise ValueError("_traffic: sends are placed by _send_traffic")
    else:
        nodes, per_node = _span(shape, axes, machines.gpus_per_node)
        wire = _RING[op](n) * payload
        if nodes == 1:
            intra, inter = wire, 0.0
        elif op == "all_to_all":
            inter = payload * (n - per_node) / n
            intra = wire - inter
        else:
            inter = wire / per_node
            intra = wire - inter
    seconds = max(intra / (machines.intra_gbs * GB), inter / (machines.inter_gbs * GB))
    return Traffic(kind=kind, op=op, axes=axes, group=n, nodes=nodes, calls=calls, payload=int(payload), intra=intra,
                   inter=inter, seconds=seconds)


def _send_traffic(shape: GridShape, machines: Machines, stage: int, calls: int, nbytes: int) -> Traffic | None:
    """Pipeline stage ``stage`` sends each micro-batch's activations to the next stage and their gradients back to
    the previous one (``nbytes`` each); its ranks' peers are ``world / pp`` ranks away. A send crosses nodes when any
    rank of the stage has its peer on another node."""
    apart = shape.size() // shape.pp
    mine = range(stage * apart, (stage + 1) * apart)
    intra = inter = 0.0
    sends = 0
    for peer_stage in (stage + 1, stage - 1):
        if not 0 <= peer_stage < shape.pp:
            continue
        sends += calls
        offset = (peer_stage - stage) * apart
        if any(r // machines.gpus_per_node != (r + offset) // machines.gpus_per_node for r in mine):
            inter += calls * nbytes
        else:
            intra += calls * nbytes
    if not sends:
        return None
    seconds = max(intra / (machines.intra_gbs * GB), inter / (machines.inter_gbs * GB))
    return Traffic(kind="pp send", op="send", axes=("pp",), group=2, nodes=2 if inter else 1, calls=sends,
                   payload=int(intra + inter), intra=intra, inter=inter, seconds=seconds)


@dataclass
class _Share:
    """The parameters one rank holds (after its tensor-parallel split, on its pipeline stage), in elements."""

    numel: int = 0
    small: int = 0  # below the persistence threshold: kept whole at stage 3
    gather_fwd: int = 0
    gather_bwd: int = 0
    root_gathered: int = 0
    largest_block: int = 0
    blocks: int = 0
    units_fwd: int = 0  # stage-3 units gathered in forward (one all-gather each, one optimizer param group)
    units_bwd: int = 0
    flat: list[tuple[int, bool]] = field(default_factory=list)  # (numel, tp slice) of each parameter, in backward order
    small_flat: list[tuple[int, bool]] = field(default_factory=list)  # the same, below the persistence threshold
    rowwise: list[int] = field(default_factory=list)  # features of each rowwise weight (forward all-reduce)
    colwise: list[int] = field(default_factory=list)  # features of each colwise weight (backward all-reduce)
    embedding: bool = False
    head: bool = False


def pipeline_bounds(facts: ModelFacts, pp: int) -> list[int]:
    """The pipeline split of the layer list (embedding, blocks, final norm, head) by parameters, as PipelineModule's
    default ``partition_method="parameters"`` cuts it."""
    from hf_zero.pipe.module import partition_balanced

    weights = [0] * (facts.layers + 3)
    for p in facts.params:
        weights[p.layer] += p.numel
    return partition_balanced(weights, pp)


def _share(facts: ModelFacts, shape: GridShape, training: Training, layers: range) -> _Share:
    s = _Share()
    per_block: dict[int, int] = {}
    embedding_gathered = False
    for p in facts.params:
        if p.layer not in layers:
            continue
        sliced = bool(p.tp and shape.tp > 1)
        n = p.numel // shape.tp if sliced else p.numel
        s.numel += n
        s.flat.insert(0, (n, sliced))
        s.embedding |= p.layer == 0
        s.head |= p.layer == facts.layers + 2
        if p.tp and p.is_weight:
            (s.colwise if p.tp == "colwise" else s.rowwise).append(p.features)
        if n < training.persistence_threshold:
            s.small += n
            s.small_flat.insert(0, (n, sliced))
            continue
        s.gather_fwd += n
        if p.role == "lookup":
            embedding_gathered = True
        if p.role == "block":
            s.gather_bwd += n
            per_block[p.layer] = per_block.get(p.layer, 0) + n
        elif p.role == "root":
            s.root_gathered += n
    s.blocks = sum(1 for i in layers if 1 <= i <= facts.layers)
    s.largest_block = max(per_block.values(), default=0)
    s.units_bwd = len(per_block)
    s.units_fwd = len(per_block) + embedding_gathered + (s.root_gathered > 0)
    return s


def bucket_count(numels: list[tuple[int, bool]], bucket_numel: int) -> int:
    """How many flat buffers stages 0-2 make of these parameters (in backward order): consecutive parameters up to
    ``reduce_bucket_size`` elements, tensor-parallel slices and whole parameters apart (hf_zero/zero/optimizer.py)."""
    count = 0
    for kind in (True, False):
        size = 0
        started = False
        for n, sliced in numels:
            if sliced is not kind:
                continue
            if started and size + n > bucket_numel:
                count += 1
                size = 0
            started = True
            size += n
        count += started
    return count


def _activations(facts: ModelFacts, shape: GridShape, training: Training, share: _Share, in_flight: int) -> tuple[int, str]:
    """Peak activation bytes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", eq. 1-2, 16-bit activations of a GPT block): per block s*b*h*(34 + 5*a*s/h) without recompute,
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) under tensor parallelism t; the 5*a*s/h term (seq x seq scores) only with eager
    attention; Ulysses sp divides all of it by sp. Full recompute keeps 2*s*b*h per block (its input) plus one
    block's working set. The last stage adds the logits, s*b*V*(2 + 4 + 4) bytes (16-bit logits, their fp32
    copy and the saved log-softmax), the first keeps ``in_flight`` micro-batches (1F1B)."""
    s, b, h, a, t = training.seq, training.micro_batch, facts.hidden, facts.heads, shape.tp
    scores = 5 * a * s / (h * t) if training.attention == "eager" else 0.0
    per_token = (34 if t == 1 else 10 + 24 / t) + scores
    block = s * b * h * per_token / shape.sp
    scores_text = " + 5as/(ht)" if training.attention == "eager" else ""
    core = f"sbh(34{scores_text})" if t == 1 else f"sbh(10 + 24/t{scores_text})"
    if training.recompute == "full":
        kept = 2 * s * b * h / shape.sp
        total = share.blocks * kept * in_flight + (block if share.blocks else 0)
        text = f"{share.blocks} blocks x 2sbh x {in_flight} in flight + one block's {core}"
    else:
        total = share.blocks * block * in_flight
        text = f"{share.blocks} blocks x {core} x {in_flight} in flight"
    if shape.sp > 1:
        text += f", /sp {shape.sp}"
    if share.head:
        total += s * b * facts.vocab * 10 / shape.sp
        text += " + logits 10sbV"
    return int(total), text


def _model_states(facts: ModelFacts, shape: GridShape, training: Training, share: _Share) -> tuple[int, int, int, str]:
    n = shape.dp_shard * shape.sp if training.zero_stage >= 1 else shape.size("dp_replicate", "dp_shard", "sp")
    est = estimate.estimate_memory(share.numel, n, training.zero_stage, training.dtype, training.optimizer)
    weights, text = est.params_bytes, est.formula
    if training.zero_stage == 3 and share.small:  # kept whole on every rank, in a flat group
        big = share.numel - share.small
        weights = (training.width * share.small) + (4 * math.ceil(big / n) if training.dtype == "fp32" else 0)
        text = text.replace("params 0", f"params {training.width}Ψs").replace("params 4Ψ/N", "params 4(Ψ-Ψs)/N + 4Ψs")
    return weights, est.grads_bytes, est.optim_bytes, text


def plan(facts: ModelFacts, shape: GridShape, machines: Machines, training: Training) -> Plan:
    """Memory and traffic per GPU of ``shape`` on ``machines``; with a pipeline, of its heaviest stage."""
    if shape.size() != machines.world:
        raise ValueError(f"the layout {shape.describe()} holds {shape.size()} ranks but the machines have {machines.world} GPUs")
    bounds = pipeline_bounds(facts, shape.pp) if shape.pp > 1 else [0, facts.layers + 3]
    best: Plan | None = None
    for stage in range(shape.pp):
        share = _share(facts, shape, training, range(bounds[stage], bounds[stage + 1]))
        one = _plan_stage(facts, shape, machines, training, share, stage)
        if best is None or one.memory.total > best.memory.total:
            best = one
    assert best is not None
    return best


def _plan_stage(facts: ModelFacts, shape: GridShape, machines: Machines, training: Training, share: _Share,
                stage: int) -> Plan:
    z, m, w, r = training.zero_stage, training.grad_accum, training.width, training.reduce_width
    shard_axes = ("dp_shard", "sp") if z >= 1 else ("dp_replicate", "dp_shard", "sp")
    n_shard = shape.size(*shard_axes)
    tokens = training.micro_batch * training.seq
    out: list[Traffic | None] = []

    def add(kind: str, op: str, axes: tuple[str, ...], calls: int, payload: float) -> None:
        out.append(_traffic(kind, op, axes, shape, machines, calls, int(payload)))

    reductions = 1 if z <= 1 else m  # stages 0-1 reduce once per step, 2-3 every micro-step
    buckets = bucket_count(share.small_flat if z == 3 else share.flat, training.bucket_numel)
    grad_calls = buckets + (share.units_fwd if z == 3 else 0)  # one per flat buffer and per stage-3 unit
    if z == 0:
        add("grad all-reduce", "all_reduce", shard_axes, buckets, r * share.numel)
    else:
        add("grad reduce-scatter", "reduce_scatter", shard_axes, reductions * grad_calls, reductions * r * share.numel)
        if shape.dp_replicate > 1:
            add("grad all-reduce across replicas", "all_reduce", ("dp_replicate",), reductions * grad_calls,
                reductions * r * math.ceil(share.numel / n_shard))
    if z == 3:
        add("param all-gather (forward)", "all_gather", shard_axes, m * share.units_fwd, m * w * share.gather_fwd)
        add("param all-gather (backward)", "all_gather", shard_axes, m * share.units_bwd, m * w * share.gather_bwd)
        add("param all-gather (after step)", "all_gather", shard_axes, buckets, w * share.small)
    elif z >= 1:
        add("param all-gather (after step)", "all_gather", shard_axes, buckets, w * share.numel)
    forwards = 2 if training.recompute == "full" else 1  # a recomputed block runs its forward collectives again
    if shape.tp > 1:
        add("tp all-reduce (forward)", "all_reduce", ("tp",), forwards * m * len(share.rowwise),
            forwards * m * w * tokens * sum(share.rowwise))
        add("tp all-reduce (backward)", "all_reduce", ("tp",), m * len(share.colwise), m * w * tokens * sum(share.colwise))
    if shape.sp > 1:
        local = tokens // shape.sp
        kv = max(facts.kv_heads, shape.sp)
        per_block = w * local * facts.head_dim * (2 * facts.heads + 2 * kv)  # q, k, v in, attention out back
        passes = forwards + 1  # forward (and its recomputation), then backward: 4 exchanges each
        add("sp all-to-all", "all_to_all", ("sp",), m * share.blocks * 4 * passes, m * share.blocks * passes * per_block)
    if shape.pp > 1:
        out.append(_send_traffic(shape, machines, stage, m, w * tokens * facts.hidden))
    if z >= 1 or shape.pp > 1 or shape.tp > 1:
        add("grad-norm all-reduce", "all_reduce", AXES, 1, 4 * (3 if training.dtype == "fp16" else 2))
    in_flight = min(shape.pp - stage, m) if shape.pp > 1 else 1
    weights, grads, optim, formula = _model_states(facts, shape, training, share)
    acts, act_text = _activations(facts, shape, training, share, in_flight)
    if z == 3:
        buffers = w * (share.root_gathered + 2 * share.largest_block) + r * share.largest_block
    else:
        buffers = r * share.numel if z == 0 else 0
    memory = Memory(weights=weights, grads=grads, optim=optim, activations=acts, buffers=buffers, formula=formula,
                    activation_formula=act_text)
    return Plan(shape=shape, training=training, pipe_stage=stage, memory=memory,
                traffic=tuple(t for t in out if t is not None), refused=refusal(shape, z),
                fits=memory.total <= machines.usable_bytes, compute=_compute_seconds(facts, shape, machines, training))


def _compute_seconds(facts: ModelFacts, shape: GridShape, machines: Machines, training: Training) -> float:
    """Arithmetic per GPU per step: 6*Ψ + 12*L*h*s FLOPs per token (weights, then attention: the formula of PaLM's
    model FLOPs utilisation), a third more with full recompute (one more forward), the step's tokens spread evenly
    over every GPU, at ``machines.tflops``."""
    s, layers, h = training.seq, facts.layers, facts.hidden
    per_token = 6 * facts.numel + 12 * layers * h * s
    if training.recompute == "full":
        per_token += 2 * facts.numel + 4 * layers * h * s
    tokens = shape.size("dp_replicate", "dp_shard") * training.micro_batch * training.grad_accum * s
    return per_token * tokens / machines.world / (machines.tflops * 1e12)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(facts: ModelFacts, machines: Machines, stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[tuple[GridShape, int]]:
    """Every ``(shape, zero_stage)`` of the machines' GPUs the model can be cut into: tp and sp inside a node
    (their collectives run per layer), hybrid sharding only with a shard group above one rank and ZeRO 1-3."""
    world, out = machines.world, []
    for pp, tp, sp, rep in itertools.product(_divisors(world), repeat=4):
        if pp * tp * sp * rep > world or world % (pp * tp * sp * rep):
            continue
        shape = GridShape(pp=pp, dp_replicate=rep, dp_shard=world // (pp * tp * sp * rep), sp=sp, tp=tp)
        if tp * sp > machines.gpus_per_node or unfit(facts, shape):
            continue
        if rep > 1 and shape.dp_shard == 1:
            continue
        shards = shape.size("dp_replicate", "dp_shard", "sp") > 1
        for z in stages:
            if rep > 1 and z == 0:
                continue
            if not shards and z != min(stages, key=lambda x: (x != 1, x)):
                continue  # nothing to shard over: every stage is the same training, keep one (ZeRO-1 if asked for)
            out.append((shape, z))
    return out


def rank_layouts(facts: ModelFacts, machines: Machines, training: Training, global_batch: int,
                 stages: tuple[int, ...] = (0, 1, 2, 3), by: str = "comm") -> list[Plan]:
    """The plans that fit in memory, by implied communication time (``by="comm"``) or by :attr:`Plan.step`
    (``"step"``: arithmetic stretched by the pipeline bubble, plus communication), then least memory.

    Every layout trains the same ``global_batch`` sequences per step: a layout with ``dp`` data-parallel ranks runs
    ``global_batch / (dp * micro_batch)`` micro-steps (layouts it does not divide are left out), so a pipeline or
    tensor-parallel layout pays for its smaller data-parallel degree with more micro-steps."""
    plans = []
    for shape, z in layouts(facts, machines, stages):
        dp = shape.size("dp_replicate", "dp_shard")
        if global_batch % (dp * training.micro_batch):
            continue
        steps = global_batch // (dp * training.micro_batch)
        plans.append(plan(facts, shape, machines, replace(training, zero_stage=z, grad_accum=steps)))
    if by not in ("comm", "step"):
        raise ValueError(f"rank by: got {by!r}, expected 'comm' or 'step'")
    return sorted((p for p in plans if p.fits), key=lambda p: (p.seconds if by == "comm" else p.step, p.memory.total))


def describe(shape: GridShape, zero_stage: int) -> str:
    """``tp 8 x dp_shard 4, ZeRO-1`` (flat ZeRO shards over every data-parallel rank; hybrid names both axes)."""
    return f"{shape.describe()}, ZeRO-{zero_stage}"
