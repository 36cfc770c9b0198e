"""``"auto"`` in a zero_config is filled from the TrainingArguments; every contradiction is listed at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_zero.engine import UsageError

REPO = Path(__file__).resolve().parent.parent


def _args(tmp_path: Path, **kw):  # noqa: ANN202
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=3e-4, max_grad_norm=0.7, report_to="none", use_cpu=True)
    return TrainingArguments(**{**base, **kw})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_configs_resolve_and_load(stage: int, tmp_path: Path) -> None:
    from hf_zero.config import ZeroConfig
    from hf_zero.integrations.transformers import fill_auto

    raw = json.loads((REPO / "configs" / f"zero{stage}.json").read_text())
    cfg = fill_auto(raw, _args(tmp_path), world_size=2)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["bf16"]["enabled"] is False
    assert raw["train_micro_batch_size_per_gpu"] == "auto"  # the input is not modified
    assert ZeroConfig.load(cfg).zero_optimization.stage == stage


def test_every_mismatch_is_listed(tmp_path: Path) -> None:
    from hf_zero.integrations.transformers import fill_auto

    raw = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": "auto"}},
           "zero_optimization": {"stage": 2}}
    with pytest.raises(UsageError) as info:
        fill_auto(raw, _args(tmp_path), world_size=2)
    msg = str(info.value)
    for part in ("train_micro_batch_size_per_gpu: config has 8", "gradient_clipping: config has 1.0",
                 "bf16.enabled: config has True", "optimizer.params.lr: config has 0.001"):
        assert part in msg, msg
    assert "gradient_accumulation_steps" not in msg and "\n" not in msg


def _trainer(tmp_path: Path, scheduler_params: dict):  # noqa: ANN202
    import torch
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    zero = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": scheduler_params}, "zero_optimization": {"stage": 1}}
    args = hf_zero.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-4,
                                     warmup_steps=7, report_to="none", use_cpu=True, zero_config=zero)
    return hf_zero.Trainer(model=torch.nn.Linear(3, 2), args=args)


def test_scheduler_autos_come_from_the_trainer(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                  "total_num_steps": "auto"})
    trainer.create_optimizer()
    sched = trainer.create_scheduler(num_training_steps=50)
    lrs = []
    for _ in range(50):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        sched.step()
    assert max(lrs) == pytest.approx(3e-4) and lrs.index(max(lrs)) == 7  # warm up over --warmup_steps to --learning_rate
    assert lrs[-1] < lrs[7] / 10  # and decay to 0 over the Trainer's 50 steps


def test_scheduler_step_counts_that_contradict_the_trainer_are_listed(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="scheduler.params.warmup_max_lr: config has 0.001"):  # known at init
        _trainer(tmp_path, {"warmup_max_lr": 1e-3})
    trainer = _trainer(tmp_path, {"warmup_num_steps": 100, "total_num_steps": 60})
    trainer.create_optimizer()
    with pytest.raises(UsageError) as info:
        trainer.create_scheduler(num_training_steps=50)
    msg = str(info.value)
    assert "scheduler.params.warmup_num_steps: config has 100, the Trainer computed 7" in msg, msg
    assert "scheduler.params.total_num_steps: config has 60, the Trainer computed 50" in msg, msg


def test_auto_bucket_sizes_follow_the_hidden_size_with_a_floor() -> None:
    from types import SimpleNamespace

    from hf_zero.integrations.accelerate import MIN_AUTO_REDUCE_BUCKET, fill_bucket_autos

    def filled(hidden: int) -> dict:
        cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"}}
        fill_bucket_autos(cfg, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden)))
        return cfg["zero_optimization"]

    small, large = filled(1024), filled(8192)
    assert small["reduce_bucket_size"] == MIN_AUTO_REDUCE_BUCKET  # 1024**2 would be ~1M: latency-bound buckets
    assert large["reduce_bucket_size"] == 8192 * 8192
    assert small["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert small["stage3_param_persistence_threshold"] == 10240
    with pytest.raises(UsageError, match="no config.hidden_size"):
        fill_bucket_autos({"zero_optimization": {"reduce_bucket_size": "auto"}}, SimpleNamespace(config=None))


def test_pipeline_config_is_for_initialize_and_refused_by_the_trainer(tmp_path: Path) -> None:
    from hf_zero.config import ZeroConfig
    from hf_zero.integrations.transformers import TrainingArguments

    cfg = ZeroConfig.load(str(REPO / "configs" / "pipeline.json"))
    cfg.resolve_batch_sizes(4)
    assert (cfg.pipeline.schedule, cfg.train_batch_size, cfg.zero_optimization.stage) == ("1f1b", 128, 1)
    with pytest.raises(UsageError, match="has a pipeline section, but Trainer/Accelerator train the model unsplit"):
        TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                          zero_config=str(REPO / "configs" / "pipeline.json"))
