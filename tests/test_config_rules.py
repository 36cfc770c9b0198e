"""The key rules of the config parser: DeepSpeed's aliases, typos against unknown keys, warnings once.

- DeepSpeed's field names and their aliases (``prefetch_bucket_size`` / ``stage3_prefetch_bucket_size``)
  land in the same field; messages and "auto" paths keep the user's spelling; two spellings of one
  key are refused, as DeepSpeed refuses them.
- Inside a section DeepSpeed 0.19.8 closes (a pydantic model that forbids extra keys: ``bf16``, ``fp16``,
  ``zero_optimization``, its offload sections, ``compile``, the monitors, ...), an unknown key is refused
  as DeepSpeed refuses it, with "did you mean" where one fits; hf_zero's own keys there stay accepted.
  Elsewhere a key DeepSpeed does not know is a "did you mean" error only when it is a near-certain
  misspelling; other unknown keys (real configs carry ``comms_config``, ``monitor_config``) are named
  in a warning. (Both directions against DeepSpeed's own parser: tests/test_ds_config_oracle.py.)
- What older DeepSpeed accepted and 0.19.8 refuses (a fractional ``fp16.min_loss_scale``, a disabled
  legacy ``curriculum_learning``, ``compile.disable``) is accepted and named in a warning saying so.
- Keys hf_zero accepts without acting on (issue 16's unread ZeRO fields among them) are named in the
  "accepts but ignores" warning when they ask for something, once per process.
- Offload sections parse in full, with DeepSpeed's defaults, and are refused in one sentence, as is
  sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest

from hf_zero.config import ConfigError, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from hf_zero.config import parse as config_parse
from hf_zero.config import sections as config_sections
from hf_zero.config.parse import near_miss, suggest
from hf_zero.config.schema import CLOSED_WHOLE, SECTIONS, ZERO, classify
from tests.ds_corpus import CONFIGS, DEEPSPEED_REFUSES

MB = {"train_micro_batch_size_per_gpu": 2}
PACKAGE = Path(config_parse.__file__).resolve().parents[1]  # hf_zero/


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_parse, "_WARNED", set())


def load(config: dict) -> tuple[ZeroConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = ZeroConfig.load(config)
    return cfg, [str(w.message) for w in caught]


def refusal(config: dict) -> str:
    with pytest.raises(ConfigError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ZeroConfig.load(config)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- DeepSpeed's spellings


def test_deepspeed_field_names_and_stage3_aliases_land_in_the_same_fields() -> None:
    names = {"prefetch_bucket_size": 7, "param_persistence_threshold": 8, "max_live_parameters": 9}
    aliases = {"stage3_prefetch_bucket_size": 7, "stage3_param_persistence_threshold": 8, "stage3_max_live_parameters": 9}
    by_name, _ = load({**MB, "zero_optimization": {"stage": 3, **names}})
    by_alias, _ = load({**MB, "zero_optimization": {"stage": 3, **aliases}})
    assert by_name.zero_optimization == by_alias.zero_optimization
    zo = by_name.zero_optimization
    assert (zo.stage3_prefetch_bucket_size, zo.stage3_param_persistence_threshold, zo.stage3_max_live_parameters) == (7, 8, 9)
    # max_reuse_distance is read too (no-grad forwards keep a unit within it, hf_zero/zero/inference.py), not ignored
    reuse, said = load({**MB, "zero_optimization": {"max_reuse_distance": 5}})
    assert reuse.zero_optimization.stage3_max_reuse_distance == 5 and said == []
    # messages and "auto" name the key as the user spelt it
    assert refusal({**MB, "zero_optimization": {"prefetch_bucket_size": -1}}).startswith(
        "zero_optimization.prefetch_bucket_size: got -1, expected an integer >= 0")
    auto, _ = load({**MB, "zero_optimization": {"prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"}})
    assert auto.auto_keys == {"zero_optimization.prefetch_bucket_size", "zero_optimization.param_persistence_threshold"}
    # inert keys under either name: silent at what hf_zero does, named (as spelt) otherwise
    _, quiet = load({**MB, "zero_optimization": {"gather_16bit_weights_on_model_save": True}})
    assert quiet == []
    _, said = load({**MB, "zero_optimization": {"gather_16bit_weights_on_model_save": False}})
    assert said == ["hf_zero accepts but ignores these DeepSpeed keys: zero_optimization.gather_16bit_weights_on_model_save"]


@pytest.mark.parametrize("alias, name", sorted(ZERO.aliases.items()))
def test_two_spellings_of_one_key_are_refused(alias: str, name: str) -> None:
    value = 1 if "threshold" in name or "size" in name or "parameters" in name or "distance" in name else False
    msg = refusal({**MB, "zero_optimization": {name: value, alias: value}})
    assert msg.startswith(f"zero_optimization.{alias}: given together with {name}, "), msg
    assert msg.endswith("keep only the newer one" if alias in ZERO.older else "keep one")


def test_bfloat16_and_the_old_boolean_zero_section() -> None:
    assert refusal({**MB, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}) == (
        "bfloat16: given together with bf16, its newer name; keep only the newer one")
    cfg, _ = load({**MB, "bfloat16": {"enabled": "auto"}})
    assert cfg.auto_keys == {"bfloat16.enabled"}
    assert load({**MB, "zero_optimization": True})[0].zero_optimization.stage == 1  # DeepSpeed's oldest form
    assert load({**MB, "zero_optimization": False})[0].zero_optimization.stage == 0


# ---------------------------------------------------------------- typos against keys of other tools

TYPOS = [
    ({"zero_optimisation": {"stage": 2}}, "zero_optimisation: unknown key; did you mean 'zero_optimization'?"),
    ({"Zero-Optimization": {"stage": 2}}, "Zero-Optimization: unknown key; did you mean 'zero_optimization'?"),
    ({"Train_Micro_Batch_Size_Per_GPU": 2}, "did you mean 'train_micro_batch_size_per_gpu'?"),
    ({"gradient_acumulation_step": 2}, "did you mean 'gradient_accumulation_steps'?"),
    ({"zero_optimization": {"stage3_prefetch_bucket_sise": 1}},
     "zero_optimization.stage3_prefetch_bucket_sise: unknown key; did you mean 'stage3_prefetch_bucket_size'?"),
    ({"zero_optimization": {"prefetch_bucket_sizes": 1}}, "did you mean 'prefetch_bucket_size'?"),
    ({"zero_optimization": {"stgae": 3}}, "zero_optimization.stgae: unknown key; did you mean 'stage'?"),
    ({"zero_optimization": {"offload_param": {"pin_memmory": True}}},
     "zero_optimization.offload_param.pin_memmory: unknown key; did you mean 'pin_memory'?"),
    ({"fp16": {"enable": True}}, "fp16.enable: unknown key; did you mean 'enabled'?"),
    ({"tensorbord": {"enabled": True}}, "tensorbord: unknown key; did you mean 'tensorboard'?"),
    ({"pipeline": {"schedul": "gpipe"}}, "did you mean 'schedule'?"),
]
UNKNOWN = [  # real keys of other tools, or far from any DeepSpeed key: a warning, and the run goes on
    ({"comms_config": {"verbose": False}, "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor"}},
     ["comms_config", "monitor_config"]),
    ({"_comment": "supported model list: ..."}, ["_comment"]),
    ({"cuda_visible_devices": 0, "frobnicate": 1}, ["cuda_visible_devices", "frobnicate"]),
    ({"stage3_max_live_parameters": 1e9}, ["stage3_max_live_parameters (a key of zero_optimization)"]),
    ({"transformer_engine": {"enabled": True}}, ["transformer_engine"]),  # ("fp8" is hf_zero's own section now)
    # sections DeepSpeed reads key by key, ignoring the rest: hf_zero warns, as before
    ({"checkpoint": {"keep": 3}, "activation_checkpointing": {"checkpoint_every": 2}},
     ["activation_checkpointing.checkpoint_every", "checkpoint.keep"]),
    ({"optimizer": {"type": "AdamW", "params": {}, "legacy": 1}}, ["optimizer.legacy"]),
    # in a closed section, an "auto" value: DeepSpeed drops every "auto" before its model sees the key
    ({"bf16": {"enabled": True, "typo_key": "auto"}, "wandb": {"enabled": False, "nme": "auto"}},
     ["wandb.nme", "bf16.typo_key"]),
]


@pytest.mark.parametrize("given, needle", TYPOS, ids=[str(i) for i in range(len(TYPOS))])
def test_near_certain_misspellings_stop_with_did_you_mean(given: dict, needle: str) -> None:
    assert needle in refusal({**MB, **given})


@pytest.mark.parametrize("given, named", UNKNOWN, ids=[str(i) for i in range(len(UNKNOWN))])
def test_other_unknown_keys_are_named_in_a_warning(given: dict, named: list[str]) -> None:
    _, said = load({**MB, **given})
    assert said == ["hf_zero ignores these keys, which are not DeepSpeed config keys: " + ", ".join(named)]


def test_the_typo_threshold() -> None:
    known = ["comet", "comms_logger", "zero_optimization", "stage", "enabled", "bf16", "fp16"]
    assert near_miss("stgae", known) == "stage" and near_miss("stagee", known) == "stage"
    assert near_miss("stg", known) is None  # two edits on a short key could be anything
    assert near_miss("zero_optimzation", known) == "zero_optimization"
    assert near_miss("zero_optmzation", known) == "zero_optimization"  # two edits on a long key
    assert near_miss("zero_optmztion", known) is None  # three
    for real in ("comms_config", "monitor_config", "_comment", "fp8", "fp32", "disable", "aio", "tag"):
        assert near_miss(real, known) is None, real


def test_no_corpus_config_is_refused_as_a_typo() -> None:
    """The threshold, checked against the keys of real configs (all of tests/ds_configs, parsed here): only a
    config DeepSpeed 0.19.8 refuses for the same key may be refused for an unknown key."""
    for path in sorted(CONFIGS.glob("*.json")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ZeroConfig.load(str(path))
            except ConfigError as e:
                same = path.name in DEEPSPEED_REFUSES and "DeepSpeed 0.19.8 refuses unknown keys in" in str(e)
                assert same or "unknown key" not in str(e), f"{path.name}: {e}"


# ---------------------------------------------------------------- sections DeepSpeed closes

CLOSED_TYPOS = [  # an unknown key in each closed section hf_zero walks, and in the ones it takes whole
    ({"bf16": {"enabled": True, "typo_key": 1}},
     "bf16.typo_key: unknown key, and DeepSpeed 0.19.8 refuses unknown keys in bf16 too; remove it or correct its "
     "name; bf16 takes bf16_master_weights_and_grads, bf16_optimizer_states, check_grad_overflow, enabled, "
     "immediate_grad_update"),
    ({"bfloat16": {"enabled": True, "master_weights": True}}, "bfloat16.master_weights: unknown key"),
    ({"fp16": {"enabled": True, "min_loss": 1}},
     "fp16.min_loss: unknown key; did you mean 'min_loss_scale'? (DeepSpeed 0.19.8 refuses unknown keys in fp16 too)"),
    ({"fp16": {"fused_mode": True}}, "fp16.fused_mode: unknown key, and DeepSpeed 0.19.8 refuses"),  # in no DeepSpeed
    ({"zero_optimization": {"stage": 2, "stage3_prefetch": 1}},
     "zero_optimization.stage3_prefetch: unknown key; did you mean 'stage3_prefetch_bucket_size'?"),
    ({"zero_optimization": {"aio": {"block_size": 262144}}},  # transformers' NVMe page puts it there
     "zero_optimization.aio: unknown key (aio is a top-level key; move it there), and DeepSpeed 0.19.8 refuses"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_mem": True}}},
     "zero_optimization.offload_param.pin_mem: unknown key; did you mean 'pin_memory'?"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "typo": 1}}},
     "zero_optimization.offload_optimizer.typo: unknown key, and DeepSpeed 0.19.8 refuses unknown keys in "
     "zero_optimization.offload_optimizer too"),
    ({"zero_optimization": {"zenflow": {"topk": 0.1}}}, "zero_optimization.zenflow.topk: unknown key; did you mean 'topk_ratio'?"),
    ({"zero_optimization": {"leaf_module": {"class": ["MoE"]}}},
     "zero_optimization.leaf_module.class: unknown key; did you mean 'classes'?"),
    ({"compile": {"enabled": True, "mode": "max-autotune"}}, "compile.mode: unknown key, and DeepSpeed 0.19.8 refuses"),
    ({"tensor_parallel": {"autotp": 2}}, "tensor_parallel.autotp: unknown key; did you mean 'autotp_size'?"),
    ({"fp8": {"enabled": True, "recipee": "rowwise"}}, "fp8.recipee: unknown key; did you mean 'recipe'? (hf_zero's own"),
    ({"tensor_parallel": {"tp": {"tpsize": 2}}}, "tensor_parallel.tp.tpsize: unknown key; did you mean 'tp_size'?"),
    ({"tensorboard": {"enabled": False, "output": "tb"}}, "tensorboard.output: unknown key; did you mean 'output_path'?"),
    ({"wandb": {"enabled": False, "name": "x"}}, "wandb.name: unknown key, and DeepSpeed 0.19.8 refuses unknown keys in "
                                                  "wandb too; remove it or correct its name; wandb takes enabled, group, "
                                                  "project, team"),
    ({"csv_monitor": {"enabled": False, "path": "x"}}, "csv_monitor.path: unknown key"),
    ({"comet": {"enabled": False, "experiment": "x"}}, "comet.experiment: unknown key"),
    ({"comms_logger": {"enabled": False, "prof": True}}, "comms_logger.prof: unknown key"),
    ({"hybrid_engine": {"enabled": False, "max_out_token": 3}},
     "hybrid_engine.max_out_token: unknown key; did you mean 'max_out_tokens'?"),
    ({"timers": {"throughput": {"enabled": True, "sync": True}}}, "timers.throughput.sync: unknown key"),
    ({"weight_quantization": {"bits": 8}}, "weight_quantization.bits: unknown key; did you mean 'num_bits'?"),
]


@pytest.mark.parametrize("given, needle", CLOSED_TYPOS, ids=[next(iter(g)) + str(i) for i, (g, _) in enumerate(CLOSED_TYPOS)])
def test_an_unknown_key_in_a_closed_section_is_refused(given: dict, needle: str) -> None:
    assert needle in refusal({**MB, **given})


def test_every_closed_section_has_a_typo_case() -> None:
    closed = {path for path, section in SECTIONS.items() if section.closed} | set(CLOSED_WHOLE)
    cased = set()
    for _given, needle in CLOSED_TYPOS:
        path = needle.split(":")[0].rpartition(".")[0]
        cased.add({"bfloat16": "bf16", "tensor_parallel.tp": "tensor_parallel.tensor_parallel"}.get(path, path))
    assert closed <= cased, closed - cased


def test_hf_zeros_own_keys_in_closed_sections_stay_accepted() -> None:
    """DeepSpeed 0.19.8 refuses these (its compile section is DeepCompile's); they are hf_zero's, and act."""
    cfg, said = load({**MB, "zero_optimization": {"stage": 2, "overlap_param_gather": True},
                      "compile": {"enabled": True, "backend": "eager", "kwargs": {"dynamic": False}},
                      "checkpoint": {"keep_last": 2}, "activation_checkpointing": {"checkpoint_blocks": True},
                      "pipeline": {"schedule": "gpipe"}, "seed": 3, "nonfinite_loss": "stop"})
    assert said == []
    assert cfg.zero_optimization.overlap_param_gather and cfg.compile.enabled and cfg.compile.backend == "eager"
    assert cfg.checkpoint_keep_last == 2 and cfg.activation_checkpointing["checkpoint_blocks"]


def test_the_did_you_mean_of_closed_sections() -> None:
    names = ["min_loss_scale", "loss_scale", "initial_scale_power", "enabled", "stage", "stage3_prefetch_bucket_size"]
    assert suggest("enable", names) == "enabled"  # near_miss's own
    assert suggest("min_loss", names) == "min_loss_scale"  # shortened
    assert suggest("scale", names) is None  # in three names: no guess
    assert suggest("typo_key", names) is None and suggest("pin", ["pin_memory"]) is None  # too short to guess from


# ---------------------------------------------------------------- what older DeepSpeed accepted

LEGACY = "hf_zero accepts these keys, which older DeepSpeed accepted but DeepSpeed 0.19.8 refuses: "


@pytest.mark.parametrize("given, named", [
    ({"fp16": {"enabled": True, "min_loss_scale": 1e-10}}, "fp16.min_loss_scale (1e-10: an integer since DeepSpeed 0.17.1)"),
    ({"fp16": {"enabled": False, "min_loss_scale": 0.5}}, "fp16.min_loss_scale (0.5: an integer since DeepSpeed 0.17.1)"),
    ({"curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 8}},
     "curriculum_learning (the legacy section, removed from DeepSpeed, which reads "
     "data_efficiency.data_sampling.curriculum_learning instead)"),
    ({"compile": {"disable": False, "backend": "inductor"}},  # axolotl's torch_compile configs
     "compile.disable (not a field of its compile section; DeepSpeed 0.14.4-0.16.5 read no compile section at all)"),
    ({"amp": {"enabled": "auto", "opt_level": "auto"}}, "amp (Apex AMP, removed from DeepSpeed)"),
    ({"zero_optimization": {"mics_shard_size": -1}}, "zero_optimization.mics_shard_size (MiCS, removed from DeepSpeed; hf_zero runs it as "
     "hybrid sharding)"),
])
def test_what_older_deepspeed_accepted_is_accepted_and_named(given: dict, named: str) -> None:
    cfg, said = load({**MB, **given})
    assert said == [LEGACY + named]
    if "fp16" in given:
        assert cfg.fp16.min_loss_scale == given["fp16"]["min_loss_scale"]  # the scaler's floor, as older DeepSpeed


@pytest.mark.parametrize("given, sentence", [
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}},
     "curriculum_learning.enabled: got True, but the legacy curriculum learning (DeepSpeed passed a growing "
     "curriculum_seqlen to the model's forward) is not supported, and DeepSpeed 0.19.8 has removed it too; remove the section"),
    ({"nebula": {"enabled": True}}, "nebula.enabled: got True, but Nebula checkpointing is not supported"),
    ({"graph_harvesting": True}, "graph_harvesting: got True, but graph harvesting is not supported"),
    ({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}}, "zero_optimization.zeropp_loco_param: got"),
])
def test_a_removed_feature_asked_for_is_refused(given: dict, sentence: str) -> None:
    assert sentence in refusal({**MB, **given})


def test_fp16_scaling_knobs_are_checked_where_dynamic_scaling_reads_them() -> None:
    """DeepSpeed 0.19.8 checks loss_scale_window > 0 and min_loss_scale > 0 only under dynamic scaling."""
    for off in ({"enabled": False}, {"enabled": True, "loss_scale": 128}):
        cfg, said = load({**MB, "fp16": {**off, "loss_scale_window": 0, "min_loss_scale": 0}})
        assert said == [] and cfg.fp16.loss_scale_window == 0
    assert "fp16.min_loss_scale: got 0, expected a positive number" in refusal(
        {**MB, "fp16": {"enabled": True, "min_loss_scale": 0}})


# ---------------------------------------------------------------- inert keys, warned once


INERT_ASKING = [  # issue 16: ZeRO fields nothing in hf_zero reads, given values that ask for something
    ("zero_optimization", "overlap_comm", False, True),
    ("zero_optimization", "contiguous_gradients", False, True),
    ("zero_optimization", "reduce_scatter", False, True),
    ("zero_optimization", "allgather_partitions", False, True),
    ("zero_optimization", "allgather_bucket_size", 2e8, 5e8),
    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save", False, True),
    ("zero_optimization", "compute_grad_norm", False, True),
    ("bf16", "check_grad_overflow", False, True),
    ("", "prescale_gradients", True, False),
    ("", "gradient_predivide_factor", 2.0, 1.0),
    ("", "zero_allow_untested_optimizer", False, True),
    ("", "log_level", "info", None),
    ("", "datastates_ckpt", {"host_cache_size": 16}, False),
]


@pytest.mark.parametrize("section, key, asking, quiet", INERT_ASKING, ids=[k for _, k, _, _ in INERT_ASKING])
def test_inert_keys_are_named_when_they_ask_for_something(section: str, key: str, asking, quiet) -> None:
    def config(value):
        return {**MB, key: value} if not section else {**MB, section: {key: value}}

    path = f"{section}.{key}" if section else key
    assert load(config(asking))[1] == [f"hf_zero accepts but ignores these DeepSpeed keys: {path}"]
    if quiet is not None:
        assert load(config(quiet))[1] == []


def test_each_key_is_named_once_per_process() -> None:
    first = {**MB, "dump_state": True, "comms_config": {}, "zero_optimization": {"overlap_comm": False}}
    assert load(first)[1] == [
        "hf_zero accepts but ignores these DeepSpeed keys: dump_state, zero_optimization.overlap_comm",
        "hf_zero ignores these keys, which are not DeepSpeed config keys: comms_config",
    ]
    assert load(first)[1] == []  # the engine parsing the config the Trainer already parsed: silent
    second = {**first, "memory_breakdown": True, "monitor_config": {}}
    assert load(second)[1] == ["hf_zero accepts but ignores these DeepSpeed keys: memory_breakdown",
                               "hf_zero ignores these keys, which are not DeepSpeed config keys: monitor_config"]


def test_a_refused_config_warns_nothing_and_its_fix_warns_once() -> None:
    """LLaMA-Factory's fp8 config (the issue's "comms_config: unknown key"): with parameter offload to NVMe added
    but no nvme_path it is refused without a warning; as shipped (optimizer offload only) it loads, each ignored key
    named once."""
    given = json.loads((CONFIGS / "llamafactory_ds_z3_fp8_config.json").read_text())
    with_params = {**given, "zero_optimization": {**given["zero_optimization"], "offload_param": {"device": "nvme"}}}
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ConfigError, match=r'"device": "nvme" needs a folder'):
        warnings.simplefilter("always")
        ZeroConfig.load(with_params)
    assert caught == []
    cfg, said = load(given)
    assert said == ["hf_zero accepts but ignores these DeepSpeed keys: zero_optimization.overlap_comm",
                    "hf_zero ignores these keys, which are not DeepSpeed config keys: comms_config, monitor_config"]
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.offload_optimizer.pin_memory is False


def test_every_config_field_is_read_outside_the_parser() -> None:
    """A dataclass field nothing reads is dead: it belongs in an inert table (issue 16)."""
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py")
                       if p.relative_to(PACKAGE).as_posix() not in ("config/parse.py", "config/refusals.py", "config/sections.py",
                                                                     "config/schema.py"))
    # pipeline_read / pipeline_write (what the NVMe step always does), fast_init and buffer_size (named as ignored
    # when given) configure nothing that runs
    waiting = {"buffer_size", "pipeline_read", "pipeline_write", "fast_init"}
    classes = [c for c in vars(config_sections).values() if dataclasses.is_dataclass(c)] + [ZeroConfig]
    unread = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
              if f.name not in waiting and not re.search(rf"\.{f.name}\b", source)]
    assert not unread, f"fields nothing reads: {unread}"


# ---------------------------------------------------------------- offload and sequence parallelism


def test_offload_sections_parse_in_full_with_deepspeeds_defaults() -> None:
    given = {"device": "none", "nvme_path": "/nvme", "buffer_count": 6, "pin_memory": False, "ratio": 0.5,
             "pipeline_read": True, "fast_init": True}
    cfg, said = load({**MB, "zero_optimization": {"stage": 3, "offload_optimizer": given, "offload_param": {"device": "None"}}})
    assert said == []
    assert cfg.zero_optimization.offload_optimizer == OffloadOptimizerConfig(
        device="none", nvme_path="/nvme", buffer_count=6, pin_memory=False, ratio=0.5, pipeline_read=True, fast_init=True)
    assert cfg.zero_optimization.offload_param == OffloadParamConfig()  # DeepSpeed's: 5 buffers of 1e8, pinned
    assert (OffloadParamConfig().buffer_count, OffloadParamConfig().max_in_cpu, OffloadOptimizerConfig().buffer_count) == (
        5, 1_000_000_000, 4)
    assert "offload_optimizer.ratio: got 1.5, expected a number from 0 to 1" in refusal(
        {**MB, "zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})
    assert "offload_param.device: got 'disk', expected one of none, cpu, nvme" in refusal(
        {**MB, "zero_optimization": {"offload_param": {"device": "disk"}}})


@pytest.mark.parametrize("given, sentence", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     'zero_optimization.offload_optimizer.nvme_path: "device": "nvme" needs a folder'),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
     'zero_optimization.offload_param.device: "nvme" without offload_optimizer is not supported yet'),
])
def test_offload_is_refused_in_one_sentence(given: dict, sentence: str) -> None:
    """What of offload does not run is refused (optimizer offload to the CPU runs: tests/test_offload.py).
    (Sequence parallelism, refused here until it landed, is tests/test_sequence_parallel.py's.)"""
    assert sentence in refusal({**MB, **given})


def test_deepspeeds_deprecated_cpu_offload_is_read_as_deepspeed_reads_it() -> None:
    """``"cpu_offload": true`` (DeepSpeed's ZeRO-Offload tutorial spelling, still accepted by 0.19.8 with a
    deprecation warning) is optimizer offload to the CPU; false is none; beside offload_optimizer it is refused."""
    cfg, said = load({**MB, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer == OffloadOptimizerConfig(device="cpu")
    assert len(said) == 1 and 'zero_optimization.cpu_offload: true is DeepSpeed\'s deprecated spelling' in said[0]
    cfg, said = load({**MB, "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer is None and said == []
    assert "cpu_offload: given together with offload_optimizer" in refusal(
        {**MB, "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert "offload needs ZeRO stage 1, 2 or 3" in refusal({**MB, "zero_optimization": {"cpu_offload": True}})


def test_what_asks_for_nothing_is_accepted() -> None:
    cfg, said = load({**MB, "sequence_parallel_size": 1, "sequence_parallel": {}, "data_parallel_size": None,
                      "zero_optimization": {"cpu_offload": False, "offload_param": None}})
    assert said == [] and cfg.sequence_parallel_size == 1 and cfg.zero_optimization.offload_param is None
    assert "managed_gradient_accumulation: got False" in refusal({**MB, "managed_gradient_accumulation": False})


def test_classify_names_what_happens_to_a_key() -> None:
    assert classify("zero_optimization.prefetch_bucket_size") == classify("zero_optimization.stage3_prefetch_bucket_size")
    assert classify("zero_optimization.stage3_prefetch_bucket_size") == "acted"
    assert classify("zero_optimization.offload_param.nvme_path") == "acted"
    assert classify("optimizer.params.betas") == "acted"  # free-form: optim.py checks the params
    assert classify("tensorboard.output_path") == "inert" and classify("timers.throughput.enabled") == "inert"
    assert classify("bfloat16.enabled") == "acted" and classify("zero_optimization.overlap_comm") == "inert"
    assert classify("zero_optimization.zenflow.topk_ratio") == "acted" and classify("amp.opt_level") == "refused"
    assert classify("comms_config") is None and classify("zero_optimization.aio") is None
    assert all(path == "" or classify(path) == "acted" for path in SECTIONS)


def test_zero_and_one_are_booleans_as_deepspeed_reads_them() -> None:
    """DeepSpeed reads 0 and 1 as false and true (pydantic's lax bool in its sections, truthiness at the top level;
    its own tests write ``"zero_allow_untested_optimizer": 1``); a string or another number stays refused."""
    cfg, said = load({**MB, "zero_allow_untested_optimizer": 1, "bf16": {"enabled": 1}, "wall_clock_breakdown": 0})
    assert cfg.bf16.enabled is True and cfg.wall_clock_breakdown is False and said == []
    assert "bf16.enabled: got 'true', expected true or false" in refusal({**MB, "bf16": {"enabled": "true"}})
    assert "zero_allow_untested_optimizer: got 2, expected true or false" in refusal(
        {**MB, "zero_allow_untested_optimizer": 2})


# ---------------------------------------------------------------- zero_optimization.zenflow

ZF_BASE = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def _zf(zenflow: object, **zero: object) -> dict:
    return {**MB, "zero_optimization": {**ZF_BASE, **zero, "zenflow": zenflow}}


def test_zenflow_parses_every_key_with_deepspeeds_defaults() -> None:
    cfg, said = load(_zf({}))
    assert said == []
    assert cfg.zero_optimization.zenflow == config_sections.ZenFlowConfig(
        topk_ratio=0.1, select_strategy="auto", select_interval="auto", update_interval="auto", overlap_step=False,
        offload=False, auto_ratio=0.99, full_warm_up_rounds=0, pt_reserved_cores_perc=0.5, steps_per_epoch=None)
    given = {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8, "update_interval": 4,
             "overlap_step": True, "offload": True, "auto_ratio": 0.5, "full_warm_up_rounds": 3,
             "pt_reserved_cores_perc": 0.25, "steps_per_epoch": 100}
    cfg, _ = load(_zf(given))
    assert dataclasses.asdict(cfg.zero_optimization.zenflow) == given
    assert load(_zf(None))[0].zero_optimization.zenflow is None  # null: off, as DeepSpeed leaves it


@pytest.mark.parametrize("zenflow, needle", [
    ({"topk_ratio": 1.0}, "zero_optimization.zenflow.topk_ratio: got 1.0, expected a number greater than 0 and less than 1"),
    ({"topk_ratio": 0}, "zero_optimization.zenflow.topk_ratio: got 0, expected a number greater than 0"),
    ({"update_interval": 0}, "zero_optimization.zenflow.update_interval: got 0, expected \"auto\" or a whole number of steps, at least 1"),
    ({"update_interval": "often"}, "zero_optimization.zenflow.update_interval: got 'often', expected \"auto\""),
    ({"select_strategy": "batch"}, "zero_optimization.zenflow.select_strategy: got 'batch', expected one of auto, step, epoch"),
    ({"select_interval": 4}, "zero_optimization.zenflow.select_interval: got 4 with select_strategy \"auto\""),
    ({"select_strategy": "epoch"}, "zero_optimization.zenflow.select_interval: got \"auto\" with select_strategy 'epoch'"),
    ({"select_strategy": "step", "select_interval": 2, "update_interval": 4},
     "zero_optimization.zenflow.select_interval: got 2, less than update_interval 4"),
    ({"auto_ratio": 1.5}, "zero_optimization.zenflow.auto_ratio: got 1.5, expected a number from 0 to 1"),
    ({"full_warm_up_rounds": -1}, "zero_optimization.zenflow.full_warm_up_rounds: got -1, expected an integer >= 0"),
    ({"overlap_step": "yes"}, "zero_optimization.zenflow.overlap_step: got 'yes', expected true or false"),
    ({"topk": 0.1}, "zero_optimization.zenflow.topk: unknown key; did you mean 'topk_ratio'?"),
])
def test_a_bad_zenflow_value_is_one_sentence_naming_its_path(zenflow: dict, needle: str) -> None:
    assert needle in refusal(_zf(zenflow))


@pytest.mark.parametrize("config, needle", [
    (_zf({}, stage=3), "ZenFlow runs at ZeRO stages 1-2 (DeepSpeed 0.19.8's stage-3 ZenFlow is not built here yet), and the stage is 3; set zero_optimization.stage to 2"),
    ({**MB, "zero_optimization": {"stage": 2, "zenflow": {}}}, 'and the config has no offload_optimizer; set "offload_optimizer": {"device": "cpu"}'),
    (_zf({}, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}), 'offload_optimizer.device "nvme"'),
    (_zf({}, offload_optimizer={"device": "cpu", "super_offload": True}), "beside zero_optimization.offload_optimizer.super_offload"),
    (_zf({}, offload_optimizer={"device": "cpu", "ratio": 0.5}), "beside zero_optimization.offload_optimizer.ratio"),
    (_zf({}, overlap_param_gather=True), "beside zero_optimization.overlap_param_gather"),
    ({**_zf({}), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type is 'SGD'; use \"Adam\" or \"AdamW\""),
    ({**_zf({}), "optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad is true"),
    ({**_zf({}), "tensor_parallel": {"autotp_size": 2}}, "ZenFlow with tensor_parallel.autotp_size above 1 is not supported yet"),
])
def test_zenflow_outside_the_offloaded_stages_1_2_is_refused_saying_what_to_do(config: dict, needle: str) -> None:
    assert needle in refusal(config)


def test_zenflow_keys_that_change_nothing_here_are_named() -> None:
    _, said = load(_zf({"pt_reserved_cores_perc": 0.3, "select_strategy": "step", "select_interval": 4,
                        "update_interval": 2, "steps_per_epoch": 10}))
    assert any("zero_optimization.zenflow.pt_reserved_cores_perc" in s and "zero_optimization.zenflow.steps_per_epoch" in s
               for s in said), said
