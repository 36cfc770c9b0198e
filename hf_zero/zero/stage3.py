"""ZeRO stage 3's runtime: parameters live sharded and are gathered per unit just before use.

Here is :class:`Stage3Runtime`, the module hooks that drive stage 3's units (:class:`hf_zero.zero.units.Unit`:
shard groups gathered together, each a :class:`hf_zero.zero.sharded_group.ShardedParamGroup`, a
:class:`hf_zero.zero.group.ShardGroup` whose parameters exist only as this rank's shard between uses).

A *unit* is a transformer block (for ``transformers`` models, an instance of a class named in
``_no_split_modules``); in any other model it is found by :func:`hf_zero.zero.units.find_units`, which walks down
through containers whose own ``forward`` never runs (``ModuleList``, ``ModuleDict``) or that only
chain their children (``Sequential``), so that nanoGPT's ``transformer.h[i]`` or a ViT's
``blocks[i]`` is a unit, and otherwise takes each child with parameters. An input embedding no
other module shares is a unit too. Whatever parameters belong to no unit form the *root* unit
(final norm, LM head, a tied embedding, a weight two units share, a parameter of the root itself
such as a position table), which is gathered for the whole forward, since the model's own code
(or a library's fused loss, reading ``lm_head.weight`` without calling the module) may read it
anywhere in there, and stays gathered in backward until its trainable groups' gradients are all
accumulated: right after the LM head's own backward, or at the end for a tied embedding. That
is also what keeps tied embeddings simple.

A unit whose parameters are read outside its own forward (``F.linear(x, self.head.weight)`` in the
parent, a method other than ``forward``, another unit reading its weight) is *pinned*: found on the
engine's first forwards or named with ``register_external_parameter`` (:mod:`hf_zero.zero.external`),
it is from then on gathered and released with the root unit, and its own hooks leave it alone.

Life of a unit in one training step::

    SHARDED --forward pre-hook--> GATHERED --forward post-hook--> SHARDED
            --first output gradient (multi-grad hook)--> GATHERED
            --every parameter's gradient accumulated--> reduce-scatter, SHARDED

A unit with frozen parameters (a LoRA layer's base weights) is SHARDED in backward only once its
inputs' gradients are computed as well: until then an op of the unit may still read a frozen
weight to compute an input's gradient (:meth:`Stage3Runtime._watch_inputs`). Under activation
checkpointing that wraps a unit's ``__call__``, the hooks run again in backward for the
recomputation; there they gather the unit for its backward (:func:`_recomputing`), not for a forward.

While unit i runs, the all-gathers of the units after it are already in flight on a side stream
(prefetch in forward order, then in reverse order during backward), as many as the
``stage3_prefetch_bucket_size`` budget holds (:meth:`Stage3Runtime._prefetch_after`). Gradients are reduce-scattered as soon
as a unit's backward is done and accumulated into this rank's fp32 gradient shard, so stage 3
communicates on every micro-step (holding full gradients across accumulation steps would undo
the point of stage 3).

A forward without grad (evaluation, ``generate``) releases each unit after it as well, within the same memory as
training; it may keep a unit gathered for the next such forward (the next decoding step) only within
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` (:meth:`hf_zero.zero.inference.InferenceKeep.after_unit`),
and the next training forward releases whatever is kept.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.external import OutsideReads, explain_unallocated, external_parameters
from hf_zero.zero.inference import InferenceKeep, _DecodingScope
from hf_zero.zero.sharded_group import DS_STATUS, ShardedParamGroup, ShardState
from hf_zero.zero.units import Unit, find_units, input_embedding_unit, is_lookup, side_entries

# The shard group lives in sharded_group.py, the units and their discovery in units.py; their names are still
# importable from here, where code and tests have imported them.
__all__ = ["DS_STATUS", "ShardState", "ShardedParamGroup", "Stage3Runtime", "Unit", "find_units",
           "input_embedding_unit", "is_lookup", "side_entries"]


def _recomputing() -> bool:
    """Whether a module hook runs inside autograd's backward: the forward of a checkpoint being recomputed.

    Both kinds of ``torch.utils.checkpoint`` recompute from within backward (reentrant: in the
    checkpoint's backward node; non-reentrant: when backward unpacks the first saved tensor), and
    nothing else runs a module's forward there. ``torch.utils.checkpoint`` itself asks the same question.
    """
    return torch._C._current_graph_task_id() != -1


def _tensors_requiring_grad(obj: object) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_requiring_grad(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_requiring_grad(o)]
    if hasattr(obj, "to_tuple"):  # transformers ModelOutput
        return _tensors_requiring_grad(obj.to_tuple())
    return []


def _any_trainable(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` requires grad (those too small to shard count: a unit holds only the rest)."""
    return any(p.requires_grad for p in module.parameters())


class _InputsDone(torch.autograd.Function):
    """The identity on a unit's input tensors; its backward runs once the gradients of all of them are computed.

    It is a node of its own, between the unit and whatever produced its inputs, so it runs as soon as the
    unit's backward is done, before the hooks of the unit that produced them (which gather that unit and
    prefetch the next): the release comes before the next gathers, as without frozen parameters. The
    outputs are detached aliases, not views, so the unit may still modify its inputs in place.
    """

    @staticmethod
    def forward(ctx, runtime: Stage3Runtime, unit: Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        ctx.runtime, ctx.unit = runtime, unit
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        ctx.runtime._inputs_done(ctx.unit)
        return (None, None, *grads)


class Stage3Runtime:
    """The hooks that gather units before use, prefetch the next one and reduce-scatter after backward."""

    def __init__(
        self,
        root: torch.nn.Module,
        units: list[Unit],
        *,
        stream: torch.cuda.Stream | None,
        reduce_stream: torch.cuda.Stream | None = None,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_numel: int = 1_000_000_000,
    ) -> None:
        self.root = root
        self.units = [u for u in units if not u.is_root]
        self.root_unit = next((u for u in units if u.is_root), None)
        self._root_and_pinned: list[Unit] = [self.root_unit] if self.root_unit is not None else []
        # What no-grad forwards keep gathered for the next one (inside generate): hf_zero/zero/inference.py
        self.max_live_numel = max_live_numel  # stage3_max_live_parameters: bounds the prefetch too (_prefetch_after)
        self.inference = InferenceKeep(self.units, self.root_unit, self._root_and_pinned,
                                       max_live_numel=max_live_numel, max_reuse_numel=max_reuse_numel)
        self.stream = stream
        self.reduce_stream = reduce_stream
        self.prefetch_numel = prefetch_numel
        self.order: list[Unit] = []  # forward execution order, recorded on the first training forward
        self._ahead: dict[bool, tuple[list[Unit], dict[int, int]]] = {}  # _set_order's, by reverse
        self._recording: list[Unit] = []
        self.in_backward: set[int] = set()
        # Whether the root's forward now running is one that backward will follow (grad mode on when it began):
        # a unit that then runs without grad is inside a reentrant checkpoint, not an inference forward.
        self.grad_forward = False
        self.in_forward = False  # between the root's pre- and post-hook
        # A training forward's root (and pinned) units stay gathered for its backward: a no-grad forward run between
        # the two (TRL's DPO: the reference log-probs under no_grad after the policy's forward) must leave them.
        self.backward_pending = False
        # > 0 while unwrap_model_for_generation holds every parameter whole: the forward hooks stand aside
        self.held_whole = 0
        self.limit = C.InflightLimit()
        self._unit_of: dict[int, Unit] = {}  # trainable parameter -> its unit
        # Every sharded parameter of a unit other than the root -> that unit (what a read from outside is about).
        self._sharded_of: dict[int, Unit] = {}
        # Which grad modes (True: training) have had a forward watched for outside reads (watch()).
        self._watched: set[bool] = set()
        self.handles = []
        for u in self.units:
            self.handles.append(u.module.register_forward_pre_hook(self._make_pre(u), with_kwargs=True))
            self.handles.append(u.module.register_forward_hook(self._make_post(u)))
            for g in u.groups:
                g.pin_for = functools.partial(self.pin_for, u)  # register_external_parameter, after the fact
                for s in g.slots:
                    self._sharded_of[id(s.param)] = u
        self.handles.append(root.register_forward_pre_hook(self._root_pre))
        self.handles.append(root.register_forward_hook(self._root_post))
        self._side_depth = 0  # > 0 while a side entry (below) runs outside the root's forward
        for entry in side_entries(root, [u.module for u in self.units]):
            self.handles.append(entry.register_forward_pre_hook(self._side_pre))
            self.handles.append(entry.register_forward_hook(self._side_post))
        for m in root.modules():  # inside generate, its decoding steps may keep units gathered (InferenceKeep)
            if callable(getattr(type(m), "generate", None)):
                self.handles.append(_DecodingScope(m, self.inference))
        for u in units:
            for g in u.groups:
                if g.trainable:
                    for s in g.slots:
                        self._unit_of[id(s.param)] = u
                        self.handles.append(s.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        for module, param in external_parameters(root):  # registered before initialize, as DeepSpeed's examples do
            owner = self._sharded_of.get(id(param))
            if owner is not None:
                self.pin_for(owner, module)

    # ------------------------------------------------------ reads from outside a unit

    def pin(self, unit: Unit) -> None:
        """From now on gather ``unit`` with the root unit and keep it to the end of its backward (see the module docstring).

        Within a forward it is gathered at once: the caller is about to read it. Its own hooks leave it alone from
        here on (a multi-grad hook its earlier forward left behind included), and no prefetch counts it.
        """
        if unit.pinned:
            return
        unit.pinned = True
        self._root_and_pinned.append(unit)
        self.inference.kept.pop(id(unit), None)  # counted with the root from now on, which is kept (or not) afresh
        self.inference.root_kept = False
        if self.order:
            self._set_order([u for u in self.order if u is not unit])
        if self.in_forward:
            unit.gather(None)
            unit.wait()

    def pin_for(self, unit: Unit, module: torch.nn.Module) -> None:
        """``module`` reads a parameter of ``unit`` (register_external_parameter): pin it unless ``module`` is inside it."""
        if not any(m is module for m in unit.module.modules()):
            self.pin(unit)

    def _read_outside(self, param: torch.nn.Parameter) -> None:
        unit = self._sharded_of[id(param)]
        if unit.running == 0 and not unit.pinned:
            self.pin(unit)

    def watch(self) -> contextlib.AbstractContextManager:
        """What the engine runs a forward under: the outside-reads watch on the first forward of each grad mode."""
        grad = torch.is_grad_enabled()
        if grad in self._watched or not self._sharded_of:
            return contextlib.nullcontext()
        self._watched.add(grad)
        return OutsideReads(self._sharded_of, self._read_outside)

    def explain(self, error: BaseException) -> str | None:
        """One sentence for a storage error that a read of a still-sharded parameter raised, else None."""
        names = {id(p): n for n, p in self.root.named_parameters()}
        sharded = {pid: (names.get(pid, "?"), u.name) for pid, u in self._sharded_of.items()}
        return explain_unallocated(error, sharded, self.root)

    # -------------------------------------------------------------- forward

    # The no-grad forwards' keep policy and its state are InferenceKeep's (``self.inference``,
    # hf_zero/zero/inference.py); the engine, the optimizer and the checkpoints call these two.

    def release_inference(self) -> None:
        """Reshard everything that no-grad forwards (evaluation, generate) left gathered."""
        self.inference.release()

    def kept_numel(self) -> int:
        """Elements that no-grad forwards left gathered for the next one (units, and the root with the pinned ones)."""
        return self.inference.kept_numel()

    @contextlib.contextmanager
    def standing_aside(self) -> Iterator[None]:
        """The forward hooks do nothing inside: the caller holds every parameter whole (``unwrap_model_for_generation``).

        No unit is gathered, released, prefetched or recorded into the forward order by the forwards that run in
        here, so the caller's gather holds for the whole block, with or without grad mode.
        """
        self.held_whole += 1
        try:
            yield
        finally:
            self.held_whole -= 1

    def _root_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.held_whole:
            return
        self._recording = []
        self.grad_forward = torch.is_grad_enabled()
        self.in_forward = True
        for u in self.units:
            u.running = 0  # a forward that raised left its count behind
        self._side_depth = 0  # likewise a side entry's
        if self.grad_forward:
            self.release_inference()
        for u in self._with_root():
            u.gather(None)
        for u in self._with_root():
            u.wait()

    def _side_pre(self, module: torch.nn.Module, args: tuple) -> None:
        """A side entry (an encoder that ``generate`` runs on its own) starts outside the root's forward: it reads
        the root unit's parameters (the shared embedding, its final norm), so they are gathered for it."""
        if self.held_whole or self.in_forward:
            return
        self._side_depth += 1
        if self._side_depth == 1:
            for u in self._with_root():
                u.gather(None)
            for u in self._with_root():
                u.wait()

    def _side_post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        """Without grad the root is kept or released as after a no-grad forward of the root; with grad it stays
        for backward, which releases it at its end (finish_backward)."""
        if self.held_whole or self.in_forward or self._side_depth == 0:
            return
        self._side_depth -= 1
        if self._side_depth == 0 and not torch.is_grad_enabled():
            self.inference.after_root(self.backward_pending)

    def _with_root(self) -> list[Unit]:
        """The root unit and the pinned units: gathered for the whole forward, released as the root is."""
        return self._root_and_pinned

    def _root_post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self.held_whole:
            return
        self.grad_forward = False
        self.in_forward = False
        recorded = [u for u in self._recording if not u.pinned]
        if recorded and (not self.order or len(recorded) != len(self.order)):
            self._set_order(recorded)
        if not torch.is_grad_enabled():
            self.inference.after_root(self.backward_pending)
            return
        if not _tensors_requiring_grad(output):
            for u in self._with_root():
                u.reshard()  # no backward will come through it; otherwise it stays for backward
        else:
            self.backward_pending = True

    def _set_order(self, order: list[Unit]) -> None:
        """Record the forward order, with the backward order and each unit's first place in either, for _prefetch_after,
        and each unit's reuse distance for no-grad forwards (:meth:`InferenceKeep.set_order`)."""
        self.order = order
        self._ahead = {}
        for reverse, seq in ((False, order), (True, order[::-1])):
            first: dict[int, int] = {}
            for i, u in enumerate(seq):
                first.setdefault(id(u), i)
            self._ahead[reverse] = (seq, first)
        self.inference.set_order(order)

    def _prefetch_after(self, unit: Unit, reverse: bool) -> None:
        """Gather the units that run after ``unit``, as far ahead as ``stage3_prefetch_bucket_size`` allows.

        The budget counts, in elements as DeepSpeed counts prefetched parameters, the units gathered
        ahead of the running one (in flight or already gathered). The next unit is gathered
        whenever the budget is above 0; the ones after it only while everything ahead stays within
        the budget; ``stage3_max_live_parameters`` caps all gathered units together. The default
        (5e7) holds one block of a billion-parameter model (4e7 to 2e8 elements), so such a model
        runs one unit ahead, as FSDP2 does; smaller blocks run several ahead; 0 turns it off.
        """
        if not self.order or self.prefetch_numel <= 0:
            return
        order, first = self._ahead[reverse]
        i = first.get(id(unit))
        if i is None:
            return
        # Summed over every unit only when a gather is due: before it, nothing here changes what is gathered.
        live: int | None = None
        ahead = 0
        for j in range(i + 1, len(order)):
            nxt = order[j]
            if nxt.pinned or reverse and not nxt.needs_backward:
                continue  # it would stay gathered, unused, until the end of backward
            if ahead > 0 and ahead + nxt.numel > self.prefetch_numel:
                break
            if not nxt.gathered:
                if live is None:
                    live = sum(u.numel for u in self.units if u.gathered and not u.pinned)
                if live + nxt.numel > self.max_live_numel:
                    break
                nxt.gather(self.stream)
                live += nxt.numel
            ahead += nxt.numel

    def _watch_inputs(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Release the unit's frozen groups once its inputs' gradients are computed (and its own are reduced).

        A frozen parameter is read in backward only to compute the gradient of something upstream: an
        input of the unit, or one of the unit's trainable parameters. When both gradients are there, no
        op of the unit is left to run. The trainable gradients alone are not enough: under LoRA the
        adapters' gradients are ready before the base layer has used its frozen weight for the gradient
        of its input. The unit's input tensors that require grad go through :class:`_InputsDone`;
        returns the new ``(args, kwargs)``, or None to leave them. A unit without frozen groups needs
        none of this (_reduce releases it whole); one whose input requiring grad sits inside a
        container (not replaced here) keeps its frozen groups to the end of backward, as before.
        """
        if not unit.has_frozen or not torch.is_grad_enabled():
            return None
        at = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if torch.is_tensor(v) and v.requires_grad]
        if len(at) + len(keys) != len(_tensors_requiring_grad((args, kwargs))):
            unit.pending += 1  # never counted down: held until finish_backward
            return None
        if not at and not keys:
            return None  # no input gradient to wait for: the unit's own gradients end its backward
        outs = _InputsDone.apply(self, unit, *(args[i] for i in at), *(kwargs[k] for k in keys))
        unit.pending += 1
        new_args = list(args)
        for i, t in zip(at, outs):
            new_args[i] = t
        return tuple(new_args), {**kwargs, **dict(zip(keys, outs[len(at):]))}

    def _inputs_done(self, unit: Unit) -> None:
        unit.pending -= 1
        if unit.pending == 0 and not unit.pinned and (unit.reduced or unit.trainable_count == 0):
            unit.reshard()

    def _make_pre(self, unit: Unit):
        def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if self.held_whole:
                return None
            if _recomputing():
                if unit.pinned:
                    return None
                # A checkpoint that wraps the unit's __call__ (transformers up to 5.17's gradient checkpointing,
                # torch.utils.checkpoint(layer, ...) in model code) runs these hooks again in backward. This is
                # that unit's backward, not a forward: gather it for backward and prefetch in backward order.
                # Prefetching in forward order here would re-gather the units whose backward is already done,
                # and nothing would release them before the end of backward.
                self._pre_backward(unit)
                # A reentrant checkpoint's forward ran without grad, so nothing watches the inputs yet: its
                # backward goes through this recomputation, watch them here. A non-reentrant one's forward
                # watched them already (the recomputed graph is never backpropagated).
                return self._watch_inputs(unit, args, kwargs) if unit.pending == 0 else None
            unit.running += 1
            if unit.pinned:  # whole since the root's pre-hook, until the end of its backward
                unit.gather(None)  # (a no-op, unless the unit runs without the root: model.embed(ids))
                unit.wait()
                return None
            unit.gather(None)
            unit.wait()
            if unit.trainable_count == 0:
                unit.inputs_need_grad = bool(_tensors_requiring_grad((args, kwargs)))
            self._recording.append(unit)
            self._prefetch_after(unit, reverse=False)
            return self._watch_inputs(unit, args, kwargs)

        return pre

    def _make_post(self, unit: Unit):
        def post(module: torch.nn.Module, args: tuple, output: object) -> None:
            if self.held_whole:
                return
            if _recomputing():
                # The recomputation's backward is about to use these parameters; the unit is released
                # when its gradients are reduced (_reduce), as in a backward without checkpointing.
                return
            unit.running = max(0, unit.running - 1)
            if unit.pinned:
                # Released with the root unit; unless it ran on its own, outside the root's forward, without grad.
                if (not self.in_forward and not torch.is_grad_enabled() and not self.inference.root_kept
                        and not self.backward_pending):
                    unit.reshard()
                return
            if not torch.is_grad_enabled() and not self.grad_forward:
                # Evaluation, generate: released as in training unless it fits under the live cap to be reused by the
                # next forward (the next decoding step); released by the next training forward at the latest.
                self.inference.after_unit(unit, ordered=bool(self.order))
                return
            if not torch.is_grad_enabled():
                unit.needs_backward = True  # a reentrant checkpoint's forward: its recomputation has a backward
                unit.reshard()
                return
            tensors = _tensors_requiring_grad(output)
            if tensors and not self._backward_reads_weights(unit):
                tensors = []  # gathering it in backward would only cost an all-gather and hold it there
            unit.needs_backward = bool(tensors)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g: self._pre_backward(unit), mode="any")
            unit.reshard()

        return post

    @staticmethod
    def _backward_reads_weights(unit: Unit) -> bool:
        """Whether backward through the unit's last training forward (whose output requires grad) reads its weights.

        Not when it is a plain embedding lookup (its weight's gradient needs only the ids and the output's
        gradient), nor when every weight is frozen and no input needs a gradient: the output then requires grad
        only because a hook made it so (transformers' ``enable_input_require_grads``, on the embedding of a LoRA
        model under checkpointing). Parameters too small to shard count too: a trainable scale times a frozen
        weight reads the weight for the scale's gradient.
        """
        if unit.lookup_only:
            return False
        return unit.trainable_count > 0 or unit.inputs_need_grad or _any_trainable(unit.module)

    # ------------------------------------------------------------- backward

    def _pre_backward(self, unit: Unit) -> None:
        if unit.pinned:
            return  # whole until its gradients are reduced; a multi-grad hook from before it was pinned
        unit.gather(None)
        unit.wait()
        self.in_backward.add(unit.index)
        self._prefetch_after(unit, reverse=True)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        unit = self._unit_of[id(param)]
        unit.ready += 1
        if unit.ready == unit.trainable_count:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        for g in unit.groups:
            if g.trainable:
                g.reduce_grads(self.reduce_stream, self.limit)
        unit.ready = 0
        unit.reduced = True
        # Frozen groups stay while an op of the unit may still read them to compute an input's gradient; the
        # root's until the end of backward (nothing watches the inputs of the code that reads them). A trainable
        # group can go: every op reading its weights computed their gradient too, and those are all accumulated.
        unit.reshard(trainable_only=unit.pending > 0 or unit.is_root or unit.pinned)
        self.in_backward.discard(unit.index)

    def finish_backward(self) -> None:
        """End of backward: reduce what is still pending (root, units with unused parameters), release all."""
        self.backward_pending = False
        for u in self.units:
            if u.index in self.in_backward or any(g.has_grads() for g in u.groups):
                self._reduce(u)
            u.reshard()
            u.pending, u.reduced = 0, False
        if self.root_unit is not None:
            if any(g.has_grads() for g in self.root_unit.groups):
                self._reduce(self.root_unit)
            self.root_unit.reshard()
        self.limit.drain(self.reduce_stream)
        C.wait_for(self.stream)
        C.wait_for(self.reduce_stream)
