"""The text ``hf-zero plan`` prints: one layout's memory and collectives, or a ranking of layouts.

Apart from :mod:`hf_zero.planning.planner` (the plan's figures) so that the cost model reads without its column widths,
and a change of wording or layout of the report cannot touch a figure; tests check the figures, the CLI prints
this.
"""

from __future__ import annotations

from hf_zero.planning import estimate
from hf_zero.planning.planner import GB, GIB, Machines, ModelFacts, Plan, Training, describe


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _gb(x: float) -> str:
    return f"{x / GB:.3f}"



def header(facts: ModelFacts, machines: Machines, training: Training, source: str, ranking: bool = False) -> list[str]:
    mixed = training.dtype != "fp32"
    k = estimate.optimizer_state_bytes_per_element(training.optimizer)
    return [
        f"model: {source}: {facts.numel:,} trainable parameters, {facts.layers} blocks, hidden {facts.hidden}, "
        f"{facts.heads} heads ({facts.kv_heads} kv), vocab {facts.vocab}",
        f"machines: {machines.nodes} node(s) x {machines.gpus_per_node} GPUs = {machines.world}, "
        f"{machines.memory_gib:.1f} GiB each ({machines.reserve_gib:.1f} GiB kept free), intra-node {machines.intra_gbs:g} GB/s, "
        f"inter-node {machines.inter_gbs:g} GB/s per GPU",
        f"step: micro-batch {training.micro_batch} x seq {training.seq} per data-parallel rank, "
        + ("micro-steps as the global batch needs (column micro); " if ranking else f"{training.grad_accum} micro-step(s); ")
        + (f"{training.dtype} compute, fp32 master + {training.optimizer} state ({k} B/param), fp32 gradient reduction"
           if mixed else f"fp32, {training.optimizer} state ({k} B/param)")
        + f"; recompute {training.recompute}, {training.attention} attention",
    ]


def format_plan(p: Plan, facts: ModelFacts, machines: Machines, source: str) -> str:
    """The text ``hf-zero plan`` prints for one layout."""
    t, mem = p.training, p.memory
    lines = header(facts, machines, t, source)
    state = f"not runnable yet: {p.refused}" if p.refused else "runnable"
    lines.append(f"layout: {describe(p.shape, t.zero_stage)} ({state})"
                 + (f"; figures of pipeline stage {p.pipe_stage}, the one holding the most" if p.shape.pp > 1 else ""))
    lines += ["", "memory per GPU           GiB  how",
              f"  weights        {_gib(mem.weights):>12}  {mem.formula.split(' + grads')[0]}",
              f"  gradients      {_gib(mem.grads):>12}  {'grads' + mem.formula.split(' + grads')[1].split(' + optim')[0]}",
              f"  optimizer      {_gib(mem.optim):>12}  {'optim' + mem.formula.split(' + optim')[1]}",
              f"  activations    {_gib(mem.activations):>12}  {mem.activation_formula}",
              f"  buffers        {_gib(mem.buffers):>12}  "
              + ("root unit + 2 gathered blocks (compute dtype) + one block's fp32 reduce-scatter input"
                 if t.zero_stage == 3 else "stage 0's fp32 all-reduce copy" if t.zero_stage == 0 else "left out (per bucket)"),
              f"  total          {_gib(mem.total):>12}  of {machines.memory_gib - machines.reserve_gib:.1f} usable: "
              + ("fits" if p.fits else "DOES NOT FIT")]
    lines += ["", "communication per GPU per step (GB = 1e9 bytes)",
              f"  {'kind':<32} {'group':<40} {'calls':>6} {'payload GB':>11} {'intra GB':>10} {'inter GB':>10} {'time s':>8}"]
    for tr in p.traffic:
        group = f"{'x'.join(a for a in tr.axes if getattr(p.shape, a) > 1)} {tr.group} on {tr.nodes} node(s)"
        lines.append(f"  {tr.kind:<32} {group:<40} {tr.calls:>6} {_gb(tr.payload):>11} {_gb(tr.intra):>10} "
                     f"{_gb(tr.inter):>10} {tr.seconds:>8.3f}")
    lines.append(f"  {'total':<32} {'':<40} {'':>6} {_gb(sum(x.payload for x in p.traffic)):>11} {_gb(p.intra):>10} "
                 f"{_gb(p.inter):>10} {p.seconds:>8.3f}")
    lines += ["", *notes()]
    return "\n".join(lines)


def notes() -> list[str]:
    return [
        "payload: the bytes a collective is given (all-gather: its output; reduce-scatter: its input; all-reduce: the "
        "tensor; all-to-all and send: what this rank sends). intra/inter: wire bytes of ring algorithms, (n-1)/n of the "
        "payload for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce; a group over k nodes with m "
        "ranks each sends 1/m of them across nodes (m rings, one NIC each). time: max(intra/intra-bw, inter/inter-bw) "
        "per collective, summed, with no overlap and no latency. Padding (< group size elements per buffer), the "
        "stage-0 and tp first-step checks, and sequence parallelism's loss and batch collectives are left out.",
    ]


def format_ranking(plans: list[Plan], facts: ModelFacts, machines: Machines, training: Training, source: str,
                   top: int, considered: int, global_batch: int, by: str = "comm") -> str:
    lines = header(facts, machines, training, source, ranking=True)
    what = "implied communication time" if by == "comm" else "implied step time (step s)"
    lines += ["", f"{len(plans)} of {considered} layouts fit in memory at a global batch of {global_batch} sequences per step; "
              f"the {min(top, len(plans))} with the least {what} (GB = 1e9 bytes, GiB = 2^30):",
              f"  {'#':>3} {'layout':<42} {'micro':>5} {'mem GiB':>8} {'intra GB':>9} {'inter GB':>9} {'comm s':>7} "
              f"{'bubble':>6} {'step s':>7}  hf_zero"]
    for i, p in enumerate(plans[:top], 1):
        lines.append(f"  {i:>3} {describe(p.shape, p.training.zero_stage):<42} {p.training.grad_accum:>5} "
                     f"{_gib(p.memory.total):>8} {_gb(p.intra):>9} "
                     f"{_gb(p.inter):>9} {p.seconds:>7.3f} {p.bubble:>6.0%} {p.step:>7.2f}  "
                     + (f"not runnable yet: {p.refused}" if p.refused else "runnable"))
    runnable = [p for p in plans if not p.refused]
    if runnable and runnable[0] is not plans[0]:
        i = plans.index(runnable[0]) + 1
        best = runnable[0]
        lines.append(f"  best runnable today: #{i} {describe(best.shape, best.training.zero_stage)}, comm {best.seconds:.3f} s, "
                     f"step {best.step:.2f} s")
    elif not runnable:
        lines.append("  none of the fitting layouts is runnable by hf_zero today")
    lines += ["", "dp_shard alone is flat ZeRO over every data-parallel rank; dp_replicate x dp_shard is hybrid sharding "
              "(shard inside a group, replicate across); pipelines show their heaviest stage; micro: micro-steps per "
              "step. bubble: the share of a 1F1B pipeline's step its stages idle, (pp-1)/(micro+pp-1). step s: "
              f"arithmetic at {machines.tflops:g} TFLOP/s per GPU ((6Ψ + 12Lhs) FLOPs per token, (8Ψ + 16Lhs) with full "
              "recompute) divided by (1 - bubble), plus comm s: no overlap, an upper bound. "
              "`hf-zero plan ... --tp T --pp P --dp-replicate R --sp S` prints one layout's collectives.", *notes()]
    return "\n".join(lines)
