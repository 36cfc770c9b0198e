"""What a DeepSpeed config may hold, as tables and small value checks, for ``hf_zero.config``.

Every key a DeepSpeed user can write falls in one of three groups, and each group is a
table here so that a reader can answer "what happens to my key?" without reading the parser:

- keys hf_zero acts on (``*_KEYS``): parsed into the typed dataclasses of ``config.py``;
- keys it accepts and ignores (``*_INERT``): each maps to the value that asks for nothing
  (DeepSpeed's default). Given that value the key is silent; any other value is named in the
  one "accepts but ignores" warning, because the user asked for something that will not happen;
- keys naming features it does not have (``*_UNSUPPORTED``): given a value that asks for the
  feature, loading stops with an error. Silently training without, say, offload or Apex AMP
  would produce a run that differs from the one the user configured.

A section marked ``SWITCH`` is a dict with an ``enabled`` flag and asks for its feature only
when ``enabled`` is true; one marked ``SECTION`` asks as soon as it holds anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be run: one sentence with the JSON path, the value and what is allowed."""


AUTO = "auto"
SWITCH = "<a section with an 'enabled' flag>"
SECTION = "<a section>"

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD")
# DeepSpeed's own optimizers: named so the error says "not supported yet" rather than "unknown".
DEEPSPEED_ONLY_OPTIMIZERS = (
    "Adagrad", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "Lion", "Muon",
)
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
DEEPSPEED_ONLY_SCHEDULERS = ("LRRangeTest", "OneCycle")
COMMUNICATION_DTYPES = ("fp32", "fp16", "bf16")
# "skip" (the default): the step is skipped and counted in skipped_steps, as fp16 overflows are;
# "stop": the run raises; "off": no check (DeepSpeed's behaviour, and no host sync per step).
NONFINITE_LOSS = ("skip", "stop", "off")

# ---------------------------------------------------------------- top level

TOP_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "steps_per_print", "seed", "activation_checkpointing",
    "checkpoint",  # DeepSpeed's section; hf_zero acts on its own key "keep_last" there (CHECKPOINT_KEYS)
    "nonfinite_loss",  # hf_zero's: what a bf16/fp32 step with an inf/nan loss or gradient does (NONFINITE_LOSS)
    "pipeline",  # read when the model is a PipelineModule (PIPELINE_KEYS)
    "compile",  # torch.compile of each block (COMPILE_KEYS)
    "sequence_parallel_size",  # DeepSpeed's (ALST): Ulysses sequence-parallel degree (hf_zero/sequence/config.py)
    "sequence_parallel",  # hf_zero's tiling switches; LLaMA-Factory's keys of the same section are read too
)
BF16_ALIAS = "bfloat16"  # DeepSpeed's older name for the bf16 section

TOP_INERT: dict[str, Any] = {
    "wall_clock_breakdown": False, "memory_breakdown": False, "dump_state": False,
    "zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True, "disable_allgather": False,
    "dataloader_drop_last": False, "graph_harvesting": False, "vocabulary_size": None,
    "use_data_before_expert_parallelism": False, "seq_parallel_comm_data_type": "fp32",
    "flops_profiler": SWITCH, "tensorboard": SWITCH, "wandb": SWITCH, "csv_monitor": SWITCH, "comet": SWITCH,
    "comms_logger": SWITCH, "autotuning": SWITCH, "nebula": SWITCH, "datastates": SWITCH,
    "timers": SECTION, "aio": SECTION, "data_types": SECTION,
}

TOP_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "amp": (SWITCH, 'Apex AMP is not supported; use "bf16": {"enabled": true} or "fp16" instead'),
    "sparse_gradients": (False, "sparse gradients are not supported; set it to false or remove it"),
    "gradient_allreduce_op": ("mean", 'hf_zero always averages gradients; use "mean" or remove the key'),
    "elasticity": (SWITCH, "elastic training is not supported yet; remove the section"),
    "progressive_layer_drop": (SWITCH, "progressive layer drop is not supported; remove the section"),
    "curriculum_learning": (SWITCH, "curriculum learning is not supported; remove the section"),
    "data_efficiency": (SWITCH, "DeepSpeed data efficiency is not supported; remove the section"),
    "hybrid_engine": (SWITCH, "the hybrid (RLHF) engine is not supported; remove the section"),
    "torch_autocast": (SWITCH, "torch_autocast is not supported; use bf16 or fp16 instead"),
    "eigenvalue": (SWITCH, "eigenvalue computation is not supported; remove the section"),
    "quantize_training": (SWITCH, "quantized training is not supported; remove the section"),
    "sparse_attention": (SECTION, "sparse attention is not supported; remove the section"),
    "compression_training": (SECTION, "compression training is not supported; remove the section"),
    "weight_quantization": (SECTION, "weight quantization is not supported; remove the section"),
    "tensor_parallel": (SECTION, "tensor parallelism is not supported yet; remove the section"),
    "expert_parallel": (SECTION, "expert parallelism is not supported yet; remove the section"),
}
TOP_AUTO = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"})
SWITCHES_ACCEPTING_AUTO = frozenset({"amp"})  # transformers fills amp.enabled from TrainingArguments

# ---------------------------------------------------------------- precision

FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale")
FP16_INERT: dict[str, Any] = {"auto_cast": False, "fused_mode": True}
FP16_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "fp16_master_weights_and_grads": (False, "fp16 master weights are not supported; masters are fp32"),
}
BF16_KEYS = ("enabled",)
BF16_INERT: dict[str, Any] = {"immediate_grad_update": False, "check_grad_overflow": False}
BF16_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "bf16_master_weights_and_grads": (False, "bf16 master weights are not supported; masters are fp32"),
    "bf16_optimizer_states": (False, "bf16 optimizer states are not supported; they are fp32"),
}

# ---------------------------------------------------------------- zero_optimization

ZERO_KEYS = (
    "stage", "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "offload_optimizer", "offload_param",
)
GATHER_16BIT_ALIAS = "stage3_gather_fp16_weights_on_model_save"
ZERO_AUTO = frozenset({
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save", GATHER_16BIT_ALIAS,
})
ZERO_INERT: dict[str, Any] = {
    "load_from_fp32_weights": True, "elastic_checkpoint": False, "sub_group_size": 1_000_000_000,
    "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
    "use_multi_rank_bucket_allreduce": True, "stage3_model_persistence_threshold": None,
    "stage3_module_granularity_threshold": 0, "stage3_use_all_reduce_for_fetch_params": False,
    "stage3_allgather_sequential": False, "stage3_partition_stream_chunk_size": 0,
    "memory_efficient_linear": True, "override_module_apply": True, "pipeline_loading_checkpoint": False,
    "log_trace_cache_warnings": False, "enable_sanity_checks": False, "mics_hierarchical_params_gather": False,
    "save_muon_momentum_buffer_in_memory": False, "cpu_offload_use_pin_memory": None, "leaf_module": SECTION,
    "zeropp_loco_param": None,
}
ZERO_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "cpu_offload": (False, "offload is not supported yet; remove the key"),
    "cpu_offload_param": (False, "offload is not supported yet; remove the key"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weights are not supported yet"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized weights are not supported yet"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients are not supported yet"),
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning is not supported yet"),
    "mics_shard_size": (-1, "MiCS sharding is not supported yet"),
    "zenflow": (SECTION, "ZenFlow is not supported yet; remove the section"),
}

# ---------------------------------------------------------------- checkpoint

CHECKPOINT_KEYS = (
    "keep_last",  # hf_zero's: save_checkpoint keeps the N newest checkpoints of its folder (null: all)
)
CHECKPOINT_INERT: dict[str, Any] = {
    "tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False, "parallel_write": SECTION,
    "writer": SECTION,
}

# ---------------------------------------------------------------- compile

COMPILE_KEYS = (
    "enabled", "backend",
    "kwargs",  # torch.compile's keyword arguments (COMPILE_KWARGS)
)
COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "options")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# DeepSpeed's DeepCompile (its own graph passes) is another engine; its tuning keys mean nothing here
COMPILE_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "deepcompile": (False, 'DeepSpeed\'s DeepCompile is not supported; use "compile": {"enabled": true} (torch.compile of each block)'),
}
COMPILE_INERT: dict[str, Any] = {
    "free_activation": False, "offload_activation": False, "offload_opt_states": False, "double_buffer": True,
    "symmetric_memory": False, "debug_log": False, "offload_parameters": False, "sync_before_reduce": False,
    "sync_after_reduce": False, "sync_before_allgather": False, "sync_after_allgather": False,
    "keep_int_input_tensors": True, "keep_all_input_tensors": False,
}

# ---------------------------------------------------------------- optimizer, scheduler, activation checkpointing

OPTIMIZER_KEYS = ("type", "params")
OPTIMIZER_INERT: dict[str, Any] = {"legacy_fusion": False}
SCHEDULER_KEYS = ("type", "params")
ACTIVATION_CHECKPOINTING_KEYS = (
    "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing", "number_checkpoints",
    "synchronize_checkpoint_boundary", "profile",
    "checkpoint_blocks",  # hf_zero's: recompute every block (unit) in backward instead of storing activations
)


# ---------------------------------------------------------------- pipeline (used with a PipelineModule)

PIPELINE_KEYS = (
    "stages", "activation_checkpoint_interval",
    "schedule",  # hf_zero's: "1f1b" (DeepSpeed's, the default) or "gpipe"
)
PIPELINE_AUTO = frozenset({"stages"})
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
PIPELINE_INERT: dict[str, Any] = {
    "partition": "best", "seed_layers": False, "pipe_partitioned": True, "grad_partitioned": True,
    "use_reentrant": True,
}

# ---------------------------------------------------------------- value checks


def show(value: Any) -> str:
    """A value for a message: its Python repr (as optim.py's messages write it), shortened if long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def json_kind(value: Any) -> str:
    """The JSON name of a value's type, for messages about the wrong kind of thing."""
    for types, name in ((bool, "boolean"), (dict, "object"), ((list, tuple), "array"), (str, "string"),
                        ((int, float), "number"), (type(None), "null")):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Bool:
    """A real JSON boolean: ``1`` and ``"true"`` are refused, since a typo there flips a feature silently."""

    what: str = "true or false"

    def __call__(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return value


@dataclass(frozen=True)
class Int:
    """An integer >= ``minimum``; integral floats such as ``5e8`` pass, as DeepSpeed configs write them."""

    minimum: int = 0

    @property
    def what(self) -> str:
        return "a positive integer" if self.minimum == 1 else f"an integer >= {self.minimum}"

    def __call__(self, value: Any, path: str) -> int:
        if not _is_number(value) or not float(value).is_integer() or value < self.minimum:
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return int(value)


@dataclass(frozen=True)
class Number:
    """A finite number >= ``minimum`` (or > it when ``strict``)."""

    minimum: float = 0.0
    strict: bool = False

    @property
    def what(self) -> str:
        if self.minimum == 0:
            return "a positive number" if self.strict else "a non-negative number"
        return f"a number {'>' if self.strict else '>='} {self.minimum:g}"

    def __call__(self, value: Any, path: str) -> float:
        if not _is_number(value) or value < self.minimum or (self.strict and value == self.minimum):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return float(value)


@dataclass(frozen=True)
class OneOf:
    """One of a fixed list; strings match case-insensitively and come back in the canonical spelling."""

    options: tuple

    @property
    def what(self) -> str:
        return "one of " + ", ".join(str(o) for o in self.options)

    def __call__(self, value: Any, path: str) -> Any:
        for option in self.options:
            if isinstance(option, str) and isinstance(value, str) and option.lower() == value.lower():
                return option
            if not isinstance(option, str) and _is_number(value) and value == option:
                return option
        raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")


def asks_for(value: Any, quiet: Any) -> bool:
    """Does ``value`` ask for a feature, given the value (or section kind) that asks for nothing?"""
    if quiet is SWITCH:
        return isinstance(value, dict) and value.get("enabled") is True
    if quiet is SECTION:
        return value is not None and value != {}
    if quiet is None:
        return value is not None
    if isinstance(quiet, str) and isinstance(value, str):
        return value.lower() != quiet.lower()
    return value != quiet


def check_quiet_type(value: Any, quiet: Any, path: str) -> None:
    """An ignored or refused key still has a type: a bool key given ``"false"`` is a mistake worth naming."""
    if quiet in (SWITCH, SECTION):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{path}: got {show(value)}, expected an object")
        if quiet is SWITCH and isinstance(value, dict) and "enabled" in value:
            if not isinstance(value["enabled"], bool) and value["enabled"] != AUTO:
                Bool()(value["enabled"], f"{path}.enabled")
    elif isinstance(quiet, bool):
        Bool()(value, path)
    elif isinstance(quiet, (int, float)):
        if not _is_number(value):
            raise ConfigError(f"{path}: got {show(value)}, expected a number")
    elif isinstance(quiet, str) and not isinstance(value, str):
        raise ConfigError(f"{path}: got {show(value)}, expected a string")
