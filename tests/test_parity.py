"""Arithmetic oracle for ZeRO stages 0-2.

Training at world size N with any stage must give the same losses and weights as one process
training on the concatenated batch with the same optimizer (fp32: rel. 1e-5). Each spawned
group runs the whole grid of stages x accumulation x clipping.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed import spawn
from tests.models import make_data, make_model, param_groups

STEPS = 4
MICRO = 2
LR = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm().clamp_min(1e-12))


def _oracle(steps: int, global_batch: int, clip: float, sched: bool) -> tuple[list[float], dict]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.99), eps=1e-8)
    sch = None
    if sched:
        from hf_zero.optim.schedules import build_scheduler

        sch = build_scheduler("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}, opt)
    ids, labels = make_data(steps, global_batch)
    losses = []
    for t in range(steps):
        loss = model(ids[t], labels[t])
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sch is not None:
            sch.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run_grid(rank: int, world: int, cases: list) -> list:
    import torch.distributed as dist

    import hf_zero

    results = []
    for stage, gas, clip, sched in cases:
        model = make_model()
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
            "steps_per_print": 1000,
        }
        if sched:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}}
            cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}}
            engine, _, _, _ = hf_zero.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        else:
            engine, _, _, _ = hf_zero.initialize(
                model=model,
                model_parameters=param_groups(model),
                optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99), eps=1e-8),
                config=cfg,
            )
        gb = MICRO * gas * world
        ids, labels = make_data(STEPS, gb)
        losses = []
        for t in range(STEPS):
            total = torch.zeros((), device=engine.device)
            for g in range(gas):
                lo = (rank * gas + g) * MICRO
                loss = engine(ids[t, lo : lo + MICRO], labels[t, lo : lo + MICRO])
                engine.backward(loss)
                engine.step()
                total += loss.detach().float() / gas
            dist.all_reduce(total)
            losses.append(total.item() / world)
        assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
        ref_losses, ref_w = _oracle(STEPS, gb, clip, sched)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        w_err = max(_rel(p.detach(), ref_w[n]) for n, p in engine.module.named_parameters())
        results.append({"case": [stage, gas, clip, sched], "loss_err": loss_err, "w_err": w_err, "norm": engine.get_global_grad_norm()})
    return results


CASES = [list(c) + [False] for c in itertools.product([0, 1, 2], [1, 3], [0.0, 0.05])] + [[2, 2, 0.0, True], [1, 1, 0.05, True]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stages_match_single_process(world: int) -> None:
    results = spawn(_run_grid, world, CASES)
    for per_rank in results:
        assert len(per_rank) == len(CASES)
        for r in per_rank:
            assert r["loss_err"] < 1e-5, r
            assert r["w_err"] < 1e-5, r
    # every rank reports the same global gradient norm
    for i in range(len(CASES)):
        norms = [per_rank[i]["norm"] for per_rank in results]
        assert max(norms) - min(norms) <= 1e-6 * max(norms), norms
