"""ZeRO-Offload of the optimizer (stages 1-2) against the arithmetic oracle: world N equals one process.

tests/test_offload.py compares offloaded runs with the same runs without offload; this file holds
them to the parity suite's oracle (tests/test_parity.py): one plain torch AdamW process on the
concatenated batch, fp32, rel 1e-5, at world 1, 2 and 3, over accumulation, clipping and a
config scheduler (which must drive the offloaded optimizer's learning rate).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed import spawn
from tests.models import make_data, make_model, param_groups
from tests.test_parity import LR, MICRO, STEPS, _oracle, _rel


def _config(stage: int, gas: int, clip: float, offload: bool, sched: bool = False) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                              "stage3_param_persistence_threshold": 10},
        "steps_per_print": 1000,
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if sched:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                           "warmup_num_steps": 3, "warmup_type": "linear"}}
    return cfg


def _engine(cfg: dict):  # noqa: ANN202 - a test helper
    import hf_zero

    model = make_model()
    if "optimizer" in cfg:
        return hf_zero.initialize(model=model, model_parameters=param_groups(model), config=cfg)[0]
    return hf_zero.initialize(
        model=model, model_parameters=param_groups(model), config=cfg,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99), eps=1e-8),
    )[0]


def _train(engine, rank: int, world: int, gas: int) -> list[float]:  # noqa: ANN001 - a test helper
    import torch.distributed as dist

    ids, labels = make_data(STEPS, MICRO * gas * world)
    losses = []
    for t in range(STEPS):
        total = torch.zeros(())
        for g in range(gas):
            lo = (rank * gas + g) * MICRO
            loss = engine(ids[t, lo : lo + MICRO], labels[t, lo : lo + MICRO])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _weights_err(engine, ref_w: dict) -> float:  # noqa: ANN001 - a test helper
    from hf_zero.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # stage 3 holds shards between uses
        return max(_rel(p.detach(), ref_w[n]) for n, p in engine.module.named_parameters())


def _run_oracle_grid(rank: int, world: int, cases: list) -> list:
    from hf_zero.zero.offload import OffloadedFlatGroup, OffloadedShardedParamGroup

    out = []
    for stage, gas, clip, sched in cases:
        engine = _engine(_config(stage, gas, clip, offload=True, sched=sched))
        kinds = (OffloadedShardedParamGroup, OffloadedFlatGroup)
        groups = [g for g in engine.zero_optimizer.groups if g.master is not None]
        assert groups and all(isinstance(g, kinds) for g in groups)
        assert stage < 3 or any(isinstance(g, OffloadedShardedParamGroup) for g in groups)
        # a real host master of its own, not a view of the parameters
        for g in groups:
            mine = getattr(g, "param_flat", None) if isinstance(g, OffloadedFlatGroup) else getattr(g, "param_shard", None)
            assert mine is None or mine.data_ptr() != g.master.data_ptr()
        losses = _train(engine, rank, world, gas)
        ref_losses, ref_w = _oracle(STEPS, MICRO * gas * world, clip, sched)
        out.append({
            "case": [stage, gas, clip, sched],
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "w_err": _weights_err(engine, ref_w),
            "state_dev": sorted({str(v.device) for s in engine.optimizer.state.values() for v in s.values()}),
        })
    return out


ORACLE_CASES = [[*c, False] for c in itertools.product([1, 2], [1, 3], [0.0, 0.05])] + [[2, 2, 0.05, True], [3, 2, 0.05, False],
                                                                                       [3, 1, 0.0, True]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_matches_single_process(world: int) -> None:
    for per_rank in spawn(_run_oracle_grid, world, ORACLE_CASES):
        assert len(per_rank) == len(ORACLE_CASES)
        for r in per_rank:
            assert r["loss_err"] < 1e-5 and r["w_err"] < 1e-5, r
            assert r["state_dev"] == ["cpu"], r



def _trainer_run(rank: int, world: int, root: str) -> list:
    """transformers' docs ZeRO-3 offload config verbatim through the Trainer (offload_optimizer and offload_param
    to the CPU), then the same config without the two offload keys."""
    import json
    import os

    from datasets import Dataset

    import hf_zero
    from tests.test_ds_corpus_trainer import CONFIGS, SEQ, VOCAB, _model, _reset, user_arguments

    given = json.loads((CONFIGS / "transformers_docs_zero3.json").read_text())
    plain = json.loads(json.dumps(given))
    del plain["zero_optimization"]["offload_optimizer"], plain["zero_optimization"]["offload_param"]
    out = []
    for i, cfg in enumerate((given, plain)):
        _reset()
        path = os.path.join(root, f"{i}.json")
        if rank == 0:
            with open(path, "w") as f:
                json.dump(cfg, f)
        torch.distributed.barrier()
        kw = {**user_arguments(cfg, world), "max_steps": 3}
        args = hf_zero.TrainingArguments(output_dir=os.path.join(root, str(i)), deepspeed=path, report_to="none",
                                         disable_tqdm=True, logging_steps=1, save_strategy="no", seed=0, **kw)
        rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * world * args.max_steps
        ids = torch.randint(2, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
        trainer = hf_zero.Trainer(model=_model(), args=args,
                                  train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))
        trainer.train()
        weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        offloaded = any(type(g).__name__.startswith("Offloaded") for g in trainer.engine.zero_optimizer.groups) and all(
            g.shard_on_host for g in trainer.engine.zero_optimizer.stage3_groups)
        out.append({"offloaded": offloaded, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                    "weights": {k: v.detach().float().reshape(-1).tolist() for k, v in (weights or {}).items()}})
    return out


def test_transformers_docs_zero3_offload_config_through_the_trainer_equals_it_without_offload(tmp_path) -> None:  # noqa: ANN001
    results = spawn(_trainer_run, 2, str(tmp_path))
    on, off = results[0]
    assert on["offloaded"] and not off["offloaded"]
    assert len(on["losses"]) == 3 and on["losses"] == pytest.approx(off["losses"], rel=1e-5)
    assert on["weights"] and max(_rel(torch.tensor(on["weights"][k]), torch.tensor(off["weights"][k]))
                                 for k in off["weights"]) < 1e-5
