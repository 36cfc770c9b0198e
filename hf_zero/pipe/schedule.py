"""Pipeline schedules as plain lists of actions, one list per stage.

A schedule is data, not code that talks to other processes: ``one_f_one_b(stages, stage_id,
micro_batches)`` returns what that stage does, in order, so it can be printed, compared with a
picture in a paper and checked by unit tests (every forward before its backward, every send
matched by its neighbour's receive in the same order, how many activations are alive) without
starting a process. :class:`hf_zero.pipe.engine.PipelineEngine` walks the list.

Communication actions that stand next to each other in a list form one *exchange*: the engine
posts them together (``torch.distributed.batch_isend_irecv``). That is what keeps 1F1B from
deadlocking on NCCL, where a send only finishes once the peer has posted the matching receive:
in the steady state stage ``s`` sends an activation to ``s+1`` while ``s+1`` sends a gradient
to ``s``; posted one after the other, each would wait for the other's receive, posted together
they pass. :func:`simulate` checks exactly that rendezvous rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule; ``micro`` is the micro-batch it concerns (-1: none).

    The subclasses below only name the kind of step; they inherit the frozen dataclass (its
    constructor, equality by class and ``micro``, hashing and repr).
    """

    micro: int = -1

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.micro})" if self.micro >= 0 else type(self).__name__


class LoadMicroBatch(Action):
    """Take the next micro-batch from the data iterator (first stage: inputs, last stage: labels)."""


class Forward(Action):
    """Run this stage's layers on the micro-batch (and the loss on the last stage)."""


class Backward(Action):
    """Backpropagate the micro-batch through this stage; frees what its forward kept."""


class SendActivation(Action):
    """Send the forward output to the next stage."""


class RecvActivation(Action):
    """Receive the forward input from the previous stage."""


class SendGrad(Action):
    """Send the gradient of the forward input back to the previous stage."""


class RecvGrad(Action):
    """Receive the gradient of the forward output from the next stage."""


class ReduceGrads(Action):
    """End of the batch: tied weights' gradients summed over the stages that share them."""


class OptimizerStep(Action):
    """Apply the optimizer (norm and clipping over the whole pipeline)."""


COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)


def _check(stages: int, stage_id: int, micro_batches: int) -> None:
    if stages < 1 or not 0 <= stage_id < stages:
        raise ValueError(f"stage_id {stage_id} is not a stage of a {stages}-stage pipeline")
    if micro_batches < 1:
        raise ValueError(f"micro_batches: got {micro_batches}, a pipeline needs at least one")


def _fwd(stages: int, s: int, i: int, send: bool = True) -> list[Action]:
    out: list[Action] = []
    if s == 0 or s == stages - 1:
        out.append(LoadMicroBatch(i))
    if s > 0:
        out.append(RecvActivation(i))
    out.append(Forward(i))
    if send and s < stages - 1:
        out.append(SendActivation(i))
    return out


def _bwd(stages: int, s: int, j: int) -> list[Action]:
    """A backward as it stands alone: receive the output's gradient, backpropagate, send the input's."""
    out: list[Action] = [] if s == stages - 1 else [RecvGrad(j)]
    out.append(Backward(j))
    if s > 0:
        out.append(SendGrad(j))
    return out


def one_f_one_b(stages: int, stage_id: int, micro_batches: int, train: bool = True) -> list[Action]:
    """PipeDream-flush's 1F1B: a warm-up of forwards, then one forward per backward.

    Stage ``s`` runs ``stages - s - 1`` forwards before its first backward, so it never holds
    more than ``stages - s`` micro-batches' activations (GPipe holds all ``micro_batches``); the
    bubble is the same as GPipe's, ``(p-1)/(m+p-1)`` of the step. In the steady state the
    send of an activation and the receive of a gradient go to the same neighbour and are
    listed back to back, so the engine posts them as one exchange.
    """
    _check(stages, stage_id, micro_batches)
    if not train:
        return inference(stages, stage_id, micro_batches)
    s, m, last = stage_id, micro_batches, stage_id == stages - 1
    warmup = min(stages - s - 1, m)
    acts: list[Action] = []
    for i in range(warmup):
        acts += _fwd(stages, s, i)
    steady = m - warmup
    for k in range(steady):
        i, j = warmup + k, k
        acts += _fwd(stages, s, i, send=False) if k == 0 else [a for a in _fwd(stages, s, i, send=False)
                                                             if not isinstance(a, RecvActivation)]
        if not last:
            acts += [SendActivation(i), RecvGrad(j)]
        acts.append(Backward(j))
        if s > 0:
            acts.append(SendGrad(j))
            if k < steady - 1:
                acts.append(RecvActivation(i + 1))
    for j in range(steady, m):
        acts += _bwd(stages, s, j)
    return acts + [ReduceGrads(), OptimizerStep()]


def gpipe(stages: int, stage_id: int, micro_batches: int, train: bool = True) -> list[Action]:
    """GPipe: every forward, then every backward; holds all micro-batches' activations at once."""
    _check(stages, stage_id, micro_batches)
    if not train:
        return inference(stages, stage_id, micro_batches)
    acts: list[Action] = []
    for i in range(micro_batches):
        acts += _fwd(stages, stage_id, i)
    for j in range(micro_batches):
        acts += _bwd(stages, stage_id, j)
    return acts + [ReduceGrads(), OptimizerStep()]


def inference(stages: int, stage_id: int, micro_batches: int) -> list[Action]:
    """Forwards only (``eval_batch`` and ``engine(inputs)``)."""
    _check(stages, stage_id, micro_batches)
    acts: list[Action] = []
    for i in range(micro_batches):
        acts += _fwd(stages, stage_id, i)
    return acts


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def build(name: str, stages: int, stage_id: int, micro_batches: int, train: bool = True) -> list[Action]:
    """The schedule called ``name`` ("1f1b" or "gpipe") for one stage."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule: got {name!r}, expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stages, stage_id, micro_batches, train=train)


def exchanges(actions: list[Action], stage_id: int) -> list[list[Action]]:
    """Split a schedule into steps: each compute action alone, runs of communication with one neighbour together."""
    out: list[list[Action]] = []
    for a in actions:
        if isinstance(a, COMM) and out and isinstance(out[-1][0], COMM) and peer(out[-1][0], stage_id) == peer(a, stage_id):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def peer(action: Action, stage_id: int) -> int:
    """The stage a communication action talks to."""
    return stage_id + 1 if isinstance(action, (SendActivation, RecvGrad)) else stage_id - 1


def max_live_activations(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward has not (activations kept)."""
    live = peak = 0
    for a in actions:
        if isinstance(a, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(a, Backward):
            live -= 1
    return peak


def simulate(schedules: list[list[Action]]) -> int:
    """Run every stage's schedule under NCCL's rendezvous rule; return the number of rounds.

    A stage stands at one exchange at a time; the exchange completes once the neighbour has
    posted (in its current exchange or an earlier one) the matching operation: the k-th
    activation send from ``s`` to ``s+1`` matches the k-th activation receive on ``s+1``, and
    likewise for gradients. Raises ``RuntimeError`` naming the stuck stages on a deadlock.
    """
    steps = [exchanges(acts, s) for s, acts in enumerate(schedules)]
    pos = [0] * len(steps)
    # posted[(src, dst, kind)] = micro-batches posted so far, in order; kind: "act" / "grad"
    sent: dict[tuple[int, int, str], list[int]] = {}
    recvd: dict[tuple[int, int, str], list[int]] = {}

    def key(a: Action, s: int) -> tuple[dict, tuple[int, int, str]]:
        kind = "act" if isinstance(a, (SendActivation, RecvActivation)) else "grad"
        if isinstance(a, (SendActivation, SendGrad)):
            return sent, (s, peer(a, s), kind)
        return recvd, (peer(a, s), s, kind)

    posted = [False] * len(steps)
    rounds = 0
    while any(p < len(st) for p, st in zip(pos, steps)):
        rounds += 1
        progressed = False
        for s, st in enumerate(steps):
            if pos[s] >= len(st) or posted[s]:
                continue
            for a in st[pos[s]]:
                if isinstance(a, COMM):
                    table, k = key(a, s)
                    table.setdefault(k, []).append(a.micro)
            posted[s] = True
            progressed = True
        for s, st in enumerate(steps):
            if pos[s] >= len(st):
                continue
            done = True
            for a in st[pos[s]]:
                if not isinstance(a, COMM):
                    continue
                table, k = key(a, s)
                other = recvd if table is sent else sent
                mine = table[k]
                idx = len(mine) - 1 - mine[::-1].index(a.micro)
                theirs = other.get(k, [])
                if len(theirs) <= idx:
                    done = False
                elif theirs[idx] != a.micro:
                    raise RuntimeError(f"stage {s}: {a} is matched by micro-batch {theirs[idx]} on stage {peer(a, s)}")
            if done:
                pos[s] += 1
                posted[s] = False
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {[str(a) for a in steps[s][pos[s]]]}" for s in range(len(steps)) if pos[s] < len(steps[s])]
            raise RuntimeError("pipeline schedule deadlocks: " + "; ".join(stuck))
    return rounds
