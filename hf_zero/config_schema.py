"""The tables ZeroConfig validates against, and the one-sentence checks it uses.

Kept apart from config.py so the list of what hf_zero accepts, ignores and rejects can be read
(and updated) in one place.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A config key, type or value that hf_zero cannot run with."""


# Top-level keys: acted on, or accepted and named in the "ignored" warning (INERT).
ACTIVE = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "steps_per_print", "seed", "activation_checkpointing",
    "amp", "sparse_gradients",
}
INERT = {
    "wall_clock_breakdown", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "memory_breakdown", "dump_state", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "checkpoint", "aio", "elasticity", "autotuning", "data_efficiency", "compression_training",
    "dataloader_drop_last", "timers", "monitor_config", "torch_autocast", "disable_allgather",
    "data_types", "graph_harvesting", "use_node_local_storage", "load_universal_checkpoint",
}
TOP_LEVEL = ACTIVE | INERT

# zero_optimization keys: "active" ones map onto ZeroOptimizationConfig fields; "inert" are
# DeepSpeed tuning knobs this engine has no use for; offload_* are checked separately.
ZERO_KEYS: dict[str, str] = {
    **{k: "active" for k in (
        "stage", "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
    )},
    **{k: "inert" for k in (
        "round_robin_gradients", "sub_group_size", "ignore_unused_parameters", "load_from_fp32_weights",
        "elastic_checkpoint", "legacy_stage1", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
        "cpu_offload", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
        "mics_shard_size", "mics_hierarchical_params_gather", "stage3_model_persistence_threshold",
        "log_trace_cache_warnings", "pipeline_loading_checkpoint", "override_module_apply",
    )},
    "offload_optimizer": "offload",
    "offload_param": "offload",
}

# Where transformers' DeepSpeed integration lets a user write "auto".
AUTO_OK = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


def unknown_key(key: str, allowed: Iterable[str], prefix: str = "") -> str:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        return f"{prefix}{key}: unknown key; did you mean '{close[0]}'?"
    shown = ", ".join(allowed[:12]) + (", ..." if len(allowed) > 12 else "")
    return f"{prefix}{key}: unknown key; expected one of {shown}"


def check_bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{path}: got {v!r}, expected true or false")
    return v


def check_int(path: str, v: Any, minimum: int = 0) -> int:
    """Integers; integral floats are accepted because DeepSpeed configs write bucket sizes as 5e8."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{path}: got {v!r}, expected an integer >= {minimum}")
    if v < minimum:
        raise ConfigError(f"{path}: got {v!r}, expected {'a positive integer' if minimum == 1 else f'an integer >= {minimum}'}")
    return int(v)


def check_number(path: str, v: Any, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}: got {v!r}, expected a number")
    if v < 0 or (positive and v == 0):
        raise ConfigError(f"{path}: got {v!r}, expected a {'positive' if positive else 'non-negative'} number")
    return float(v)


def check_choice(path: str, v: Any, choices: tuple) -> Any:
    if isinstance(v, bool) or v not in choices:
        raise ConfigError(f"{path}: got {v!r}, expected one of {', '.join(str(c) for c in choices)}")
    return v
