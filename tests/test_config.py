"""DeepSpeed config parsing.

Malformed configs are rejected before any work with one sentence that names the key; good
configs (the tutorial's, Hugging Face's published zero2/zero3 with "auto") parse; ignored keys
are named in exactly one warning; batch sizes are derived as DeepSpeed derives them
(train = micro x accumulation x world size), checked against that product.
"""

from __future__ import annotations

import ast
import copy
import itertools
import json
import warnings
from pathlib import Path

import pytest
import torch

from hf_zero.config import ConfigError, FP16Config, ZeroConfig, ZeroOptimizationConfig
from hf_zero.config import parse as config_parse

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # the tutorial's scripts, verbatim
MB = {"train_micro_batch_size_per_gpu": 2}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the parser's warnings as a new process would (a key is named once per process)."""
    monkeypatch.setattr(config_parse, "_WARNED", set())


def _file(name: str, text: str):
    """A config given as a path: written into tmp_path when the case runs."""

    def make(tmp_path: Path) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return make


# (config or file factory, world size for resolve_batch_sizes or None to stop at load, substrings of the message)
MALFORMED = [
    # misspelt keys: did-you-mean at every level (keys that are not near-misses warn: test_config_rules.py)
    ({"train_batch_sise": 8}, None, ["train_batch_sise: unknown key", "did you mean 'train_batch_size'"]),
    ({**MB, "zero_optimization": {"stgae": 2}}, None, ["zero_optimization.stgae: unknown key", "did you mean 'stage'"]),
    ({**MB, "fp16": {"loss_scale_windw": 10}}, None, ["fp16.loss_scale_windw", "did you mean 'loss_scale_window'"]),
    ({**MB, "optimizer": {"type": "AdamW", "parms": {}}}, None, ["optimizer.parms", "did you mean 'params'"]),
    ({**MB, "activation_checkpointing": {"partition_activation": True}}, None,
     ["activation_checkpointing.partition_activation", "did you mean 'partition_activations'"]),
    # zero_optimization values
    ({**MB, "zero_optimization": {"stage": 4}}, None, ["zero_optimization.stage: got 4, expected one of 0, 1, 2, 3"]),
    ({**MB, "zero_optimization": {"stage": "2"}}, None, ["zero_optimization.stage: got '2'"]),
    ({**MB, "zero_optimization": {"stage": True}}, None, ["zero_optimization.stage: got True"]),
    ({**MB, "zero_optimization": {"stage": "auto"}}, None, ["zero_optimization.stage: got 'auto'", "only allowed"]),
    ({**MB, "zero_optimization": 2}, None, ["zero_optimization: got 2", "expected an object"]),
    ({**MB, "zero_optimization": {"overlap_comm": 2}}, None, ["zero_optimization.overlap_comm: got 2", "true or false"]),
    ({**MB, "zero_optimization": {"contiguous_gradients": "true"}}, None, ["contiguous_gradients: got 'true'"]),
    ({**MB, "zero_optimization": {"reduce_bucket_size": -5}}, None, ["zero_optimization.reduce_bucket_size: got -5", "positive integer"]),
    ({**MB, "zero_optimization": {"reduce_bucket_size": 2.5}}, None, ["zero_optimization.reduce_bucket_size: got 2.5", "integer"]),
    ({**MB, "zero_optimization": {"allgather_bucket_size": "big"}}, None,
     ["zero_optimization.allgather_bucket_size: got 'big'", "expected a number"]),
    ({**MB, "zero_optimization": {"stage3_max_live_parameters": "auto"}}, None, ["stage3_max_live_parameters: got 'auto'"]),
    ({**MB, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, None,
     ["offload needs ZeRO stage 1, 2 or 3"]),
    ({**MB, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, None, ['offload_param.nvme_path: "device": "nvme" needs a folder']),
    ({**MB, "zero_optimization": {"stage": 2, "cpu_offload": False, "offload_optimizer": {"device": "cpu"}}}, None,
     ["zero_optimization.cpu_offload: given together with offload_optimizer"]),
    ({**MB, "zero_optimization": {"zero_quantized_weights": True}}, None, ["zero_quantized_weights: got True", "ZeRO++"]),
    ({**MB, "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                                  "stage3_gather_16bit_weights_on_model_save": False}}, None, ["keep only the newer one"]),
    # batch sizes, clipping and the other scalars
    ({"train_batch_size": -8}, None, ["train_batch_size: got -8, expected a positive integer"]),
    ({"train_batch_size": "8"}, None, ["train_batch_size: got '8'"]),
    ({"train_micro_batch_size_per_gpu": 0}, None, ["train_micro_batch_size_per_gpu: got 0"]),
    ({**MB, "gradient_accumulation_steps": True}, None, ["gradient_accumulation_steps: got True"]),
    ({**MB, "gradient_clipping": -1.0}, None, ["gradient_clipping: got -1.0", "non-negative"]),
    ({**MB, "gradient_clipping": "1.0"}, None, ["gradient_clipping: got '1.0'", "number"]),
    ({**MB, "gradient_clipping": float("nan")}, None, ["gradient_clipping: got nan"]),
    ({**MB, "communication_data_type": "fp8"}, None, ["communication_data_type: got 'fp8'", "fp32, fp16, bf16"]),
    ({**MB, "steps_per_print": 0}, None, ["steps_per_print: got 0"]),
    ({**MB, "seed": -1}, None, ["seed: got -1", "an integer >= 0"]),
    ({**MB, "gradient_predivide_factor": 0}, None, ["gradient_predivide_factor: got 0", "positive number"]),
    ({**MB, "prescale_gradients": "no"}, None, ["prescale_gradients: got 'no'"]),
    # precision
    ({**MB, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, None, ["fp16.enabled", "bf16.enabled", "at most one"]),
    ({**MB, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}}, None, ["bfloat16.enabled", "at most one"]),
    ({**MB, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, None, ["bfloat16: given together with bf16"]),
    ({**MB, "fp16": {"enabled": "yes"}}, None, ["fp16.enabled: got 'yes'"]),
    ({**MB, "fp16": {"enabled": True, "hysteresis": 0}}, None, ["fp16.hysteresis: got 0"]),
    ({**MB, "fp16": {"enabled": True, "min_loss_scale": 0}}, None, ["fp16.min_loss_scale: got 0", "positive"]),
    ({**MB, "fp16": {"enabled": True, "loss_scale": -1}}, None, ["fp16.loss_scale: got -1"]),
    ({**MB, "fp16": {"initial_scale_power": 1.5}}, None, ["fp16.initial_scale_power: got 1.5"]),
    # read by dynamic loss scaling only (fp16 on, loss_scale 0): DeepSpeed checks it there, and so does hf_zero
    ({**MB, "fp16": {"enabled": True, "loss_scale_window": 0}}, None, ["fp16.loss_scale_window: got 0", "positive integer"]),
    ({**MB, "fp16": {"loss_scale_window": 0.5}}, None, ["fp16.loss_scale_window: got 0.5", "an integer"]),
    ({**MB, "fp16": {"fp16_master_weights_and_grads": True}}, None, ["fp16.fp16_master_weights_and_grads: got True"]),
    ({**MB, "bf16": True}, None, ["bf16: got True", "expected an object"]),
    # optimizer and scheduler
    ({**MB, "optimizer": {"type": "Lamb"}}, None, ["optimizer.type: got 'Lamb'", "not support yet", "Adam, AdamW, SGD"]),
    ({**MB, "optimizer": {"type": "Adamm"}}, None, ["optimizer.type: got 'Adamm'", "did you mean 'Adam'"]),
    ({**MB, "optimizer": {"params": {"lr": 1}}}, None, ["optimizer.type: missing", "Adam, AdamW, SGD"]),
    ({**MB, "optimizer": "adam"}, None, ["optimizer: got 'adam'", "expected an object"]),
    ({**MB, "optimizer": {"type": "SGD", "params": [0.1]}}, None, ["optimizer.params: got [0.1]"]),
    ({**MB, "scheduler": {"type": "OneCycl", "params": {}}}, None, ["scheduler.type: got 'OneCycl'", "did you mean 'OneCycle'"]),
    ({**MB, "scheduler": {"type": "Cyclic"}}, None, ["scheduler.type: got 'Cyclic'", "WarmupCosineLR, OneCycle, LRRangeTest"]),
    ({**MB, "scheduler": {"type": "WarmupLR", "params": 3}}, None, ["scheduler.params: got 3", "warmup_num_steps"]),
    # DeepSpeed features hf_zero does not have are errors, not silent no-ops
    ({**MB, "amp": {"enabled": True, "opt_level": "O1"}}, None, ["amp.enabled: got True", "Apex AMP is not supported", "bf16"]),
    ({**MB, "sparse_gradients": True}, None, ["sparse_gradients: got True", "not supported"]),
    ({**MB, "elasticity": {"enabled": True}}, None, ["elasticity.enabled: got True", "not supported"]),
    ({**MB, "sparse_attention": {"mode": "fixed"}}, None, ["sparse_attention: got", "not supported"]),
    ({**MB, "gradient_allreduce_op": "sum"}, None, ["gradient_allreduce_op: got 'sum'", "mean"]),
    # ignored keys still have types
    ({**MB, "wall_clock_breakdown": "false"}, None, ["wall_clock_breakdown: got 'false'", "true or false"]),
    ({**MB, "tensorboard": {"enabled": "yes"}}, None, ["tensorboard.enabled: got 'yes'"]),
    ({**MB, "tensorboard": True}, None, ["tensorboard: got True", "expected an object"]),
    # the config itself
    ([1, 2], None, ["config: got a list", "JSON object"]),
    (None, None, ["a config is required", "pass config= a dict or a path to a DeepSpeed JSON file"]),
    (_file("bad.json", '{"train_batch_size": 8,\n  "zero": }'), None, ["bad.json", "not valid JSON", "line 2, column 11"]),
    (_file("list.json", "[1, 2]"), None, ["list.json", "holds a JSON array", "JSON object"]),
    (_file("dup.json", '{"train_batch_size": 8, "train_batch_size": 16}'), None, ["dup.json", "train_batch_size: appears twice"]),
    (lambda tmp_path: str(tmp_path / "missing.json"), None, ["missing.json", "does not exist"]),
    (lambda tmp_path: tmp_path, None, ["cannot read"]),
    # batch arithmetic, found by resolve_batch_sizes(world_size)
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3,
     ["train_batch_size: got 64, but train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size 3 = 24",
      "drop one and it will be derived"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2,
     ["train_batch_size: got 10", "not a multiple of train_micro_batch_size_per_gpu 4 x world size 2 = 8"]),
    ({"train_batch_size": 12, "gradient_accumulation_steps": 5}, 2,
     ["train_batch_size: got 12", "not a multiple of gradient_accumulation_steps 5 x world size 2 = 10"]),
    ({"train_batch_size": 10}, 3, ["train_batch_size: got 10, which is not a multiple of world size 3"]),
    ({"gradient_accumulation_steps": 4}, 2, ["gradient_accumulation_steps: got 4 alone", "train_micro_batch_size_per_gpu"]),
    ({}, 2, ["train_batch_size: no batch size given"]),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, 2,
     ["no batch size given", '"auto"', "train_batch_size, train_micro_batch_size_per_gpu"]),
    (MB, 0, ["world_size: got 0, expected a positive integer"]),
]


@pytest.mark.parametrize("given, world, needles", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_configs_are_rejected_with_the_key(given, world, needles, tmp_path) -> None:
    if callable(given):
        given = given(tmp_path)
    with pytest.raises(ConfigError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ZeroConfig.load(given)
        assert world is not None, "load() accepted a config it should have refused"
        cfg.resolve_batch_sizes(world)
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, msg
    assert "\n" not in msg and msg.count(": ") >= 1


def test_there_are_enough_malformed_cases() -> None:
    assert len(MALFORMED) >= 25


# every way of giving one, two or three of the batch keys, at awkward world sizes
MICRO_ACCUM = [(4, 2), (2, 6), (5, 3)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("given", [c for r in (1, 2, 3) for c in itertools.combinations(range(3), r) if c != (2,)])
def test_batch_sizes_are_derived_from_any_sufficient_subset(given: tuple[int, ...], world: int) -> None:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for micro, accum in MICRO_ACCUM:
        full = (micro * accum * world, micro, accum)
        if given == (0,):  # the global batch alone: one accumulation step, the batch split over the ranks
            want = (full[0], full[0] // world, 1)
        elif given == (1,):  # the micro-batch alone: one accumulation step
            want = (micro * world, micro, 1)
        else:  # any two (or all three) fix the triple
            want = full
        cfg = ZeroConfig.load({names[i]: full[i] for i in given})
        cfg.resolve_batch_sizes(world)
        got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
        assert got == want, (given, world, got, want)
        assert got[0] == got[1] * got[2] * world
        cfg.resolve_batch_sizes(world)  # idempotent once complete
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == got


def test_deepspeed_batch_rules_by_hand() -> None:
    cases = [
        ({"train_batch_size": 64}, 2, (64, 32, 1)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
        ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, 3, (48, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
    ]
    for given, world, want in cases:
        cfg = ZeroConfig.load(given)
        cfg.resolve_batch_sizes(world)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == want


def test_tutorial_example_configs_parse() -> None:
    stages = {}
    for path in sorted(EXAMPLES.glob("0*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "deepspeed_config":
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # nothing in them is ignored
                    cfg = ZeroConfig.load(ast.literal_eval(node.value))
                assert cfg.optimizer is not None and cfg.optimizer.type == "Adam" and cfg.optimizer.params == {"lr": 0.001}
                cfg.resolve_batch_sizes(2)
                assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 32, 1)
                stages[path.name[:2]] = cfg.zero_optimization.stage
    assert stages == {"01": 0, "02": 0, "03": 2, "04": 3}


# Hugging Face's published DeepSpeed configs, with offload set to "none" (offload is refused: see below)
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
             "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True}, "allgather_partitions": True,
        "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
}
AUTO_COMMON = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
}


def test_hf_docs_zero2_and_zero3_configs_parse_and_record_auto_keys() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        z2 = ZeroConfig.load(HF_ZERO2)
    # hf_zero all-gathers per flat group, sized by reduce_bucket_size: allgather_bucket_size 2e8 is named as ignored
    assert [str(w.message) for w in caught] == [
        "hf_zero accepts but ignores these DeepSpeed keys: zero_optimization.allgather_bucket_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key it sets either acts or asks for nothing
        z3 = ZeroConfig.load(HF_ZERO3)
    assert z2.auto_keys == AUTO_COMMON
    assert z3.auto_keys == AUTO_COMMON | {
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    }
    zo2, zo3, default = z2.zero_optimization, z3.zero_optimization, ZeroOptimizationConfig()
    assert (zo2.stage, zo2.reduce_bucket_size, zo2.offload_optimizer.device) == (2, 200_000_000, "none")
    assert isinstance(zo2.reduce_bucket_size, int)
    # "auto" means "not given" at this layer: defaults, and None for the batch keys
    assert (zo3.reduce_bucket_size, zo3.stage3_prefetch_bucket_size, zo3.stage3_param_persistence_threshold) == (
        default.reduce_bucket_size, default.stage3_prefetch_bucket_size, default.stage3_param_persistence_threshold)
    assert zo3.stage3_max_live_parameters == 10**9 and zo3.offload_param.pin_memory is True
    for cfg in (z2, z3):
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (None, None, None)
        # DeepSpeed's default clipping (1.0); the Trainer's fill below sets 0, as it clips with max_grad_norm
        assert cfg.gradient_clipping == 1.0 and not cfg.fp16.enabled and not cfg.bf16.enabled
        assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {}
        assert cfg.scheduler.type == "WarmupLR" and cfg.scheduler.params == {} and cfg.steps_per_print == 2000
    # the Trainer integration fills the values, then everything resolves
    filled = copy.deepcopy(HF_ZERO3)
    filled.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, train_batch_size=16, gradient_clipping=1.0)
    filled["bf16"]["enabled"] = True
    filled["optimizer"]["params"]["lr"] = 3e-4
    cfg = ZeroConfig.load(filled)
    cfg.resolve_batch_sizes(2)
    assert cfg.compute_dtype == torch.bfloat16 and cfg.optimizer.params == {"lr": 3e-4} and cfg.gradient_clipping == 1.0
    assert "optimizer.params.lr" not in cfg.auto_keys and "optimizer.params.eps" in cfg.auto_keys
    # as Hugging Face actually publishes them, with CPU offload of the optimizer and (stage 3) the parameters: both
    # run (tests/test_offload.py); NVMe is refused rather than silently dropped
    published = copy.deepcopy(HF_ZERO2)
    published["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    assert ZeroConfig.load(published).zero_optimization.offload_optimizer.device == "cpu"
    published = copy.deepcopy(HF_ZERO3)
    published["zero_optimization"]["offload_param"]["device"] = "cpu"
    assert ZeroConfig.load(published).zero_optimization.offload_param.device == "cpu"
    published["zero_optimization"]["offload_param"]["device"] = "nvme"  # NVMe runs too (tests/test_nvme.py), given a path
    with pytest.raises(ConfigError, match='offload_param.nvme_path: "device": "nvme" needs a folder'):
        ZeroConfig.load(published)


def test_ignored_keys_are_named_in_exactly_one_warning() -> None:
    given = {
        **MB,
        "memory_breakdown": True,
        "tensorboard": {"enabled": True, "output_path": "tb"},
        "flops_profiler": {"enabled": False, "profile_step": 1},  # asks for nothing: not named
        "dump_state": False,  # DeepSpeed's default: not named
        "fp16": {"enabled": True, "auto_cast": True},  # read: engine(...) casts floating inputs to fp16
        "zero_optimization": {"stage": 2, "round_robin_gradients": True, "sub_group_size": 1e8, "ignore_unused_parameters": True},
        "amp": {"enabled": False, "opt_level": "O1"},
        "sparse_gradients": False,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = ZeroConfig.load(given)
    assert len(caught) == 2 and {w.category for w in caught} == {UserWarning}
    assert str(caught[0].message) == (
        "hf_zero accepts but ignores these DeepSpeed keys: memory_breakdown, tensorboard, "
        "zero_optimization.round_robin_gradients, zero_optimization.sub_group_size (it sizes the offloaded host step; "
        "without offload_optimizer the optimizer steps each group in one call)"
    )
    # disabled, but removed from DeepSpeed, whose 0.19.8 refuses them on sight: named in their own warning
    assert str(caught[1].message) == (
        "hf_zero accepts these keys, which older DeepSpeed accepted but DeepSpeed 0.19.8 refuses: "
        "amp (Apex AMP, removed from DeepSpeed), sparse_gradients (removed from DeepSpeed)"
    )
    assert cfg.fp16.enabled and cfg.fp16.auto_cast and cfg.zero_optimization.stage == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroConfig.load({**MB, "memory_breakdown": False, "wall_clock_breakdown": True, "tensorboard": {"enabled": False}})


def test_values_types_defaults_and_aliases() -> None:
    cfg = ZeroConfig.load({
        **MB, "bfloat16": {"enabled": True}, "communication_data_type": "BF16", "seed": 7,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "stage3_gather_fp16_weights_on_model_save": True},
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "warmupdecaylr", "params": {"total_num_steps": 10, "warmup_num_steps": "auto"}},
        "activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4},
    })
    assert cfg.bf16.enabled and cfg.compute_dtype == torch.bfloat16 and cfg.communication_data_type == "bf16"
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000 and type(cfg.zero_optimization.reduce_bucket_size) is int
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95]}
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.params == {"total_num_steps": 10}
    assert cfg.auto_keys == {"scheduler.params.warmup_num_steps"} and cfg.seed == 7
    assert cfg.activation_checkpointing == {"partition_activations": False, "number_checkpoints": 4}
    assert ZeroConfig.load(cfg) is cfg
    # DeepSpeed's defaults when a section is absent
    plain = ZeroConfig.load(MB)
    assert plain.fp16 == FP16Config() and plain.compute_dtype == torch.float32 and plain.steps_per_print == 10
    assert plain.zero_optimization == ZeroOptimizationConfig() and plain.zero_optimization.offload_param is None
    assert ZeroConfig.load({**MB, "fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert ZeroConfig.load({**MB, "steps_per_print": None, "communication_data_type": None}).steps_per_print is None


def test_raw_is_a_copy_and_the_input_is_untouched() -> None:
    given = {**MB, "bfloat16": {"enabled": True}, "optimizer": {"type": "adam", "params": {"lr": "auto", "eps": 1e-6}}}
    before = copy.deepcopy(given)
    cfg = ZeroConfig.load(given)
    assert given == before and cfg.raw == before
    given["optimizer"]["params"]["eps"] = 1.0
    assert cfg.raw["optimizer"]["params"]["eps"] == 1e-6 and cfg.optimizer.params == {"eps": 1e-6}


def test_json_files(tmp_path: Path) -> None:
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}))
    from_str, from_path = ZeroConfig.load(str(good)), ZeroConfig.load(good)
    assert from_str == from_path
    assert from_str.zero_optimization.stage == 1 and from_str.zero_optimization.reduce_bucket_size == 500_000_000
    assert from_str.raw == {"train_batch_size": 8, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
