"""PipelineEngine: ``train_batch`` / ``eval_batch`` over a ``PipelineModule``, one stage per process.

The engine walks the stage's schedule (a list of actions from :mod:`hf_zero.pipe.schedule`):
loads micro-batches, runs forwards and backwards, and moves activations forward and gradients
back with point-to-point sends on a two-rank group per neighbouring pair. Neighbouring
communication actions are posted together (``batch_isend_irecv``), sends are never waited for
before the next compute (on GPU the copy overlaps the next forward), and a micro-batch's kept
tensors are dropped as soon as its backward has sent its gradient.

Data parallelism and ZeRO are not re-implemented: the engine *is* a ``ZeroEngine`` over the
stage's own module with ``group=`` the stage's data-parallel group, so the flat buffers, the
bucketed reduction during the last backward and the sharded optimizer step are the ones every
other hf_zero run uses. What the pipeline adds at the step:

- tied weights (an embedding on the first stage, the LM head on the last) are placed in their
  own flat bucket, so their (data-parallel-averaged) gradient shards line up across the stages
  holding them and are summed with one all-reduce over the tie group;
- the gradient norm (for clipping and the non-finite checks) is over the whole pipeline, each
  tied weight counted once, with one all-reduce over the world: the one step policy of every
  engine (``hf_zero/training/step.py``) with the pipeline's norm scope.

``save_checkpoint`` / ``load_checkpoint`` are the ``ZeroEngine``'s: every rank of the world calls
them, and :mod:`hf_zero.checkpoint.save` stores each stage's parameters under the model's own
names (a tied weight once), so the checkpoint loads at another data-parallel degree or number of
stages, or into a plain ``ZeroEngine`` of the same model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.config import ConfigError, ZeroConfig
from hf_zero.engine import ZeroEngine
from hf_zero.errors import UsageError
from hf_zero.pipe import p2p
from hf_zero.pipe import schedule as S
from hf_zero.pipe.module import PipelineModule
from hf_zero.training.data import to_device
from hf_zero.zero.group import ShardGroup


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A micro-batch as ``(inputs, labels)``: DeepSpeed's pair, or a transformers-style dict.

    A dict gives ``input_ids`` (with ``attention_mask``, as a tuple, when present) as inputs and
    ``labels`` (default: the input ids, the causal-LM convention) as labels.
    """
    if isinstance(batch, Mapping) and "input_ids" in batch:
        ids = batch["input_ids"]
        inputs = (ids, batch["attention_mask"]) if batch.get("attention_mask") is not None else ids
        return inputs, batch.get("labels", ids)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise UsageError(
        f"a pipeline micro-batch must be a pair (inputs, labels) or a dict with input_ids, got {type(batch).__name__}"
    )


@dataclass
class _Run:
    """What one train_batch / eval_batch call keeps between actions, by micro-batch."""

    train: bool
    micro_batches: int
    next_batch: Any
    compute_loss: bool = True
    inputs: dict[int, Any] = field(default_factory=dict)
    labels: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    out_grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    sent_meta: list[int] | None = None
    recv_meta: tuple[list, bool] | None = None
    pending: list[Any] = field(default_factory=list)  # send handles not yet known complete


class PipelineEngine(ZeroEngine):
    """DeepSpeed's ``PipelineEngine``: ``train_batch()`` runs one whole step of micro-batches."""

    def __init__(self, model: PipelineModule, config: ZeroConfig, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any = None) -> None:
        if config.zero_optimization.stage == 3:
            raise ConfigError(
                "zero_optimization.stage: got 3, but ZeRO stage 3 cannot be combined with pipeline parallelism "
                "(a PipelineModule); use stage 0, 1 or 2"
            )
        pcfg = config.pipeline
        if pcfg.stages is not None and pcfg.stages != model.num_stages:
            raise ConfigError(
                f"pipeline.stages: got {pcfg.stages}, but the PipelineModule has num_stages={model.num_stages}; "
                'make them agree or set "auto"'
            )
        if pcfg.activation_checkpoint_interval and not model.activation_checkpoint_interval:
            model.activation_checkpoint_interval = pcfg.activation_checkpoint_interval
        self.schedule_name = pcfg.schedule
        tied = model.tied_weights()
        if optimizer is not None:
            _isolate(optimizer, [w for w, _, _ in tied])
        super().__init__(model, config, optimizer, lr_scheduler=lr_scheduler, grid=model.grid)
        self.num_stages, self.stage_id = model.num_stages, model.stage_id
        self.dp_rank = model.dp_rank
        self.training_dataloader = None
        self._data_iter: Iterator | None = None
        # Set to True to time this stage's forwards and backwards (CUDA events on GPU): the bubble
        # is then what the step spends outside them (benchmarks/bench.py reports it).
        self.measure_compute = False
        self._compute_marks: list[Any] = []

    @functools.cached_property
    def _tied(self) -> list[tuple[ShardGroup, Any, bool]]:
        """(the shard group, the tie group, whether this stage is the first holder) of each trainable tied weight."""
        out = []
        if self.zero_optimizer is not None:
            for weight, group, first in self.module.tied_weights():
                if not weight.requires_grad:
                    continue
                fg = self.zero_optimizer.group_of(weight)
                assert fg is not None and len(fg.slots) == 1, "a tied weight must sit alone in its flat bucket"
                out.append((fg, group, first))
        return out

    def _norm_excluded(self) -> frozenset[int]:
        """A tied weight counts in the global norm at its first stage only."""
        return frozenset(id(g) for g, _, first in self._tied if not first)

    def _stored_elsewhere(self) -> set[int]:
        """A tied weight is stored in checkpoints by the first stage holding it."""
        return {id(w) for w, _, first in self.module.tied_weights() if not first}

    # ------------------------------------------------------------ DeepSpeed API

    @property
    def mpu(self) -> Any:
        """DeepSpeed's ``engine.mpu`` of a pipeline: the grid (``PipelineModule.mpu()``), as ``engine.grid`` is."""
        return self.grid

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator ``train_batch()`` draws from when called without one."""
        self._data_iter = iterator

    def _source(self, data_iter: Any, call: str) -> Any:
        """The iterator this stage draws micro-batches from (None on middle stages, which need none).

        ``train_batch`` remembers its iterator (and falls back to the ``training_data`` loader);
        ``eval_batch`` uses the one it is given and leaves the training iterator where it was.
        """
        it = None
        if data_iter is not None:
            it = data_iter if isinstance(data_iter, Iterator) else iter(data_iter)
        if call == "train_batch":
            if it is not None:
                self._data_iter = it
            elif self._data_iter is None and self.training_dataloader is not None:
                self._data_iter = _repeat(self.training_dataloader)
            it = self._data_iter
        if not (self.is_first_stage() or self.is_last_stage()):
            return None  # middle stages take their inputs from the previous stage
        if it is None:
            raise UsageError(
                f"{call}() got no data: pass data_iter= (an iterator of (inputs, labels) micro-batches) "
                "or give initialize(training_data=...)"
            )
        return it

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; the mean loss, on every stage."""
        if self.zero_optimizer is None:
            raise UsageError("train_batch() needs an optimizer; give one in the config or to initialize()")
        it = self._source(data_iter, "train_batch")
        m = self.gradient_accumulation_steps()
        self.module.train()
        run = _Run(train=True, micro_batches=m, next_batch=(lambda: split_batch(next(it))) if it is not None else None)
        self._execute(S.build(self.schedule_name, self.num_stages, self.stage_id, m), run)
        self.micro_steps += m
        self.global_samples += self.train_micro_batch_size_per_gpu() * m * self.dp_world_size
        loss = self._mean_loss(run)
        self._check_preemption()  # checkpoint.save_on_signal: every stage decides at the same train_batch
        return loss

    def eval_batch(self, data_iter: Any, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None) -> Any:
        """Forward only over ``num_micro_batches`` (default: the accumulation steps); the mean loss on every stage.

        With ``return_logits`` the last stage also gets the outputs, one per micro-batch: ``(loss, outputs)``.
        """
        del reduce_output, bcast_loss
        it = self._source(data_iter, "eval_batch")
        m = num_micro_batches or self.gradient_accumulation_steps()
        was_training = self.module.training
        self.module.eval()
        run = _Run(train=False, micro_batches=m, compute_loss=compute_loss,
                   next_batch=(lambda: split_batch(next(it))) if it is not None else None)
        try:
            with torch.no_grad():
                self._execute(S.inference(self.num_stages, self.stage_id, m), run)
        finally:
            self.module.train(was_training)
        loss = self._mean_loss(run) if compute_loss else None
        if return_logits:
            return loss, (run.results if self.is_last_stage() else None)
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``engine(inputs)``: one forward through every stage (no gradients); the output on the last stage, None elsewhere.

        Every rank of a pipeline must call it (the stages pass the activation along); only the
        first stage's ``inputs`` are used. Training goes through ``train_batch()``.
        """
        if kwargs:
            raise UsageError("engine(...) of a pipeline takes the inputs positionally, as the first layer does; got keyword arguments")
        inputs = args[0] if len(args) == 1 else tuple(args)
        run = _Run(train=False, micro_batches=1, compute_loss=False, next_batch=lambda: (inputs, None))
        with torch.no_grad():
            self._execute(S.inference(self.num_stages, self.stage_id, 1), run)
        return run.results[0] if self.is_last_stage() else None

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        raise UsageError("engine.backward() is not used with pipeline parallelism; call engine.train_batch(data_iter), which runs forward, backward and step")

    def step(self, lr_kwargs: dict | None = None) -> None:
        raise UsageError("engine.step() is not used with pipeline parallelism; call engine.train_batch(data_iter), which runs forward, backward and step")

    def save_pretrained(self, save_directory: str, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None) -> list[str]:
        """Every stage's weights in one Hugging Face folder (every rank calls this; global rank 0 writes)."""
        from hf_zero.pipe.consolidated import save_pretrained

        self.wait_params()
        return save_pretrained(self.train_state(), save_directory, max_shard_size=max_shard_size, dtype=dtype)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Refused: each stage holds only its layers, so one file needs every stage's share (save_pretrained does that)."""
        raise UsageError(
            "save_16bit_model() is not supported for a pipeline engine; call engine.save_pretrained(save_dir), "
            "which writes every stage's weights into one from_pretrained folder"
        )

    save_fp16_model = save_16bit_model

    def __repr__(self) -> str:
        return (f"PipelineEngine(stage={self.stage_id}/{self.num_stages}, dp={self.dp_world_size}, "
                f"zero_stage={self.zero_optimization_stage()}, schedule={self.schedule_name})")

    # ------------------------------------------------------------ the schedule

    def compute_seconds(self) -> float:
        """Seconds this stage spent in forwards and backwards since the last call (needs ``measure_compute``)."""
        total = 0.0
        for start, end in self._compute_marks:
            if isinstance(start, float):
                total += end - start
            else:
                end.synchronize()
                total += start.elapsed_time(end) / 1000.0
        self._compute_marks.clear()
        return total

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        import time

        return time.perf_counter()

    def _execute(self, actions: list[S.Action], run: _Run) -> None:
        for step in S.exchanges(actions, self.stage_id):
            a = step[0]
            if self.measure_compute and isinstance(a, (S.Forward, S.Backward)):
                start = self._mark()
                self._forward_micro(a.micro, run) if isinstance(a, S.Forward) else self._backward_micro(a.micro, run)
                self._compute_marks.append((start, self._mark()))
            elif isinstance(a, S.COMM):
                self._exchange(step, run)
            elif isinstance(a, S.LoadMicroBatch):
                self._load(a.micro, run)
            elif isinstance(a, S.Forward):
                self._forward_micro(a.micro, run)
            elif isinstance(a, S.Backward):
                self._backward_micro(a.micro, run)
            elif isinstance(a, S.ReduceGrads):
                self._reduce_tied_grads()
            elif isinstance(a, S.OptimizerStep):
                self._take_model_step()  # the step policy's norm spans the pipeline (see __init__)
        for work in run.pending:
            work.wait()
        run.pending.clear()

    def _load(self, i: int, run: _Run) -> None:
        if run.next_batch is None:
            return
        try:
            inputs, labels = run.next_batch()
        except StopIteration:
            raise UsageError(
                f"the data iterator ran out at micro-batch {i} of {run.micro_batches}; each train_batch() takes "
                "gradient_accumulation_steps micro-batches"
            ) from None
        cast = self.compute_dtype if self.compute_dtype != torch.float32 else None
        if self.is_first_stage():
            run.inputs[i] = to_device(inputs, self.device, cast)
        if self.is_last_stage() and labels is not None:
            run.labels[i] = to_device(labels, self.device, None)

    def _forward_micro(self, i: int, run: _Run) -> None:
        """Forward of micro-batch ``i`` through this stage (and the loss on the last stage)."""
        x = run.inputs[i] if (run.train and not self.is_first_stage()) else run.inputs.pop(i)
        with torch.enable_grad() if run.train else torch.no_grad(), self.autocast():
            out = self.module(x)
            if self.is_last_stage():
                labels = run.labels.pop(i, None)
                if run.compute_loss:
                    loss_fn = self.module.loss_fn
                    loss = loss_fn(out, labels) if loss_fn is not None else out
                    if not torch.is_tensor(loss) or loss.numel() != 1:
                        raise UsageError(
                            "the last pipeline stage must produce a scalar loss: give PipelineModule(loss_fn=...) "
                            "or make the last layer return the loss"
                        )
                    run.losses.append(loss.detach().float())
                    if run.train:
                        run.outputs[i] = loss
                if not run.train:
                    run.results.append(out)
                return
        run.outputs[i] = out

    def _backward_micro(self, j: int, run: _Run) -> None:
        """Backward of micro-batch ``j`` through this stage; the last one reduces over data parallel."""
        zo = self.zero_optimizer
        assert zo is not None
        zo.prepare_backward(j == run.micro_batches - 1)  # the last backward reduces over data parallel
        out = run.outputs.pop(j)
        if self.is_last_stage():
            self.step_policy.scale_loss(out, run.micro_batches).backward()
        else:
            outs, _ = p2p.flatten(out, "output")
            grads = run.out_grads.pop(j)
            pairs = [(t, g) for t, g in zip([t for t in outs if t.is_floating_point()], grads) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        zo.finish_backward()

    # ------------------------------------------------------------ point to point

    def _peer(self, stage: int) -> tuple[int, Any]:
        return self.module.rank_of(stage), self.module.p2p_groups[stage]

    def _exchange(self, actions: list[S.Action], run: _Run) -> None:
        """Post one neighbour's sends and receives together; wait only for what is received."""
        ex = p2p.Exchange(*self._peer(S.peer(actions[0], self.stage_id)))
        for a in actions:
            if isinstance(a, S.SendActivation):
                self._send_activation(a.micro, run, ex)
            elif isinstance(a, S.RecvActivation):
                specs, _ = self._activation_meta(run, ex)
                ex.recv([torch.empty(shape, dtype=dt, device=self.device) for dt, shape in specs], a.micro, "act")
            elif isinstance(a, S.SendGrad):
                tensors, _ = p2p.flatten(run.inputs.pop(a.micro), "input")
                ex.send([t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors if t.is_floating_point()])
            elif isinstance(a, S.RecvGrad):
                tensors, _ = p2p.flatten(run.outputs[a.micro], "output")
                ex.recv([torch.empty_like(t) for t in tensors if t.is_floating_point()], a.micro, "grad")
        ex.run(run.pending)
        for micro, bufs, kind in ex.landed:
            if kind == "grad":
                run.out_grads[micro] = bufs
                continue
            _, is_tuple = run.recv_meta  # type: ignore[misc]
            if run.train:
                for b in bufs:
                    if b.is_floating_point():
                        b.requires_grad_()
            run.inputs[micro] = tuple(bufs) if is_tuple else bufs[0]
        run.pending = [w for w in run.pending if not w.is_completed()]

    def _send_activation(self, i: int, run: _Run, ex: p2p.Exchange) -> None:
        """Queue micro-batch ``i``'s output for the next stage; its description goes ahead once per batch."""
        tensors, is_tuple = p2p.flatten(run.outputs[i], "output")
        meta = p2p.encode_meta(tensors, is_tuple)
        if run.sent_meta is None:
            run.sent_meta = meta
            run.pending.extend(p2p.post([dist.P2POp(dist.isend, torch.tensor(meta, device=self.device), ex.rank, ex.group)]))
        elif meta != run.sent_meta:
            raise UsageError(
                "the micro-batches of one train_batch() must have the same shapes (padded to one length); "
                f"micro-batch {i} differs from the first"
            )
        ex.send([t.detach().contiguous() for t in tensors])
        if not run.train:
            run.outputs.pop(i)  # nothing to backpropagate: the send holds the only reference

    def _activation_meta(self, run: _Run, ex: p2p.Exchange) -> tuple[list, bool]:
        """The previous stage's activation description (received once per batch, before its first activation)."""
        if run.recv_meta is None:
            buf = torch.zeros(p2p.META_LEN, dtype=torch.int64, device=self.device)
            for w in p2p.post([dist.P2POp(dist.irecv, buf, ex.rank, ex.group)]):
                w.wait()
            run.recv_meta = p2p.decode_meta(buf.tolist())
        return run.recv_meta

    # ------------------------------------------------------------ step

    def _reduce_tied_grads(self) -> None:
        """Sum each tied weight's gradient shard over the stages that hold it (after the data-parallel average)."""
        for fg, group, _ in self._tied:
            fg.sum_grad_over(group)

    def _mean_loss(self, run: _Run) -> torch.Tensor:
        """Mean micro-batch loss of the last stage, averaged over data parallel, broadcast down the pipeline."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and run.losses:
            loss = torch.stack(run.losses).mean()
            if self.dp_world_size > 1:
                dist.all_reduce(loss, group=self.group)
                loss = loss / self.dp_world_size
        if self.num_stages > 1:
            src = self.module.rank_of(self.num_stages - 1)
            dist.broadcast(loss, src=src, group=self.module.pipe_group)
        return loss


def _repeat(loader: Any) -> Iterator:
    """The training loader as an endless iterator (a new epoch when one ends), as DeepSpeed's RepeatingLoader."""
    while True:
        yield from loader


def _isolate(optimizer: torch.optim.Optimizer, tied: list[torch.nn.Parameter]) -> None:
    """Give every tied weight a param group of its own (same hyper-parameters), hence its own flat bucket.

    Its flat buffer then has the same size on every stage that holds it, so each data-parallel
    rank owns the same shard of it on each stage and the shards can be summed over the tie group.
    """
    for w in tied:
        for g in optimizer.param_groups:
            if any(p is w for p in g["params"]) and len(g["params"]) > 1:
                g["params"] = [p for p in g["params"] if p is not w]
                optimizer.add_param_group({**{k: v for k, v in g.items() if k != "params"}, "params": [w]})
                break
