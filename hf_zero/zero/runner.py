"""Step runners: the optimizer step and the publish of the new weights, one way of taking them per class.

:class:`hf_zero.zero.optimizer.ShardedOptimizer` builds the shard groups and the hooks; how its step runs
follows from choices made once, at build time (is the optimizer offloaded, is the post-step all-gather
deferred to the next forward), so the runner is picked then (:func:`pick_runner`) and the step is a
method call on it (``ShardedOptimizer.step_and_publish`` -> ``runner.step(timed)``), with no branch
taken per step:

- :class:`DeviceRunner`: the optimizer on the device, every group published, the compute stream waits;
- :class:`DeferredPublishRunner` (``overlap_param_gather`` at stages 0-2): the same step, the groups
  published in forward order with their all-gathers left in flight, each waited for by the first forward
  hook that reads it (:class:`hf_zero.zero.overlap.DeferredPublish`);
- :class:`HostRunner` (``offload_optimizer``): the host masters stepped group by group on the CPU, each group
  copied back and published at once (:class:`hf_zero.zero.host_step.HostStep`), inside ``engine.step()``;
- :class:`DeferredHostRunner` (``offload_optimizer`` with ``overlap_param_gather`` at stages 1-2): the first
  group the forward reads stepped at once, every other one where the next forward first reads it;
- :class:`SpeculativeHostRunner` (``offload_optimizer.super_offload``): :class:`HostRunner`'s step with the groups
  whose gradients reached host memory early enough stepped during the backward that ends the step, undone exactly
  where clipping or a skipped step says so; :class:`SpeculativeDeferredHostRunner` the same over
  :class:`DeferredHostRunner` (with ``overlap_param_gather``);
- :class:`ZenFlowRunner` (``zero_optimization.zenflow``): each step only the important columns stepped, on the device,
  the others by the host every ``update_interval`` steps (:class:`hf_zero.zero.zenflow.ZenFlow`);
- :class:`NvmeRunner` (``"device": "nvme"``): :class:`HostRunner`'s step with the masters and optimizer state
  read from files and written back around each group's step (:mod:`hf_zero.zero.nvme`).

Whether the host runners read each group's gradient from its host copy or stream it from the device through
two shared buffers is their property (``stream_grads``, from :func:`hf_zero.zero.offload.plan_host_memory`).

The rule: a new way of taking the step (NVMe offload) is a new runner class in this module, registered in
:func:`pick_runner`, not a branch in an existing runner or in ``ShardedOptimizer``. ``offload_optimizer.ratio`` < 1
is not one: the host runners step the groups kept on the device first (:meth:`HostRunner._step_device`, a no-op
without any), then the host groups as before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from hf_zero.zero import collectives as C
from hf_zero.zero.group import ShardGroup
from hf_zero.zero.host_step import HostStep, fused_adam_group, report_step_parts
from hf_zero.zero.nvme import NvmeStores, pooled_raise
from hf_zero.zero.offload import (
    OffloadPolicy,
    host_buffer,
    is_host_master,
    use_host_kernels,
)
from hf_zero.zero.overlap import DeferredPublish
from hf_zero.zero.speculative_step import SpeculativeHostStep
from hf_zero.zero.unit_steps import DeferredUnitSteps
from hf_zero.zero.zenflow import NAMESPACE as ZENFLOW_STATE
from hf_zero.zero.zenflow import ZenFlow

Timed = Callable[[str, float], None]  # wall_clock_breakdown's sink (hf_zero/training/timers.py): (part, seconds)


class StepRunner:
    """One way to step the masters and publish the weights, chosen once (:func:`pick_runner`).

    ``groups`` are the optimizer's shard groups (:attr:`ShardedOptimizer.groups`, in that order), ``stream``
    its communication stream (None off CUDA).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup],
                 stream: torch.cuda.Stream | None) -> None:
        self.optimizer, self.groups, self.stream = optimizer, list(groups), stream

    def step(self, timed: Timed | None) -> None:
        """Step this rank's masters with the reduced gradients, then publish the new weights to every rank.

        ``timed(part, seconds)``, when given, receives the parts of an offloaded step (``hf_zero/training/timers.py``).
        """
        raise NotImplementedError

    def release(self) -> None:
        """Drop every group and buffer this runner holds (``engine.destroy()``); it steps nothing afterwards."""
        self.groups = []

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every master, optimizer state and shard in memory for the block (a save, a load); collective. Only
        :class:`NvmeRunner` keeps any of them elsewhere."""
        yield

    # The speculative step's three moments (SpeculativeHostRunner); the other runners take no step before the verdict.
    def arm(self, coef: float) -> None:
        """Before the backward that ends a step, whose gradients the policy will multiply by ``coef`` unless it clips."""

    def verdict(self, coef: torch.Tensor | float) -> None:
        """The coefficient the step policy multiplies this step's gradients by, before it does."""

    def discard(self) -> None:
        """This step's gradients are dropped without a step (skipped, cleared)."""

    # The prefix of the optimizer-state keys this runner lays its own state under during resident() (a checkpoint then
    # carries them; a run whose runner has another or none leaves them out when it loads one); None: it has none.
    state_namespace: str | None = None

    def set_epoch_length(self, steps: int) -> None:
        """The training loader's epoch is ``steps`` optimizer steps (only ZenFlow's reselection reads it)."""


class DeviceRunner(StepRunner):
    """The optimizer steps the masters on the device; every group publishes and the compute stream waits for it."""

    def step(self, timed: Timed | None) -> None:
        groups = self.groups
        for g in groups:
            g.before_step()
        self.optimizer.step()
        for g in groups:
            g.publish_master(self.stream)
        C.wait_for(self.stream)


class DeferredPublishRunner(StepRunner):
    """``overlap_param_gather`` at stages 0-2: as :class:`DeviceRunner`, but the step returns with the groups'
    all-gathers in flight, issued in the order the next forward reads them, and each is waited for by the first
    forward hook that reads it (:class:`hf_zero.zero.overlap.DeferredPublish`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 overlap: DeferredPublish) -> None:
        super().__init__(optimizer, groups, stream)
        self.overlap: DeferredPublish | None = overlap

    def step(self, timed: Timed | None) -> None:
        overlap = self.overlap
        assert overlap is not None, "the runner was released (engine.destroy())"
        overlap.wait_all()  # a step with no forward since the last: its gathers still write the buffers
        for g in self.groups:
            g.before_step()
        self.optimizer.step()
        # No wait here: each group is waited for where it is first read (hf_zero/zero/overlap.py).
        for g in overlap.order:
            g.publish_master(self.stream, defer=True)  # type: ignore[call-arg]
        overlap.armed()

    def release(self) -> None:
        super().release()
        self.overlap = None


class HostRunner(StepRunner):
    """``offload_optimizer``: the host masters stepped one group at a time on the CPU, each group's copy back to the
    device and all-gather issued as soon as it is stepped (:class:`hf_zero.zero.host_step.HostStep`), all inside the
    step; the compute stream then waits for them.

    ``stream_grads`` (:attr:`hf_zero.zero.offload.HostPlan.STREAM_GRADS`): the groups kept their fp32 gradient
    shards on the device, and the step copies them to the host through two shared buffers of the largest group
    (:attr:`grad_buffers`, made at the first step that needs them); otherwise each group's ``before_step`` hands
    it its own host copy. Adam/AdamW step with torch's fused CPU kernel.

    ``offload_optimizer.ratio`` < 1 (ZeRO-Offload++'s Twin-Flow): the groups the build kept on the device
    (:attr:`device_groups`, their master's ``.grad`` the reduced shard there) are stepped first, in one optimizer call
    with every host master's ``.grad`` cleared (torch's optimizers skip those), and published; on CUDA that call only
    queues kernels, so the device steps its share while the CPU steps the host groups (:meth:`_step_device`).
    """

    reads_grad16 = True  # HostStep steps what before_step hands it, a bf16 host copy included (NvmeRunner: no)

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, offload: OffloadPolicy, stream_grads: bool) -> None:
        super().__init__(optimizer, groups, stream)
        use_host_kernels(optimizer)
        self.device = device
        self.threads = offload.host_threads
        self.stream_grads = stream_grads
        self.pin = offload.pin_memory and torch.cuda.is_available()
        self.grad_buffers: list[torch.Tensor] = []  # the two shared host buffers of a streamed step
        self.sub_group_size = offload.sub_group_size  # each group's host step in ranges of about this many elements
        self.host_groups = [g for g in self.groups if is_host_master(g)]
        # offload_optimizer.ratio < 1: the trainable groups whose master and optimizer state stayed on the device
        self.device_groups = [g for g in self.groups if g.master is not None and not is_host_master(g)]
        # the one-pass kernel steps every host master: a gradient that is exactly bf16 may cross to the host in bf16
        if self.reads_grad16 and not stream_grads and self.host_groups and all(
                fused_adam_group(optimizer, g.master, None) is not None for g in self.host_groups):  # type: ignore[arg-type]
            for g in self.host_groups:
                g.grad16 = True  # type: ignore[attr-defined]

    _widened: torch.Tensor | None = None

    def _scratch(self, numel: int) -> torch.Tensor:
        """One fp32 host buffer of at least ``numel`` elements, made at first use and reused by every group after: a
        bf16 copy read clipped (:meth:`hf_zero.zero.host_grads._HostMaster.step_grad`), or, under ``super_offload``, a
        gradient its early step scales by fp16's 1 / loss scale (bf16 runs have no loss scale, fp16 runs no bf16
        copies: the two never share a run)."""
        if self._widened is None or self._widened.numel() < numel:
            self._widened = torch.empty(max(numel, max(g.master.numel() for g in self.host_groups)),  # type: ignore[union-attr]
                                        dtype=torch.float32)
        return self._widened

    def _work(self) -> tuple[list[tuple[ShardGroup, torch.Tensor]], list[torch.Tensor] | None]:
        """The groups to step with their gradients (see :class:`HostStep`), each master's ``.grad`` cleared, and the
        shared buffers when the gradients are streamed."""
        streamed: list[torch.Tensor] | None = None
        if self.stream_grads:  # each group's fp32 shard waited on the device; the step streams it through two buffers
            work = [(g, g.reduced_grad()) for g in self.host_groups if g.reduced_grad() is not None]
            largest = max((grad.numel() for _, grad in work), default=0)  # type: ignore[union-attr]
            if largest and (not self.grad_buffers or self.grad_buffers[0].numel() < largest):
                self.grad_buffers = [host_buffer(largest, torch.float32, pin=self.pin) for _ in range(2)]
            streamed = self.grad_buffers
        else:  # before_step found each group's host copy (step_copy; fp32 ones also as the master's .grad)
            work = [(g, grad) for g in self.host_groups if (grad := g.step_copy()) is not None]  # type: ignore[attr-defined]
        for g, _ in work:
            g.master.grad = None  # type: ignore[union-attr]  # the optimizer sees one group's gradient at a time
        return work, streamed  # type: ignore[return-value]

    def _step_device(self) -> list[tuple[ShardGroup, torch.Tensor]]:
        """``ratio`` < 1: step and publish the groups kept on the device, after :meth:`_work` cleared every host master's
        ``.grad`` (so the optimizer steps only these). On CUDA this queues the kernels and returns, and the host step
        that follows runs beside them; each master is stepped once with its own state, so the arithmetic is the same
        optimizer's on the same values as with every group in one place.

        Returns the groups stepped with their gradients, taken off their masters so the host step's optimizer calls
        skip them; the caller puts them back after it (as after a step without offload, until ``zero_grad``)."""
        stepped = [(g, g.master.grad) for g in self.device_groups if g.master.grad is not None]  # type: ignore[union-attr]
        if not stepped:
            return []
        self.optimizer.step()
        for g, _ in stepped:
            g.publish_master(self.stream)
            g.master.grad = None  # type: ignore[union-attr]
        return stepped  # type: ignore[return-value]

    def step(self, timed: Timed | None) -> None:
        clock = time.perf_counter
        t0 = clock()
        for g in self.groups:
            g.before_step()
        t1 = clock()
        work, streamed = self._work()
        prestepped = self._prestepped(work)
        on_device = self._step_device()
        run = HostStep(self.optimizer, self.stream, work, streamed=streamed, threads=self.threads,
                       prestepped=prestepped, sub_group_size=self.sub_group_size, scratch=self._scratch)
        run.finish()
        for g, grad in on_device:  # its reduced shard, as after a step without offload, until zero_grad
            g.master.grad = grad  # type: ignore[union-attr]
        if streamed is None:
            for g, grad in work:  # as after a step without offload, until zero_grad (a bf16 copy stays off it)
                if grad.dtype == g.master.dtype:  # type: ignore[union-attr]
                    g.master.grad = grad  # type: ignore[union-attr]
        t2 = clock()
        C.wait_for(self.stream)
        if timed is not None:
            report_step_parts(timed, self.device, t0, t1, t2, run.cpu_seconds)

    def _prestepped(self, work: list[tuple[ShardGroup, torch.Tensor]]) -> frozenset[int]:
        """The groups of ``work`` already stepped for this step (only :class:`SpeculativeHostRunner` has any)."""
        return frozenset()

    def release(self) -> None:
        super().release()
        self.grad_buffers, self._widened = [], None


class DeferredHostRunner(HostRunner):
    """``offload_optimizer`` with ``overlap_param_gather`` at stages 1-2: only the group the next forward reads first
    is stepped inside the step; every other group is handed the step (:meth:`hf_zero.zero.flat.FlatGroup.defer_step`)
    and stepped, with every group before it in forward order, by the first forward hook that waits for it, with the
    hyperparameters of the step that deferred it (:class:`hf_zero.zero.host_step.HostStep`). ``timed`` receives the wait
    for the gradients at once and the CPU optimizer's time once the last group is stepped."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, offload: OffloadPolicy, stream_grads: bool,
                 overlap: DeferredPublish | DeferredUnitSteps) -> None:
        super().__init__(optimizer, groups, stream, device, offload, stream_grads)
        self.overlap: DeferredPublish | DeferredUnitSteps | None = overlap

    def step(self, timed: Timed | None) -> None:
        overlap = self.overlap
        assert overlap is not None, "the runner was released (engine.destroy())"
        clock = time.perf_counter
        t0 = clock()
        overlap.wait_all()  # a step with no forward since the last: its steps and gathers are still to finish
        for g in self.groups:
            g.before_step()
        t1 = clock()
        work, streamed = self._work()
        rank = {id(g): i for i, g in enumerate(overlap.order)}  # stage 3's is recorded on the first forward
        work.sort(key=lambda x: rank[id(x[0])])
        if timed is not None:
            timed("step.wait_grads", t1 - t0)
        run = HostStep(self.optimizer, self.stream, work, streamed=streamed, defer=True,
                       on_done=None if timed is None else (lambda s: timed("step.cpu_optimizer", s)),
                       threads=self.threads, prestepped=self._prestepped(work), sub_group_size=self.sub_group_size,
                       scratch=self._scratch)
        through = run.through  # one bound method for every group: its first wait steps it (and those before it)
        for g, _ in work:
            g.defer_step(through)  # type: ignore[attr-defined]
        if work:  # at once: what the forward reads first (a step a scheduler can see was taken)
            overlap.step_now(through, [g for g, _ in work])
        overlap.armed()

    def release(self) -> None:
        super().release()
        self.overlap = None


class _Speculating:
    """``offload_optimizer.super_offload`` over a host runner (:class:`SpeculativeHostRunner`,
    :class:`SpeculativeDeferredHostRunner`): each group stepped during the backward that ends the step, as soon as its
    gradient reaches host memory, on a background thread (:class:`hf_zero.zero.speculative_step.SpeculativeHostStep`),
    assuming the step does not clip and is not skipped. At the step the background thread is settled (it finishes
    the group it is on and takes no other) and the runner's own step only publishes the groups it stepped, stepping
    the rest itself. Where the assumption fails (``verdict``: clipping applies; ``discard``: an fp16 overflow or a
    non-finite gradient skips the step, or the gradients are cleared) the speculative steps are undone exactly and the
    step is the ordinary one. The weights equal the ordinary runner's bit for bit.

    With the gradients streamed from the device (``stream_grads``) no host copy exists during backward, and the step
    is the ordinary one. A save or load (``resident``) undoes a speculation in flight first, so it reads the masters of
    the last step.
    """

    speculation: SpeculativeHostStep | None
    groups: list[ShardGroup]
    host_groups: list[ShardGroup]
    stream_grads: bool

    def _speculate(self, optimizer: torch.optim.Optimizer, offload: OffloadPolicy) -> None:
        # the background steps run beside the backward: cpuadam_cores_perc of the share (the ordinary step takes it all)
        threads = offload.speculate_threads if offload.speculate_threads is not None else offload.host_threads
        self.speculation = SpeculativeHostStep(optimizer, threads, offload.sub_group_size,
                                               scratch=self._scratch)  # type: ignore[attr-defined]
        for g in self.groups:
            if g.master is not None and hasattr(g, "speculation"):  # the host-master groups (hf_zero/zero/offload.py)
                g.speculation = self.speculation  # type: ignore[attr-defined]

    def arm(self, coef: float) -> None:
        if self.speculation is not None and not self.stream_grads:
            self.speculation.arm(self.host_groups, coef)

    def verdict(self, coef: torch.Tensor | float) -> None:
        if self.speculation is not None:
            self.speculation.verdict(coef)

    def discard(self) -> None:
        if self.speculation is not None:
            self.speculation.discard()

    def _prestepped(self, work: list[tuple[ShardGroup, torch.Tensor]]) -> frozenset[int]:
        if self.speculation is None:
            return frozenset()
        return self.speculation.commit({id(g) for g, _ in work})

    def step(self, timed: Timed | None) -> None:
        if self.speculation is not None:
            self.speculation.settle()  # before before_step hands the host copies to the masters' .grad
        super().step(timed)  # type: ignore[misc]
        if timed is not None and self.speculation is not None:
            timed("step.cpu_optimizer_overlapped", self.speculation.cpu_seconds)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        self.discard()
        yield

    def release(self) -> None:
        if self.speculation is not None:
            self.speculation.close()
        for g in self.groups:
            if hasattr(g, "speculation"):
                g.speculation = None  # type: ignore[attr-defined]
        self.speculation = None
        super().release()  # type: ignore[misc]


class SpeculativeHostRunner(_Speculating, HostRunner):
    """``offload_optimizer.super_offload``: :class:`HostRunner`'s step, with the groups the background thread reached
    during backward already stepped (:class:`_Speculating`); the step publishes them, in the same fixed order as it
    steps and publishes the others, so every rank issues the same collectives whichever groups it reached."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, offload: OffloadPolicy, stream_grads: bool) -> None:
        HostRunner.__init__(self, optimizer, groups, stream, device, offload, stream_grads)
        self._speculate(optimizer, offload)


class SpeculativeDeferredHostRunner(_Speculating, DeferredHostRunner):
    """``super_offload`` with ``overlap_param_gather`` at stages 1-2: the groups the background thread reached during
    backward are stepped there (:class:`_Speculating`), and the others where the next forward first reads them
    (:class:`DeferredHostRunner`), so the CPU works from the first gradient of one backward to the last block of the next
    forward."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, offload: OffloadPolicy, stream_grads: bool,
                 overlap: DeferredPublish | DeferredUnitSteps) -> None:
        DeferredHostRunner.__init__(self, optimizer, groups, stream, device, offload, stream_grads, overlap)
        self._speculate(optimizer, offload)

    def _prestepped(self, work: list[tuple[ShardGroup, torch.Tensor]]) -> frozenset[int]:
        """The groups stepped during backward, each copied into this rank's range of the parameters now (a local copy,
        so in any order): their all-gathers wait for the forward's fixed order, their host-to-device copies need not
        (:meth:`hf_zero.zero.offload.OffloadedFlatGroup.write_shard_ahead`)."""
        kept = super()._prestepped(work)
        for g, _ in work:
            if id(g) in kept and hasattr(g, "write_shard_ahead"):
                g.write_shard_ahead(self.stream)  # type: ignore[attr-defined]
        return kept


class NvmeRunner(HostRunner):
    """``"device": "nvme"`` (ZeRO-Infinity): :class:`HostRunner`'s step with the masters and optimizer state read from
    files before each group's step and written back after it (:class:`hf_zero.zero.nvme.OptimizerSwap`: the next
    groups' reads and the previous groups' writes in flight while the CPU steps one), and, with ``offload_param``
    on NVMe, the recast 16-bit shards written to theirs (:class:`hf_zero.zero.nvme.ParamStore`). The gradients always
    wait on the device and are streamed (host memory holds the swap buffers, not a gradient copy per group).

    Failures of the disk are pooled at the step's two ends (:func:`hf_zero.zero.nvme.pooled_raise`): before anything
    is stepped (a read of a shard for a gather failed since the last step) and after every write has landed, so each
    rank raises the same sentence and none waits in a collective.
    """

    reads_grad16 = False  # the gradients stay fp32 through the swap's files and buffers

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, offload: OffloadPolicy, process_group: object, nvme: NvmeStores) -> None:
        super().__init__(optimizer, groups, stream, device, offload, stream_grads=offload.optimizer_nvme is not None)
        self.process_group = process_group
        self.swap, self.params = nvme.swap, nvme.params

    def step(self, timed: Timed | None) -> None:
        clock = time.perf_counter
        t0 = clock()
        # a read for a gather failed since the last step: stop here, on every rank, before anything is stepped
        # (or an earlier failure left the files stale: every rank knows it, and nothing reads them again)
        earlier = self.swap.broken if self.swap is not None else None
        pooled_raise((self.params.end() if self.params is not None else None) or earlier, self.process_group)  # type: ignore[arg-type]
        for g in self.groups:
            g.before_step()
        t1 = clock()
        work, streamed = self._work()
        if self.swap is not None:
            self.swap.begin([g for g, _ in work])
        run = HostStep(self.optimizer, self.stream, work, streamed=streamed, threads=self.threads, swap=self.swap,
                       sub_group_size=self.sub_group_size)
        try:
            run.finish()
        finally:
            problem = self.swap.end() if self.swap is not None else None
            if self.params is not None:
                problem = self.params.end() or problem
        if streamed is None:
            for g, grad in work:
                g.master.grad = grad  # type: ignore[union-attr]
        t2 = clock()
        C.wait_for(self.stream)
        try:
            pooled_raise(problem, self.process_group)  # type: ignore[arg-type]
        except Exception as e:
            if self.swap is not None:
                self.swap.fail(str(e))
            raise
        if timed is not None:
            io = self.swap.io_seconds if self.swap is not None else 0.0
            report_step_parts(timed, self.device, t0, t1, t2, run.cpu_seconds, io)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.params is not None:
                stack.enter_context(self.params.resident(self.process_group))  # type: ignore[arg-type]
            if self.swap is not None:
                stack.enter_context(self.swap.resident(self.process_group))  # type: ignore[arg-type]
            yield

    def release(self) -> None:
        super().release()
        for store in (self.swap, self.params):
            if store is not None:
                store.close()
        self.swap = self.params = None


class ZenFlowRunner(StepRunner):
    """``zero_optimization.zenflow`` (stages 1-2, ``offload_optimizer`` on the cpu): each step the important columns
    are stepped with Adam on the device and published, the host steps every element with the summed gradients every
    ``update_interval`` steps (with ``overlap_step`` in the background, published one interval late). The step and the
    mode's state are :class:`hf_zero.zero.zenflow.ZenFlow`'s; stale by design (its module doc says how far).
    """

    state_namespace = ZENFLOW_STATE

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None,
                 device: torch.device, offload: OffloadPolicy, stream_grads: bool) -> None:
        super().__init__(optimizer, groups, stream)
        assert offload.zenflow is not None
        if stream_grads:
            raise ValueError("zero_optimization.zenflow sums every gradient in host memory, and host memory cannot hold "
                             "even a gradient copy beside the masters here; use more machines or a higher ZeRO stage, "
                             "or remove zenflow")
        if any(g.master is not None and not is_host_master(g) for g in self.groups):
            raise ValueError("zero_optimization.zenflow steps offloaded groups only; offload them all (ratio 1.0)")
        use_host_kernels(optimizer)
        self.zenflow: ZenFlow | None = ZenFlow(optimizer, [g for g in self.groups if is_host_master(g)], stream,
                                               device, offload.zenflow, offload.host_threads, offload.sub_group_size)

    def step(self, timed: Timed | None) -> None:
        assert self.zenflow is not None, "the runner was released (engine.destroy())"
        for g in self.groups:
            if not is_host_master(g):
                g.before_step()  # a frozen or empty group: nothing of it steps
        self.zenflow.step(timed)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        if self.zenflow is None:
            yield
            return
        with self.zenflow.resident():
            yield

    def set_epoch_length(self, steps: int) -> None:
        if self.zenflow is not None:
            self.zenflow.set_epoch_length(steps)

    def release(self) -> None:
        if self.zenflow is not None:
            self.zenflow.close()
        self.zenflow = None
        super().release()


def pick_runner(optimizer: torch.optim.Optimizer, groups: list[ShardGroup], stream: torch.cuda.Stream | None, *,
                device: torch.device, offload: OffloadPolicy, stream_grads: bool,
                overlap: DeferredPublish | DeferredUnitSteps | None, process_group: object = None,
                nvme: NvmeStores | None = None) -> StepRunner:
    """The runner for these choices, made once when the optimizer is built; where a new runner is registered.

    ``overlap`` is the optimizer's :class:`DeferredPublish` (``overlap_param_gather`` at stages 0-2 and a group to
    publish; None otherwise), ``stream_grads`` the host-memory plan's answer (only with ``offload.optimizer``),
    ``process_group`` the groups' (NVMe failures are raised on all its ranks), ``nvme`` the files the groups were
    written to as they were built (with ``offload.nvme``).
    """
    if offload.optimizer and offload.zenflow is not None:  # the config refuses it beside NVMe, ratio, overlap, super_offload
        return ZenFlowRunner(optimizer, groups, stream, device, offload, stream_grads)
    if offload.ratio < 1.0 and (nvme is not None or overlap is not None):  # the config refuses both first
        raise ValueError("OffloadPolicy.ratio below 1 keeps groups on the device, which the NVMe step and the deferred "
                         "host step (overlap_param_gather) do not handle; offload the whole state (ratio 1.0)")
    if offload.optimizer and nvme is not None:  # the config refuses NVMe with overlap_param_gather
        return NvmeRunner(optimizer, groups, stream, device, offload, process_group, nvme)
    if offload.optimizer and offload.speculate:
        if overlap is not None:
            return SpeculativeDeferredHostRunner(optimizer, groups, stream, device, offload, stream_grads, overlap)
        return SpeculativeHostRunner(optimizer, groups, stream, device, offload, stream_grads)
    if offload.optimizer:
        if overlap is not None:
            return DeferredHostRunner(optimizer, groups, stream, device, offload, stream_grads, overlap)
        return HostRunner(optimizer, groups, stream, device, offload, stream_grads)
    if overlap is not None:
        return DeferredPublishRunner(optimizer, groups, stream, overlap)
    return DeviceRunner(optimizer, groups, stream)
