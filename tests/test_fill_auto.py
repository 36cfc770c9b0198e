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
