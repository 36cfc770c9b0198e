"""DeepSpeed config parsing: malformed configs are rejected before any work with a message that
names the key; good configs (the tutorial's, the Hugging Face docs' zero2/zero3 with "auto")
parse; batch sizes are derived as DeepSpeed derives them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from hf_zero.config import ConfigError, ZeroConfig

SEEDS = Path(__file__).resolve().parents[1] / "examples"

MB = {"train_micro_batch_size_per_gpu": 2}

# (config, substrings the one-sentence message must contain)
MALFORMED = [
    ({"train_batch_sise": 8}, ["train_batch_sise", "did you mean 'train_batch_size'"]),
    ({**MB, "zero_optimization": {"stgae": 2}}, ["zero_optimization.stgae", "did you mean 'stage'"]),
    ({**MB, "zero_optimization": {"stage": 4}}, ["zero_optimization.stage: got 4", "0, 1, 2, 3"]),
    ({**MB, "zero_optimization": {"stage": "2"}}, ["zero_optimization.stage: got '2'"]),
    ({**MB, "zero_optimization": {"stage": True}}, ["zero_optimization.stage: got True"]),
    ({**MB, "zero_optimization": 2}, ["zero_optimization: got 2", "expected an object"]),
    ({**MB, "zero_optimization": {"overlap_comm": 1}}, ["zero_optimization.overlap_comm: got 1", "true or false"]),
    ({**MB, "zero_optimization": {"reduce_bucket_size": -5}}, ["zero_optimization.reduce_bucket_size: got -5"]),
    ({**MB, "zero_optimization": {"reduce_bucket_size": 2.5}}, ["zero_optimization.reduce_bucket_size: got 2.5", "integer"]),
    ({**MB, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, ["offload_optimizer.device: got 'cpu'", "not supported"]),
    ({**MB, "zero_optimization": {"offload_param": {"device": "nvme"}}}, ["offload_param.device: got 'nvme'"]),
    ({"train_batch_size": -8}, ["train_batch_size: got -8", "positive integer"]),
    ({"train_batch_size": "8"}, ["train_batch_size: got '8'"]),
    ({"train_micro_batch_size_per_gpu": 0}, ["train_micro_batch_size_per_gpu: got 0"]),
    ({**MB, "gradient_clipping": -1.0}, ["gradient_clipping: got -1.0", "non-negative"]),
    ({**MB, "gradient_clipping": "1.0"}, ["gradient_clipping: got '1.0'", "number"]),
    ({**MB, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16.enabled", "bf16.enabled", "at most one"]),
    ({**MB, "fp16": {"enabled": "yes"}}, ["fp16.enabled: got 'yes'"]),
    ({**MB, "fp16": {"enabled": True, "loss_scale_windw": 10}}, ["fp16.loss_scale_windw", "did you mean 'loss_scale_window'"]),
    ({**MB, "fp16": {"enabled": True, "hysteresis": 0}}, ["fp16.hysteresis: got 0"]),
    ({**MB, "fp16": {"enabled": True, "min_loss_scale": 0}}, ["fp16.min_loss_scale: got 0", "positive"]),
    ({**MB, "bf16": True}, ["bf16: got True", "expected an object"]),
    ({**MB, "optimizer": {"type": "Lamb"}}, ["optimizer.type: got 'Lamb'", "Adam, AdamW, SGD"]),
    ({**MB, "optimizer": {"params": {"lr": 1}}}, ["optimizer.type: got None"]),
    ({**MB, "optimizer": {"type": "AdamW", "parms": {}}}, ["optimizer.parms", "did you mean 'params'"]),
    ({**MB, "optimizer": "adam"}, ["optimizer: got 'adam'"]),
    ({**MB, "scheduler": {"type": "OneCycle", "params": {}}}, ["scheduler.type: got 'OneCycle'", "WarmupLR"]),
    ({**MB, "scheduler": {"type": "WarmupLR", "params": 3}}, ["scheduler.params: got 3"]),
    ({**MB, "amp": {"enabled": True}}, ["amp.enabled", "bf16"]),
    ({**MB, "sparse_gradients": True}, ["sparse_gradients: got true"]),
    ({**MB, "communication_data_type": "fp8"}, ["communication_data_type: got 'fp8'", "fp32, fp16, bf16"]),
    ({**MB, "steps_per_print": 0}, ["steps_per_print: got 0"]),
    ({**MB, "zero_optimization": {"stage": "auto"}}, ["zero_optimization.stage: got 'auto'", "only allowed"]),
    ([1, 2], ["config: got a list", "JSON object"]),
    (None, ["config: none was given"]),
]


@pytest.mark.parametrize("cfg, needles", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_configs_are_rejected_with_the_key(cfg, needles) -> None:
    with pytest.raises(ConfigError) as err:
        ZeroConfig.load(cfg)
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, msg
    assert msg.count("\n") == 0


BATCH_ERRORS = [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3,
     ["train_batch_size: got 64", "4 x gradient_accumulation_steps 2 x world size 3 = 24"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2, ["train_batch_size: got 10", "not a multiple", "= 8"]),
    ({"train_batch_size": 10}, 3, ["train_batch_size: got 10", "not a multiple"]),
    ({"gradient_accumulation_steps": 4}, 2, ["gradient_accumulation_steps alone"]),
    ({}, 2, ["no batch size given"]),
]


@pytest.mark.parametrize("cfg, world, needles", BATCH_ERRORS)
def test_batch_arithmetic_errors_show_the_arithmetic(cfg, world, needles) -> None:
    c = ZeroConfig.load(cfg)
    with pytest.raises(ConfigError) as err:
        c.resolve_batch_sizes(world)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "given, world, want",
    [
        ({"train_batch_size": 64}, 2, (64, 32, 1)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
        ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, 3, (48, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
    ],
)
def test_batch_sizes_are_derived(given, world, want) -> None:
    c = ZeroConfig.load(given)
    c.resolve_batch_sizes(world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == want


def test_seed_example_configs_parse() -> None:
    import ast

    for path in sorted(SEEDS.glob("0*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "deepspeed_config":
                cfg = ZeroConfig.load(ast.literal_eval(node.value))
                assert cfg.optimizer is not None and cfg.optimizer.type == "Adam"


HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hf_docs_zero3_config_with_auto_parses_and_records_auto_keys() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = ZeroConfig.load(HF_ZERO3)
    assert c.zero_optimization.stage == 3 and c.zero_optimization.stage3_max_live_parameters == 10**9
    assert c.train_batch_size is None and c.optimizer.params == {} and c.scheduler.type == "WarmupLR"
    assert {"train_batch_size", "optimizer.params.lr", "bf16.enabled", "zero_optimization.reduce_bucket_size"} <= c.auto_keys
    ignored = [w for w in caught if "accepts but ignores" in str(w.message)]
    assert len(ignored) == 1
    assert "wall_clock_breakdown" in str(ignored[0].message) and "zero_optimization.sub_group_size" in str(ignored[0].message)


def test_values_types_and_aliases() -> None:
    c = ZeroConfig.load({**MB, "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
                         "stage3_gather_fp16_weights_on_model_save": True}, "optimizer": {"type": "adamw", "params": {"lr": 3e-4}}})
    assert c.bf16.enabled and str(c.compute_dtype) == "torch.bfloat16"
    assert c.zero_optimization.reduce_bucket_size == 500_000_000
    assert c.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert c.optimizer.type == "AdamW" and c.optimizer.params == {"lr": 3e-4}
    assert ZeroConfig.load(c) is c


def test_json_files(tmp_path) -> None:
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}}))
    assert ZeroConfig.load(str(good)).zero_optimization.stage == 1
    assert ZeroConfig.load(good).train_batch_size == 8
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n  "zero": }')
    with pytest.raises(ConfigError, match=r"bad.json.*not valid JSON.*line 2, column 11"):
        ZeroConfig.load(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        ZeroConfig.load(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read"):
        ZeroConfig.load(str(tmp_path))
