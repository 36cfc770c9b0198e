"""Optimizers and LR schedules with DeepSpeed's semantics.

The reference lr sequences below are DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py,
read for this test): warm-up gamma = log(i+1)/log(W) or i/W for iteration i < W (W at least 2),
lr set to the warm-up start at construction, one iteration per step().
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_zero.config import ConfigError
from hf_zero.optim import build_optimizer, build_scheduler


def _opt(lr: float = 0.5, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=lr)


def _gamma(i: int, w: int, kind: str) -> float:
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


def _run(sched, steps: int) -> list[float]:
    seq = [sched.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        seq.append(sched.optimizer.param_groups[0]["lr"])
    return seq


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind: str) -> None:
    s = build_scheduler("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5, "warmup_type": kind}, _opt())
    want = [0.01] + [0.01 + 0.09 * (_gamma(i, 5, kind) if i < 5 else 1.0) for i in range(12)]
    assert _run(s, 12) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind: str) -> None:
    s = build_scheduler("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": kind}, _opt())
    want = [0.0] + [0.1 * (_gamma(i, 4, kind) if i < 4 else max(0.0, (12 - i) / 8)) for i in range(15)]
    assert _run(s, 15) == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind: str) -> None:
    s = build_scheduler("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": kind}, _opt(0.5))

    def ratio(i: int) -> float:
        if i < 3:
            return 0.1 + _gamma(i, 3, kind) * 0.9
        p = min(1.0, (i - 3 + 1) / 7)
        return 0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2

    want = [0.0] + [0.5 * ratio(i) for i in range(13)]
    assert _run(s, 13) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_per_group_lrs_and_state_round_trip() -> None:
    opt = _opt(groups=2)
    s = build_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 2.0], "warmup_num_steps": 4, "warmup_type": "linear"}, opt)
    for _ in range(2):
        s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.25, 0.1 + 1.9 / 4])
    state = s.state_dict()
    later = [_run(s, 3)[1:]]
    opt2 = _opt(groups=2)
    s2 = build_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 2.0], "warmup_num_steps": 4, "warmup_type": "linear"}, opt2)
    s2.load_state_dict(state)
    assert [_run(s2, 3)[1:]] == later
    assert s2.get_last_lr() == [g["lr"] for g in opt2.param_groups]


def _train(opt_factory, steps: int = 5) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(7, 15)
    buf = torch.zeros(200)
    buf[: w.numel()] = w.reshape(-1)
    master = buf[: w.numel()]  # a view of a plain buffer, as the engine's flat masters are
    opt = opt_factory([master])
    for t in range(steps):
        master.grad = torch.sin(master * (t + 1))
        opt.step()
    return buf[: w.numel()].clone()


def test_adam_is_decoupled_by_default_like_deepspeed() -> None:
    ours = _train(lambda p: build_optimizer("Adam", {"lr": 0.1, "weight_decay": 0.1}, p))
    ref = _train(lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1))
    assert torch.equal(ours, ref)
    l2 = _train(lambda p: build_optimizer("Adam", {"lr": 0.1, "weight_decay": 0.1, "adam_w_mode": False}, p))
    assert torch.equal(l2, _train(lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1)))
    assert not torch.equal(l2, ours)
    sgd = _train(lambda p: build_optimizer("sgd", {"lr": 0.1, "momentum": 0.9}, p))
    assert torch.equal(sgd, _train(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: build_optimizer("AdamW", {"lr": 1e-3, "betas": 0.9}, [torch.zeros(1)]), "optimizer.params.betas: got 0.9"),
        (lambda: build_optimizer("AdamW", {"learning_rate": 1e-3}, [torch.zeros(1)]), "optimizer.params.learning_rate: unknown key"),
        (lambda: build_optimizer("AdamW", {"weight_decya": 0.1}, [torch.zeros(1)]), "did you mean 'weight_decay'"),
        (lambda: build_optimizer("SGD", {}, [torch.zeros(1)]), "optimizer.params.lr: SGD needs"),
        (lambda: build_optimizer("Lion", {}, [torch.zeros(1)]), "optimizer.type: got 'Lion'"),
        (lambda: build_scheduler("WarmupDecayLR", {"warmup_num_steps": 3}, _opt()), "scheduler.params.total_num_steps"),
        (lambda: build_scheduler("WarmupLR", {"warmup_type": "cubic"}, _opt()), "scheduler.params.warmup_type: got 'cubic'"),
        (lambda: build_scheduler("WarmupLR", {"warmup_num_steps": 0}, _opt()), "scheduler.params.warmup_num_steps: got 0"),
        (lambda: build_scheduler("WarmupLR", {"warmup_min_lr": [0.1, 0.2]}, _opt()), "one per param group"),
    ],
)
def test_bad_optimizer_and_scheduler_params(build, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()
