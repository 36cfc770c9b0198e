"""DeepSpeed's API surface in one process: ``initialize``'s arguments, the engine's methods, and the
one-sentence errors for calls that cannot mean anything."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import hf_zero
from hf_zero import ConfigError, UsageError
from hf_zero.errors import UnusedParameterError
from tests.models import make_data, make_model, param_groups

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def test_engine_keeps_names_and_counts_steps() -> None:
    model = make_model()
    keys = list(model.state_dict())
    cfg = dict(CFG, gradient_accumulation_steps=2, zero_optimization={"stage": 1})
    engine, opt, loader, sched = hf_zero.initialize(model=model, config=cfg)
    assert engine.module is model and list(engine.module.state_dict()) == keys
    assert loader is None and sched is None and opt is engine.optimizer
    assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 2
    ids, labels = make_data(4, 2)
    boundaries = []
    for t in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(ids[t], labels[t]))
        engine.step()
    assert boundaries == [False, True, False, True]
    assert engine.micro_steps == 4 and engine.global_steps == 2
    assert engine.get_lr() == [1e-2] and engine.get_global_grad_norm() > 0
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


def test_client_optimizer_and_scheduler_instances_keep_working() -> None:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, zopt, _, zsched = hf_zero.initialize(model=model, optimizer=opt, lr_scheduler=sched, config={"train_batch_size": 2})
    # stage 0 in fp32: DeepSpeed wraps nothing and hands back the client's optimizer itself
    assert zsched is sched and zopt is opt and engine.optimizer is opt and len(zopt.param_groups) == 2
    ids, labels = make_data(2, 2)
    for t in range(2):
        engine.backward(engine(ids[t], labels[t]))
        engine.step()
    assert engine.get_lr() == [0.025, 0.025]
    # from stage 1 (or in fp16/bf16) the ZeRO wrapper, which keeps the client's; its step() is DeepSpeed's: the
    # engine's optimizer step without the engine's counters or LR scheduler
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=0.1)
    engine, zopt, _, _ = hf_zero.initialize(model=model, optimizer=opt, config={"train_batch_size": 2, "zero_optimization": {"stage": 1}})
    assert zopt is engine.optimizer and zopt.optimizer is opt and len(zopt.param_groups) == 2
    with pytest.raises(UsageError, match="found no gradients: no backward ran since the last step"):
        zopt.step()
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(ids[0], labels[0]))
    zopt.step()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert engine.global_steps == 0 and moved == [p.requires_grad for p in model.parameters()], moved
    with pytest.raises(UsageError, match="found no gradients"):  # the step dropped them, as DeepSpeed's does
        zopt.step()


def test_callables_args_namespace_and_training_data(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "steps_per_print": 1}))
    model = make_model()
    ds = torch.utils.data.TensorDataset(*[t.reshape(-1, t.shape[-1]) for t in make_data(1, 10)])
    engine, _, loader, sched = hf_zero.initialize(
        args=argparse.Namespace(deepspeed_config=str(path), local_rank=0),
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)),
        training_data=ds,
    )
    batches = list(loader)
    assert len(batches) == 3 and batches[0][0].shape[0] == 4
    engine.backward(engine(*batches[0]))
    engine.step()
    assert engine.get_lr() == [0.05]
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model=[1, 2], config=CFG), r"initialize\(model=\.\.\.\) expects a torch.nn.Module, got list"),
        (dict(model=torch.nn.ReLU(), config=CFG), "no parameters"),
        (dict(model="m", config=CFG), "got str"),
        (dict(args=torch.nn.Linear(2, 2), config=CFG), "first positional argument, which is args"),
        (dict(optimizer="adam", config={"train_batch_size": 2}), r"initialize\(optimizer=\.\.\.\)"),
        (dict(optimizer=lambda p: 3, config={"train_batch_size": 2}), "must return a torch.optim.Optimizer"),
        (dict(lr_scheduler=3, config=CFG), r"initialize\(lr_scheduler=\.\.\.\)"),
        (dict(model_parameters=torch.zeros(3), config=CFG), "single tensor"),
        (dict(model_parameters=[1, 2], config=CFG), "holds a int"),
        (dict(training_data=5, config=CFG), r"initialize\(training_data=\.\.\.\)"),
        (dict(mpu=object(), config=CFG), "not supported"),
    ],
)
def test_initialize_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    kwargs.setdefault("model", make_model())
    with pytest.raises((UsageError, ConfigError), match=match) as err:
        hf_zero.initialize(**kwargs)
    if "model" in match or "args" in match:  # DeepSpeed asserts on these two: its AssertionError as well
        assert isinstance(err.value, AssertionError)


def test_config_errors_surface_from_initialize(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match="bad.json"):
        hf_zero.initialize(model=make_model(), config=str(bad))
    with pytest.raises(ConfigError, match="stage"):
        hf_zero.initialize(model=make_model(), config=dict(CFG, zero_optimization={"stage": 4}))


def test_engine_usage_errors() -> None:
    engine, _, _, _ = hf_zero.initialize(model=make_model(), config=CFG)
    ids, labels = make_data(1, 2)
    with pytest.raises(UsageError, match=r"needs a scalar loss but got a tensor of shape \(2, 3\)"):
        engine.backward(torch.ones(2, 3, requires_grad=True))
    with pytest.raises(UsageError, match="does not require grad"):
        with torch.no_grad():
            engine.backward(engine(ids[0], labels[0]))
    # a boundary step whose backward ran only under no_sync has nothing reduced
    with engine.no_sync():
        engine.backward(engine(ids[0], labels[0]))
    with pytest.raises(UsageError, match="never reduced"):
        engine.step()
    # DeepSpeed's rule: step() inside no_sync is refused, with its AssertionError and sentence
    with engine.no_sync():
        with pytest.raises(AssertionError, match="It is illegal to call Engine.step.. inside no_sync context manager"):
            engine.step()
    e3, _, _, _ = hf_zero.initialize(model=make_model(), config=dict(CFG, zero_optimization={"stage": 3}))
    with pytest.raises(UsageError, match="stage 3"):
        with e3.no_sync():
            pass
    e0, _, _, _ = hf_zero.initialize(model=make_model(), config={"train_batch_size": 2})
    with pytest.raises(UsageError, match="needs an optimizer"):
        e0.backward(e0(ids[0], labels[0]))


def test_no_sync_then_synced_backward_equals_plain_accumulation() -> None:
    ids, labels = make_data(2, 2)
    results = []
    for use_no_sync in (False, True):
        engine, _, _, _ = hf_zero.initialize(model=make_model(), config=dict(CFG, gradient_accumulation_steps=2, zero_optimization={"stage": 2}))
        for t in range(2):
            if use_no_sync and t == 0:
                with engine.no_sync():
                    engine.backward(engine(ids[t], labels[t]))
            else:
                engine.backward(engine(ids[t], labels[t]))
            engine.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
    assert torch.equal(results[0], results[1])


class _Branchy(torch.nn.Module):
    """Two heads; ``forward(x, use)`` runs the ones named in ``use`` (a dynamic network's unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: str = "ab") -> torch.Tensor:
        return sum(getattr(self, n)(x).square().mean() for n in use)


@pytest.mark.parametrize("stage,offload", [(1, False), (2, True)])
def test_ignore_unused_parameters_false_stops_the_step_naming_the_parameters(stage: int, offload: bool) -> None:
    zero = {"stage": stage, "ignore_unused_parameters": False}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    x = torch.randn(2, 4)
    engine, _, _, _ = hf_zero.initialize(model=_Branchy(), config=dict(CFG, gradient_accumulation_steps=2,
                                                                       zero_optimization=zero))
    for use in ("a", "b"):  # each head in one micro-step of the step: every parameter got a gradient
        engine.backward(engine(x, use))
        engine.step()
    assert engine.global_steps == 1
    engine.backward(engine(x, "a"))
    engine.step()  # not a boundary: nothing is checked yet
    engine.backward(engine(x, "a"))
    before = [p.detach().clone() for p in engine.module.parameters()]
    # DeepSpeed raises an AssertionError naming the key; here it names the parameters too, and nothing steps
    with pytest.raises(AssertionError, match=r"2 trainable parameter\(s\) got no gradient .*\(b\.bias, b\.weight\)"
                                             r".*ignore_unused_parameters is false") as e:
        engine.step()
    assert isinstance(e.value, UnusedParameterError) and engine.global_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(before, engine.module.parameters()))
    # DeepSpeed's default (true), and stages 0 and 3, which DeepSpeed does not check: the unused head is left alone
    for zero in ({"stage": 2}, {"stage": 3, "ignore_unused_parameters": False},
                 {"stage": 0, "ignore_unused_parameters": False}):
        engine, _, _, _ = hf_zero.initialize(model=_Branchy(), config=dict(CFG, zero_optimization=zero))
        engine.backward(engine(x, "a"))
        engine.step()
        assert engine.global_steps == 1, zero


def test_unwrap_model_for_generation_holds_the_zero3_weights_whole_for_the_block() -> None:
    from hf_zero.runtime.zero import unwrap_model_for_generation  # DeepSpeed's path (deepspeed.runtime.zero)

    ids, labels = make_data(3, 2)
    cfg = dict(CFG, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    runs = []
    for unwrap in (False, True):
        engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
        w = engine.module.fc1.weight
        # the bytes of the storage the parameter has now (an int, so that a failure never prints a sharded tensor):
        # on leaving the block a gathered buffer that other tensors still view (the graph of the forward with grad
        # below) is left to them and the parameter takes a new empty one, as DeepSpeed leaves a released
        # parameter's old data to its holders (ShardedParamGroup.reshard)
        def held(w: torch.nn.Parameter = w) -> int:
            return w.untyped_storage().nbytes()
        for t in range(3):
            if unwrap and t == 1:
                with torch.no_grad():
                    ref = engine(ids[0], labels[0])
                engine.empty_partition_cache()
                assert held() == 0  # sharded between uses
                with unwrap_model_for_generation(engine) as m:
                    assert m is engine and held() >= 4 * w.numel()
                    with torch.no_grad():
                        out = engine(ids[0], labels[0])
                    loss = engine(ids[0], labels[0])  # a forward with grad does not release a block either
                    assert held() > 0
                    with pytest.raises(UsageError, match="inside unwrap_model_for_generation"):
                        engine.backward(loss)
                assert torch.equal(out, ref) and held() == 0
            engine.backward(engine(ids[t], labels[t]))
            engine.step()
        with hf_zero.zero.GatheredParameters(list(engine.parameters())):
            runs.append([p.detach().clone() for p in engine.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # training went on as if the block had not been there
