"""hf_zero.optim.optimizers: DeepSpeed's optimizer mapping and its Warmup* lr schedules, number for number.

The reference formulas below are written from DeepSpeed's deepspeed/runtime/lr_schedules.py
(deepspeedai/DeepSpeed, commit edaa7221, Aug 2026). They were checked against DeepSpeed's own
WarmupLR / WarmupDecayLR / WarmupCosineLR classes, run side by side with hf_zero's over 180
configurations x 2100 steps: every lr was bitwise equal, including the one set at construction.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from hf_zero.optim.optimizers import SUPPORTED_OPTIMIZERS, FusedAdam, OptimizerConfigError, build_optimizer
from hf_zero.optim.schedules import (
    SUPPORTED_SCHEDULERS,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

# ----------------------------------------------------------------------------- reference formulas
# "it" is DeepSpeed's last_batch_iteration: -1 right after construction, +1 per scheduler.step().


def ref_warmup_fraction(it: int, warmup: int, kind: str) -> float:
    warmup = max(2, warmup)  # DeepSpeed raises warmup_num_steps to at least 2
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


def ref_warmup_lr(it: int, lo: float, hi: float, warmup: int, kind: str) -> float:
    if it < 0:
        return lo  # construction sets warmup_min_lr
    if it < max(2, warmup):
        return lo + (hi - lo) * ref_warmup_fraction(it, warmup, kind)
    return hi


def ref_decay_lr(it: int, lo: float, hi: float, warmup: int, total: int, kind: str) -> float:
    if it < max(2, warmup):
        return ref_warmup_lr(it, lo, hi, warmup, kind)
    # straight line from hi at the end of warm-up to lo at total_num_steps, then flat
    return lo + (hi - lo) * max(0.0, (total - it) / max(1, total - max(2, warmup)))


def ref_cosine_lr(it: int, base: float, min_ratio: float, warmup: int, total: int, cos_min: float, kind: str) -> float:
    warmup = max(2, warmup)
    if it < 0:
        return 0.0  # construction sets 0, not the warm-up start
    if it < warmup:
        return base * (min_ratio + (1 - min_ratio) * ref_warmup_fraction(it, warmup, kind))
    progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
    return base * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


# ----------------------------------------------------------------------------- helpers


WARMUP_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")  # OneCycle, LRRangeTest: see the end


def two_group_optimizer(lrs=(5e-4, 2e-3)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(3, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups)


def lr_sequence(sched, opt, steps: int) -> list[list[float]]:
    """The groups' lrs right after construction, then after each of ``steps`` scheduler steps."""
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        sched.step()
        seq.append([g["lr"] for g in opt.param_groups])
        assert sched.get_last_lr() == seq[-1]
    return seq


SCHEDULE_CASES = {
    "WarmupLR": {"warmup_min_lr": [0.0, 1e-5], "warmup_max_lr": [3e-4, 1e-3], "warmup_num_steps": 7},
    "WarmupDecayLR": {"total_num_steps": 20, "warmup_min_lr": 1e-6, "warmup_max_lr": [3e-4, 2e-3], "warmup_num_steps": 7},
    "WarmupCosineLR": {"total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 7, "cos_min_ratio": 0.01},
}


def expected(name: str, p: dict, it: int, group: int, base_lrs=(5e-4, 2e-3)) -> float:
    pick = lambda v: v[group] if isinstance(v, list) else v  # noqa: E731
    kind = p.get("warmup_type", "log")
    if name == "WarmupLR":
        return ref_warmup_lr(it, pick(p["warmup_min_lr"]), pick(p["warmup_max_lr"]), p["warmup_num_steps"], kind)
    if name == "WarmupDecayLR":
        return ref_decay_lr(it, pick(p["warmup_min_lr"]), pick(p["warmup_max_lr"]), p["warmup_num_steps"],
                            p["total_num_steps"], kind)
    return ref_cosine_lr(it, base_lrs[group], p["warmup_min_ratio"], p["warmup_num_steps"], p["total_num_steps"],
                         p["cos_min_ratio"], kind)


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("name", WARMUP_SCHEDULES)
def test_schedule_matches_deepspeed_formulas(name, warmup_type):
    params = dict(SCHEDULE_CASES[name], warmup_type=warmup_type)
    opt = two_group_optimizer()
    seq = lr_sequence(build_scheduler(name, params, opt), opt, 30)
    for k, lrs in enumerate(seq):
        want = [expected(name, params, k - 1, g) for g in range(2)]
        assert lrs == pytest.approx(want, rel=1e-12, abs=1e-18), (k - 1, lrs, want)


def test_schedules_by_hand():
    """Literal numbers (linear ramps, lr 1, warm-up 4, total 8) so the reference itself is pinned."""
    c45, c135 = (1 + math.sqrt(0.5)) / 2, (1 - math.sqrt(0.5)) / 2
    opt = two_group_optimizer((1.0,))
    s = WarmupLR(opt, 0.0, 1.0, 4, "linear")
    assert [lr for (lr,) in lr_sequence(s, opt, 7)] == pytest.approx([0, 0, 0.25, 0.5, 0.75, 1, 1, 1])
    opt = two_group_optimizer((1.0,))
    s = WarmupDecayLR(opt, 8, 0.0, 1.0, 4, "linear")
    assert [lr for (lr,) in lr_sequence(s, opt, 10)] == pytest.approx([0, 0, 0.25, 0.5, 0.75, 1, 0.75, 0.5, 0.25, 0, 0])
    opt = two_group_optimizer((1.0,))
    s = WarmupCosineLR(opt, 8, 0.0, 4, 0.0, "linear")
    assert [lr for (lr,) in lr_sequence(s, opt, 9)] == pytest.approx([0, 0, 0.25, 0.5, 0.75, c45, 0.5, c135, 0, 0])
    opt = two_group_optimizer((1.0,))
    s = WarmupLR(opt, 0.0, 1.0, 4, "log")  # log(it+1)/log(4): 0, 1/2, log3/log4, 1
    assert [lr for (lr,) in lr_sequence(s, opt, 5)] == pytest.approx([0, 0, 0.5, math.log(3) / math.log(4), 1, 1])
    opt = two_group_optimizer((1.0,))
    s = WarmupLR(opt, 0.0, 1.0, 1, "linear")  # DeepSpeed warms up over at least 2 steps
    assert [lr for (lr,) in lr_sequence(s, opt, 3)] == pytest.approx([0, 0, 0.5, 1])


def test_schedule_defaults_follow_deepspeed():
    # WarmupLR without warmup_max_lr ramps to the optimizer's lr; WarmupDecayLR's default max is 0.001.
    opt = two_group_optimizer((0.02, 0.04))
    s = build_scheduler("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, opt)
    assert lr_sequence(s, opt, 4)[-1] == [0.02, 0.04]
    opt = two_group_optimizer((0.02, 0.04))
    s = build_scheduler("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 2, "warmup_type": "linear"}, opt)
    assert lr_sequence(s, opt, 3)[-1] == pytest.approx([0.001 * 98 / 98] * 2)
    opt = two_group_optimizer((1.0,))
    s = build_scheduler("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 2}, opt)
    assert lr_sequence(s, opt, 6)[-1] == pytest.approx([1e-4])  # cos_min_ratio default, held after the end


@pytest.mark.parametrize("name", WARMUP_SCHEDULES)
def test_state_dict_round_trip(name):
    params = dict(SCHEDULE_CASES[name], warmup_type="linear")
    opt = two_group_optimizer()
    sched = build_scheduler(name, params, opt)
    for _ in range(9):
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))  # JSON-safe, DeepSpeed's own format
    assert state == {"last_batch_iteration": 8}

    opt2 = two_group_optimizer()
    sched2 = build_scheduler(name, params, opt2)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr() == [g["lr"] for g in opt2.param_groups]
    assert lr_sequence(sched2, opt2, 15) == lr_sequence(sched, opt, 15)


def test_built_at_a_later_iteration_leaves_lr_then_continues():
    opt = two_group_optimizer((0.3,))
    s = WarmupLR(opt, 0.0, 1.0, 10, "linear", last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == 0.3  # as DeepSpeed: a resumed schedule does not touch the lr
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6)
    s.step(last_batch_iteration=2)  # DeepSpeed's explicit jump
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_is_a_torch_scheduler_without_warnings():
    w = torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer("AdamW", {"lr": 1.0}, [w])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = build_scheduler("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4,
                                                  "warmup_max_lr": 1.0, "warmup_type": "linear"}, opt)
        assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
        assert (sched.last_epoch, sched.last_batch_iteration) == (0, -1)
        for _ in range(3):
            w.grad = torch.ones(2)
            opt.step()
            sched.step()
    assert (sched.last_epoch, sched.last_batch_iteration) == (3, 2)
    assert sched.get_last_lr() == [0.5]


def test_accepts_a_wrapper_that_holds_the_optimizer():
    class Wrapper:  # e.g. the engine's sharded optimizer, which keeps the torch one as .optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = two_group_optimizer((1.0,))
    s = WarmupLR(Wrapper(opt), 0.25, 1.0, 4, "linear")
    assert s.optimizer is opt and opt.param_groups[0]["lr"] == 0.25


def test_total_steps_shorter_than_warmup_warns():
    with pytest.warns(UserWarning, match="total_num_steps .3. is less than warmup_num_steps .5."):
        build_scheduler("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 5}, two_group_optimizer())


# ----------------------------------------------------------------------------- optimizers


def make_problem(seed: int = 0) -> tuple[list[torch.nn.Parameter], callable]:
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(7, 3, generator=g))
    b = torch.nn.Parameter(torch.randn(3, generator=g))
    x, y = torch.randn(11, 7, generator=g), torch.randn(11, 3, generator=g)

    def backward(params):
        for p in params:
            p.grad = None
        loss = ((x @ params[0] + params[1] - y) ** 2).mean()
        loss.backward()

    return [w, b], backward


def train(make_opt, steps: int = 6) -> list[torch.Tensor]:
    params, backward = make_problem()
    opt = make_opt(params)
    for _ in range(steps):
        backward(params)
        opt.step()
    return [p.detach() for p in params]


ADAM_PARAMS = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_adam_is_adamw_by_default():
    ours = train(lambda ps: build_optimizer("Adam", ADAM_PARAMS, ps))
    ref = train(lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1))
    l2 = train(lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1))
    assert_same(ours, ref)
    assert not torch.allclose(ours[0], l2[0])  # the mapping matters: this is not L2 Adam


def test_adam_first_step_by_hand():
    # Step 1 of Adam: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps).
    lr, wd, eps = 0.1, 0.5, 1e-8
    for adam_w_mode in (True, False):
        p0 = torch.tensor([1.0, -2.0, 3.0])
        g = torch.tensor([0.5, 0.25, -1.0])
        p = p0.clone()
        p.grad = g.clone()
        build_optimizer("Adam", {"lr": lr, "weight_decay": wd, "eps": eps, "adam_w_mode": adam_w_mode}, [p]).step()
        if adam_w_mode:  # decoupled: shrink the weight, then the Adam step on the raw gradient
            want = p0 * (1 - lr * wd) - lr * g / (g.abs() + eps)
        else:  # L2: the decay joins the gradient before the moments
            g2 = g + wd * p0
            want = p0 - lr * g2 / (g2.abs() + eps)
        torch.testing.assert_close(p, want, rtol=0, atol=1e-6)


def test_adam_w_mode_false_is_l2_adam_and_adamw_type_ignores_it():
    params = dict(ADAM_PARAMS, adam_w_mode=False)
    ours = train(lambda ps: build_optimizer("Adam", params, ps))
    ref = train(lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1))
    assert_same(ours, ref)
    opt = build_optimizer("AdamW", params, [torch.zeros(2)])
    assert opt.param_groups[0]["decoupled_weight_decay"]  # DeepSpeed: type AdamW forces decoupled decay


def test_adam_defaults_are_deepspeeds():
    opt = build_optimizer("adam", {}, [torch.zeros(2)])
    g = opt.param_groups[0]
    # DeepSpeed builds its FusedAdam (adam_w_mode on); torch's classes only with torch_adam or amsgrad
    assert type(opt) is FusedAdam and g["decoupled_weight_decay"]
    assert type(build_optimizer("Adam", {"amsgrad": True}, [torch.zeros(2)])) is torch.optim.AdamW
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["amsgrad"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0, False)
    # torch_adam hands the params to torch.optim.AdamW, whose weight-decay default is 0.01
    torch_adamw = build_optimizer("Adam", {"torch_adam": True}, [torch.zeros(2)])
    assert type(torch_adamw) is torch.optim.AdamW and torch_adamw.param_groups[0]["weight_decay"] == 0.01
    l2 = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, [torch.zeros(2)])
    assert type(l2) is torch.optim.Adam and l2.param_groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("extra", [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                                   {"momentum": 0.5, "dampening": 0.3}])
def test_sgd_matches_torch(extra):
    ours = train(lambda ps: build_optimizer("SGD", dict(extra, lr=0.05), ps))
    ref = train(lambda ps: torch.optim.SGD(ps, lr=0.05, **extra))
    assert_same(ours, ref)
    assert build_optimizer("sgd", {}, [torch.zeros(2)]).param_groups[0]["lr"] == 1e-3  # torch's default, as in DeepSpeed


def test_flat_views_of_a_plain_buffer():
    """The engine's masters: views of one fp32 buffer, plain tensors, requires_grad False."""
    buf = torch.arange(16, dtype=torch.float32) / 10
    views = [buf[0:10], buf[10:16]]
    grads = [torch.linspace(-1, 1, 10), torch.linspace(2, -2, 6)]
    refs = [torch.nn.Parameter(v.clone()) for v in views]
    ours = build_optimizer("Adam", {"lr": 0.1, "weight_decay": 0.01}, [{"params": views}])
    ref = torch.optim.AdamW(refs, lr=0.1, weight_decay=0.01)
    for _ in range(3):
        for v, r, g in zip(views, refs, grads):
            v.grad, r.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(buf, torch.cat([r.detach() for r in refs]))
    assert set(ours.state[views[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_param_group_overrides_survive():
    a, b = torch.zeros(2), torch.zeros(3)
    opt = build_optimizer("AdamW", {"lr": 0.1, "weight_decay": 0.1}, [{"params": [a]}, {"params": b, "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels are chosen for CUDA tensors only")
def test_fused_on_cuda_views():
    buf = torch.arange(16, dtype=torch.float32, device="cuda") / 10
    views = [buf[0:10], buf[10:16]]
    opt = build_optimizer("Adam", {"lr": 0.1}, views)
    assert opt.param_groups[0]["fused"] is True
    ref_p = [torch.nn.Parameter(v.detach().cpu().clone()) for v in views]
    ref = torch.optim.AdamW(ref_p, lr=0.1, weight_decay=0.0)
    for v, r in zip(views, ref_p):
        v.grad = torch.ones_like(v)
        r.grad = torch.ones_like(r)
    opt.step()
    ref.step()
    torch.testing.assert_close(buf.cpu(), torch.cat([r.detach() for r in ref_p]))
    assert set(opt.state[views[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_cpu_tensors_use_torch_default_kernels():
    assert not build_optimizer("Adam", {}, [torch.zeros(2)]).param_groups[0]["fused"]


# ----------------------------------------------------------------------------- errors

OPT_ERRORS = [
    ("Adam", {"weight_decy": 0.1}, "optimizer.params.weight_decy: unknown parameter for Adam; did you mean 'weight_decay'?"),
    ("SGD", {"betas": [0.9, 0.99]}, "optimizer.params.betas: unknown parameter for SGD; expected one of dampening, lr,"),
    ("Adam", {"betas": 0.9}, "optimizer.params.betas: got 0.9, expected a pair of floats in [0, 1) like [0.9, 0.999]"),
    ("Adam", {"lr": "0.1"}, "optimizer.params.lr: got '0.1', expected a number"),
    ("AdamW", {"eps": -1e-8}, "optimizer.params.eps: got -1e-08, expected a number >= 0"),
    ("Adam", {"adam_w_mode": "yes"}, "optimizer.params.adam_w_mode: got 'yes', expected true or false"),
    ("Adam", {"bias_correction": False}, "optimizer.params.bias_correction: got false, which hf_zero does not support"),
    ("Adam", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm: not an optimizer parameter; set the top-level \"gradient_clipping\""),
    ("SGD", {"momentum": 0.9, "nesterov": True, "dampening": 0.1}, "optimizer.params.nesterov: true needs momentum > 0 and dampening 0"),
    ("Lamb", {}, "optimizer.type: got 'Lamb', expected one of Adam, AdamW, SGD"),
    ("AdanW", {}, "optimizer.type: got 'AdanW', expected one of Adam, AdamW, SGD; did you mean 'AdamW'?"),
    ("Adam", [0.1], "optimizer.params: got [0.1], expected an object of named parameters"),
]


@pytest.mark.parametrize("opt_type,params,message", OPT_ERRORS)
def test_optimizer_errors(opt_type, params, message):
    with pytest.raises(OptimizerConfigError) as err:
        build_optimizer(opt_type, params, [torch.zeros(2)])
    assert str(err.value).startswith(message), str(err.value)
    assert isinstance(err.value, ValueError)


def test_optimizer_needs_parameters():
    with pytest.raises(OptimizerConfigError, match="optimizer: got no parameters to optimize"):
        build_optimizer("Adam", {}, [])


SCHED_ERRORS = [
    ("WarmupLR", {"warmup_num_step": 10}, "scheduler.params.warmup_num_step: unknown parameter for WarmupLR; did you mean 'warmup_num_steps'?"),
    ("WarmupLR", {"total_num_steps": 10}, "scheduler.params.total_num_steps: unknown parameter for WarmupLR;"),
    ("WarmupLR", {"warmup_num_steps": 10.5}, "scheduler.params.warmup_num_steps: got 10.5, expected a positive integer"),
    ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps: got 0, expected a positive integer"),
    ("WarmupLR", {"warmup_min_lr": "0"}, "scheduler.params.warmup_min_lr: got '0', expected a number"),
    ("WarmupLR", {"warmup_max_lr": [1e-3] * 3}, "scheduler.params.warmup_max_lr: got 3 values, expected one per param group (2)"),
    ("WarmupDecayLR", {"warmup_num_steps": 10}, "scheduler.params.total_num_steps: missing; WarmupDecayLR needs the total number of optimizer steps"),
    ("WarmupCosineLR", {}, "scheduler.params.total_num_steps: missing; WarmupCosineLR needs"),
    ("WarmupDecayLR", {"total_num_steps": 0}, "scheduler.params.total_num_steps: got 0, expected a positive integer"),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 3, "cos_min_ratio": 2}, "scheduler.params.cos_min_ratio: got 2, expected a number between 0 and 1"),
    ("WarmupLR", {"last_batch_iteration": -2}, "scheduler.params.last_batch_iteration: got -2, expected an integer >= -1"),
    ("OneCycle", {}, "scheduler.params.cycle_min_lr: missing; OneCycle needs the lr at the bottom and top of its cycle"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 0},
     "scheduler.params.cycle_first_step_size: got 0, expected a positive number of iterations"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_second_step_size": -1},
     "scheduler.params.cycle_second_step_size: got -1, expected a number >= 0"),
    ("OneCycle", {"cycle_min_lr": [0.1] * 3, "cycle_max_lr": 0.1},
     "scheduler.params.cycle_min_lr: got 3 values, expected one per param group (2)"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lrr": 0.1},
     "scheduler.params.cycle_max_lrr: unknown parameter for OneCycle; did you mean 'cycle_max_lr'?"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size: got 0, expected a positive integer"),
    ("Cyclic", {}, "scheduler.type: got 'Cyclic', expected one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
]


@pytest.mark.parametrize("sched_type,params,message", SCHED_ERRORS)
def test_scheduler_errors(sched_type, params, message):
    with pytest.raises(OptimizerConfigError) as err:
        build_scheduler(sched_type, params, two_group_optimizer())
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("name", WARMUP_SCHEDULES)
def test_unknown_warmup_type_warns_and_ramps_as_log(name):
    """DeepSpeed accepts any ``warmup_type`` and warms up logarithmically for one it does not know; so does hf_zero."""
    params = dict(SCHEDULE_CASES[name])
    opt_log, opt_odd = two_group_optimizer(), two_group_optimizer()
    log = build_scheduler(name, dict(params, warmup_type="log"), opt_log)
    with pytest.warns(UserWarning, match="warmup_type: got 'cosine', expected 'log' or 'linear'; using 'log'"):
        odd = build_scheduler(name, dict(params, warmup_type="cosine"), opt_odd)
    assert odd.warmup_type == "log"
    assert lr_sequence(odd, opt_odd, 12) == lr_sequence(log, opt_log, 12)


def test_bad_scheduler_state():
    sched = build_scheduler("warmuplr", {}, two_group_optimizer())
    with pytest.raises(ValueError, match="scheduler state: got .*expected \\{'last_batch_iteration': int\\}"):
        sched.load_state_dict({"last_epoch": 3})


def test_supported_names():
    assert SUPPORTED_OPTIMIZERS == ("Adam", "AdamW", "SGD")
    assert SUPPORTED_SCHEDULERS == ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


# ----------------------------------------------------------------------------- OneCycle and LRRangeTest

# Run on both sides (``M`` is deepspeed.runtime.lr_schedules or hf_zero.optim.schedules): each case builds a schedule
# on a two-group optimizer and records the groups' lr and betas after construction and after every step.
_CYCLIC_CASES = """
import json, warnings
import torch

def groups(opt_cls, **kw):
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return opt_cls([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}], **kw)

CASES = [
    ("OneCycle", "adam", dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=5, cycle_second_step_size=3,
                              decay_lr_rate=0.1, decay_step_size=2, decay_mom_rate=0.05, cycle_min_mom=0.85,
                              cycle_max_mom=0.95), 20, None),
    ("OneCycle", "adam", dict(cycle_min_lr=[1e-3, 2e-3], cycle_max_lr=[1e-2, 3e-2], cycle_first_step_size=8,
                              cycle_second_step_size=6, cycle_first_stair_count=2, cycle_second_stair_count=3,
                              cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95]), 18, None),
    ("OneCycle", "adam", dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=4, cycle_momentum=False), 12, None),
    ("OneCycle", "sgd", dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=3, decay_lr_rate=0.5,
                             decay_step_size=1), 9, None),
    ("OneCycle", "adam", dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=4, cycle_second_step_size=0), 10, [2, 7, 3]),
    ("LRRangeTest", "adam", dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=3, lr_range_test_step_rate=0.5), 10, None),
    ("LRRangeTest", "sgd", dict(lr_range_test_min_lr=[1e-3, 5e-4], lr_range_test_step_size=2, lr_range_test_step_rate=2.0,
                                lr_range_test_staircase=True), 9, [4, 0]),
]
out = []
for name, opt, kw, steps, jumps in CASES:
    opt = groups(torch.optim.Adam, betas=(0.9, 0.999)) if opt == "adam" else groups(torch.optim.SGD, momentum=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = getattr(M, name)(opt, **kw)
    seen = []
    def record():
        seen.append([[float(g["lr"]) for g in opt.param_groups], [list(g.get("betas", ())) for g in opt.param_groups],
                     [float(x) for x in sched.get_lr()]])
    record()
    for _ in range(steps):
        sched.step()
        record()
    for it in jumps or []:
        sched.step(it)
        record()
    out.append(seen)
print(json.dumps(out))
"""


def test_one_cycle_and_lr_range_test_match_deepspeed() -> None:
    """Every lr and beta of DeepSpeed 0.19.8's own OneCycle and LRRangeTest, on cycles, stairs, decay, per-group
    lists, an optimizer without betas and jumps to a given iteration, equals hf_zero's (exactly: same arithmetic)."""
    from tests import dsenv

    ds = json.loads(dsenv.run_python("from deepspeed.runtime import lr_schedules as M\n" + _CYCLIC_CASES,
                                     timeout=300).stdout.strip().splitlines()[-1])
    import io
    from contextlib import redirect_stdout

    from hf_zero.runtime import lr_schedules as M

    buf = io.StringIO()
    with redirect_stdout(buf):
        exec(_CYCLIC_CASES, {"M": M})  # noqa: S102 - the same cases on both sides
    ours = json.loads(buf.getvalue())
    assert len(ours) == len(ds) == 7
    for case, (mine, theirs) in enumerate(zip(ours, ds)):
        assert mine == theirs, f"case {case}: {mine} != {theirs}"


def test_one_cycle_and_lr_range_test_from_the_config() -> None:
    """``scheduler.type`` OneCycle / LRRangeTest build the schedule from ``params``; its lr is the floor at once."""
    opt = two_group_optimizer()
    one = build_scheduler("onecycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2}, opt)
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 1e-4] and [g["betas"] for g in opt.param_groups] == [(0.8, 0.99)] * 2
    one.step()
    one.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3, 1e-3])
    assert one.state_dict() == {"last_batch_iteration": 1}
    opt = two_group_optimizer()
    rng = build_scheduler("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 1}, opt)
    rng.step()
    assert rng.get_last_lr() == pytest.approx([2e-3, 2e-3])
