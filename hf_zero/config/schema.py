"""What a DeepSpeed config may hold, section by section, as tables for ``hf_zero.config``.

Every key of every JSON object in a DeepSpeed config falls in one of three groups, and each
:class:`Section` below lists them, so that a reader can answer "what happens to my key?"
without reading the parser:

- ``keys``: hf_zero acts on them; they are parsed into the typed dataclasses of
  ``config/sections.py`` / ``config.py``;
- ``inert``: accepted and ignored. Each maps to the value that asks for nothing (in most cases
  DeepSpeed's default, or what hf_zero always does). Given that value the key is silent; any
  other value is named in the one "accepts but ignores" warning, because the user asked for
  something that will not happen;
- ``unsupported``: the key names a feature hf_zero does not have; given a value that asks for it,
  loading stops with one sentence naming the feature. Silently training without, say, Apex AMP
  would produce a run that differs from the one the user configured.

``aliases`` maps DeepSpeed's other spellings of a key (its pydantic field names and aliases,
and deprecated names) to the name used here; giving two spellings of one key is refused, as
DeepSpeed refuses it. ``auto`` names the keys that may say ``"auto"`` (the Trainer fills them).

A key in none of the groups is not a DeepSpeed key. Where DeepSpeed 0.19.8 validates the section
with a pydantic model that forbids extra keys (``closed`` sections, and the whole sections in
:data:`CLOSED_WHOLE`), it is an error, with "did you mean" where a known key is close, as
DeepSpeed refuses it too (``extra_forbidden``). Elsewhere (the top level, ``checkpoint``,
``activation_checkpointing``, ...: sections DeepSpeed reads key by key) a near-certain misspelling
is an error with "did you mean", and anything else is named in a warning as ignored, as DeepSpeed
itself ignores keys it does not read (real configs carry ``comms_config``, ``monitor_config``, ...).
A key whose value is "auto" is never refused for being unknown: DeepSpeed drops every "auto" value
before its models see the keys.

``legacy`` names keys DeepSpeed 0.19.8 refuses that older DeepSpeed accepted and public configs
still carry (the legacy ``curriculum_learning``, ``amp``, axolotl's ``compile.disable``, ...): given
a value that asks for nothing they are accepted and named in a warning saying DeepSpeed 0.19.8
refuses them; asking for their feature, they are refused as ``unsupported``.

A value marked ``SWITCH`` is a section with an ``enabled`` flag and asks for its feature only
when ``enabled`` is true; ``SECTION`` asks as soon as it holds anything; ``ANY`` asks unless it
is null, false or empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_zero.errors import ConfigError  # noqa: F401 - its old path: config/__init__.py and values.py import it from here

AUTO = "auto"
SWITCH = "<a section with an 'enabled' flag>"
SECTION = "<a section>"
ANY = "<any value but null, false or {}>"


@dataclass(frozen=True)
class Section:
    """One JSON object of a DeepSpeed config: what hf_zero does with each of its keys (see the module doc)."""

    keys: tuple[str, ...] = ()
    inert: Mapping[str, Any] = field(default_factory=dict)
    unsupported: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    older: frozenset[str] = frozenset()  # aliases that are deprecated names: "keep only the newer one"
    auto: frozenset[str] = frozenset()
    # DeepSpeed 0.19.8 validates this section with a pydantic model that forbids extra keys: an unknown key is refused
    closed: bool = False
    # keys DeepSpeed 0.19.8 refuses that older DeepSpeed accepted and public configs carry: key -> why, for the warning
    legacy: Mapping[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every spelling this section knows, for "did you mean"."""
        return [*self.keys, *self.inert, *self.unsupported, *self.aliases]


SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("Adam", "AdamW", "SGD")
# DeepSpeed's own optimizers: named so the error says "not supported yet" rather than "unknown".
DEEPSPEED_ONLY_OPTIMIZERS = (
    "Adagrad", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "Lion", "Muon",
)
SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
DEEPSPEED_ONLY_SCHEDULERS: tuple[str, ...] = ()
COMMUNICATION_DTYPES = ("fp32", "fp16", "bf16")
# "skip" (the default): the step is skipped and counted in skipped_steps, as fp16 overflows are;
# "stop": the run raises; "off": no check (DeepSpeed's behaviour, and no host sync per step).
NONFINITE_LOSS = ("skip", "stop", "off")
# checkpoint.tag_validation: what save_checkpoint does when ranks pass different tags (DeepSpeed's three modes)
TAG_VALIDATION = ("Warn", "Ignore", "Fail")
# checkpoint.save_on_signal: the signals a scheduler announces the end of a job with, all catchable: SIGTERM
# (SLURM, Kubernetes, PBS, spot instances), SIGUSR1/SIGUSR2 (SLURM's --signal, LSF), SIGINT, SIGHUP, SIGQUIT,
# and SIGXCPU (a CPU-time soft limit, Grid Engine).
CATCHABLE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT", "SIGXCPU")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "options")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# ---------------------------------------------------------------- top level

TOP = Section(
    keys=(
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
        "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "communication_data_type",
        "steps_per_print", "activation_checkpointing", "checkpoint", "pipeline", "compile",
        "torch_autocast",  # DeepSpeed's: forward under torch.autocast (hf_zero/engine/zero_engine.py)
        "sequence_parallel_size",  # DeepSpeed's (ALST): the Ulysses degree (hf_zero/config/sequence.py)
        "sequence_parallel",  # hf_zero's tiling switches; LLaMA-Factory's keys of the section are read too
        "wall_clock_breakdown",  # DeepSpeed's: time forward, backward and step (hf_zero/training/timers.py)
        "seed",  # hf_zero's: the seed of the distributed sampler's shuffle
        "nonfinite_loss",  # hf_zero's: what a bf16/fp32 step with an inf/nan loss or gradient does
        "tensor_parallel",  # DeepSpeed's AutoTP training: autotp_size (hf_zero/parallel/tensor_parallel.py)
        "fp8",  # hf_zero's: float8 linear layers through torchao (hf_zero/precision/float8.py)
        "aio",  # DeepSpeed's: NVMe offload's file I/O (hf_zero/zero/nvme.py)
        "expert_parallel",  # DeepSpeed's AutoEP: experts split over EP groups (hf_zero/expert/)
    ),
    aliases={"bfloat16": "bf16"},
    older=frozenset({"bfloat16"}),
    auto=frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping"}),
    inert={
        "memory_breakdown": False, "dump_state": False,
        # hf_zero shards any torch optimizer, which zero_allow_untested_optimizer: true asks DeepSpeed to allow
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": True, "disable_allgather": False,
        "dataloader_drop_last": False, "vocabulary_size": None,
        "use_data_before_expert_parallelism": False, "seq_parallel_communication_data_type": "fp32",
        "disable_python_gc": False, "log_level": None,
        # gradients are averaged once, in the reduce dtype: the pre-division knobs change nothing
        "prescale_gradients": False, "gradient_predivide_factor": 1.0,
        "data_parallel_size": None,  # DeepSpeed reads it only beside sequence_parallel_size
        "allgather_size": 500_000_000,  # read with DeepSpeed's old boolean "zero_optimization": true
        "flops_profiler": SWITCH, "tensorboard": SWITCH, "wandb": SWITCH, "csv_monitor": SWITCH, "comet": SWITCH,
        "comms_logger": SWITCH, "autotuning": SWITCH, "datastates_ckpt": ANY,
        "timers": SECTION, "data_types": SECTION,
    },
    unsupported={
        "amp": (SWITCH, 'Apex AMP is not supported; use "bf16": {"enabled": true} or "fp16" instead'),
        "sparse_gradients": (False, "sparse gradients are not supported; set it to false or remove it"),
        "gradient_allreduce_op": ("mean", 'hf_zero always averages gradients; use "mean" or remove the key'),
        "managed_gradient_accumulation": (True, "hf_zero manages the accumulation boundary itself (use "
                                                "engine.set_gradient_accumulation_boundary); remove the key"),
        "elasticity": (SWITCH, "elastic training is not supported yet; remove the section"),
        "progressive_layer_drop": (SWITCH, "progressive layer drop is not supported; remove the section"),
        "curriculum_learning": (SWITCH, "the legacy curriculum learning (DeepSpeed passed a growing curriculum_seqlen "
                                        "to the model's forward) is not supported, and DeepSpeed 0.19.8 has removed "
                                        "it too; remove the section"),
        "nebula": (SWITCH, "Nebula checkpointing is not supported, and DeepSpeed 0.19.8 has removed it too; remove the "
                           "section (hf_zero writes safetensors checkpoints)"),
        "graph_harvesting": (False, "graph harvesting is not supported, and DeepSpeed 0.19.8 has removed it too; "
                                    "remove the key"),
        "data_efficiency": (SWITCH, "DeepSpeed data efficiency is not supported; remove the section"),
        "hybrid_engine": (SWITCH, "the hybrid (RLHF) engine is not supported; remove the section"),
        "eigenvalue": (SWITCH, "eigenvalue computation is not supported; remove the section"),
        "quantize_training": (SWITCH, "quantized training is not supported; remove the section"),
        "sparse_attention": (SECTION, "sparse attention is not supported; remove the section"),
        "compression_training": (SECTION, "compression training is not supported; remove the section"),
        "weight_quantization": (SECTION, "weight quantization is not supported; remove the section"),
    },
    # DeepSpeed 0.19.8's _REMOVED_TOP_LEVEL_CONFIG_KEYS: refused there whatever their value
    legacy={
        "amp": "Apex AMP, removed from DeepSpeed", "nebula": "Nebula checkpointing, removed from DeepSpeed",
        "compression_training": "the compression library, removed from DeepSpeed",
        "quantize_training": "MoQ, removed from DeepSpeed", "eigenvalue": "eigenvalue MoQ, removed from DeepSpeed",
        "sparse_gradients": "removed from DeepSpeed", "sparse_attention": "sparse attention, removed from DeepSpeed",
        "elasticity": "elastic training, removed from DeepSpeed", "graph_harvesting": "removed from DeepSpeed",
        "progressive_layer_drop": "progressive layer drop, removed from DeepSpeed",
        "curriculum_learning": "the legacy section, removed from DeepSpeed, which reads "
                               "data_efficiency.data_sampling.curriculum_learning instead",
    },
)
SWITCHES_ACCEPTING_AUTO = frozenset({"amp"})  # transformers fills amp.enabled from TrainingArguments

# ---------------------------------------------------------------- precision

FP16 = Section(
    keys=("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
          "min_loss_scale", "auto_cast"),
    auto=frozenset({"enabled"}),
    unsupported={"fp16_master_weights_and_grads": (False, "fp16 master weights are not supported; masters are fp32")},
    closed=True,
)
BF16 = Section(
    # bf16_master_weights_and_grads / bf16_optimizer_states: masters, reduced gradients and optimizer
    # state in bf16 (no fp32 copy), checked against DeepSpeed's rules by refuse_missing_features
    keys=("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"),
    auto=frozenset({"enabled"}),
    # hf_zero checks every bf16 step for inf/nan ("nonfinite_loss"), which check_grad_overflow: true asks for
    inert={"immediate_grad_update": False, "check_grad_overflow": True},
    closed=True,
)
# DeepSpeed's torch_autocast: the forward runs under torch.autocast(dtype). lower_precision_safe_modules
# picks the parameters whose gradients DeepSpeed communicates in the autocast dtype; hf_zero averages every
# gradient in one reduce dtype (communication_data_type), so that list asks for nothing here.
TORCH_AUTOCAST_DTYPES = ("bf16", "fp16")
TORCH_AUTOCAST = Section(keys=("enabled", "dtype"), inert={"lower_precision_safe_modules": None})

# ---------------------------------------------------------------- zero_optimization

ZERO = Section(
    keys=(
        "stage", "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "offload_optimizer", "offload_param",
        "overlap_param_gather",  # hf_zero's: the step's parameter all-gather waited for in the next forward
        # MiCS's (DeepSpeed before 0.19.8): shard inside groups of N consecutive data-parallel ranks, replicate across
        # them; hf_zero runs it as hybrid sharding at stages 1-3 (hf_zero/parallel/grid.py, the dp_replicate axis)
        "mics_shard_size",
        "ignore_unused_parameters",  # false: a trainable parameter with no gradient is an error at stages 1-2
        "sub_group_size",  # the offloaded host step's granularity (hf_zero/zero/host_step.py sub_group_ranges)
        "cpu_offload",  # DeepSpeed's deprecated spelling of offload_optimizer on the cpu, converted as DeepSpeed does
        "zenflow",  # DeepSpeed's ZenFlow over the offloaded optimizer (hf_zero/zero/zenflow.py)
    ),
    # DeepSpeed's field names beside their stage3_* aliases, and the deprecated fp16 spelling
    aliases={
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential": "stage3_allgather_sequential",
    },
    older=frozenset({"stage3_gather_fp16_weights_on_model_save"}),
    auto=frozenset({"reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save"}),
    inert={
        # what hf_zero always does: gradients reduced on a side stream while backward runs (GPU), into
        # flat contiguous buckets, reduce-scattered at stages 1-3, updated parameters all-gathered
        "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True, "allgather_partitions": True,
        # the all-gather runs per flat group, sized by reduce_bucket_size; save_16bit_model always gathers the
        # full weights
        "allgather_bucket_size": 500_000_000,
        "stage3_gather_16bit_weights_on_model_save": True,
        "load_from_fp32_weights": True, "elastic_checkpoint": False,
        "legacy_stage1": False, "round_robin_gradients": False,
        "use_multi_rank_bucket_allreduce": True, "stage3_model_persistence_threshold": None,
        "stage3_module_granularity_threshold": 0, "stage3_use_all_reduce_for_fetch_params": False,
        "stage3_allgather_sequential": False, "memory_efficient_linear": True, "override_module_apply": True,
        "pipeline_loading_checkpoint": False, "log_trace_cache_warnings": False, "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False,
        "cpu_offload_use_pin_memory": None, "leaf_module": SECTION,
        "compute_grad_norm": True, "parameter_alignment": False,
        # MiCS's two-hop gather of the parameters (across nodes, then inside one): hf_zero's hybrid sharding gathers
        # inside the shard group only, which is inside a node when mics_shard_size divides its GPUs, so there is no
        # cross-node gather left to split in two
        "mics_hierarchical_params_gather": False,
    },
    unsupported={
        "cpu_offload_param": (False, "parameter offload is not supported yet; remove the key"),
        "zero_quantized_weights": (False, "ZeRO++ quantized weights are not supported yet"),
        "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized weights are not supported yet"),
        "zero_quantized_gradients": (False, "ZeRO++ quantized gradients are not supported yet"),
        "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning (a second, node-local copy of the parameters) "
                                       "is not supported; to shard inside a node and replicate across nodes use "
                                       "zero_optimization.mics_shard_size or ParallelismConfig(dp_replicate_size=...) "
                                       "instead"),
        "zeropp_loco_param": (None, "LoCo-Zero++ is not supported, and DeepSpeed 0.19.8 has removed it too; remove the key"),
    },
    closed=True,
    # DeepSpeed 0.19.8's _REMOVED_ZERO_CONFIG_KEYS
    legacy={"mics_shard_size": "MiCS, removed from DeepSpeed; hf_zero runs it as hybrid sharding",
            "mics_hierarchical_params_gather": "MiCS, removed from DeepSpeed",
            "zeropp_loco_param": "LoCo-Zero++, removed from DeepSpeed"},
)
# Both offload sections are parsed in full (sections.OffloadParamConfig, OffloadOptimizerConfig).
OFFLOAD_PARAM = Section(keys=("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"),
                        closed=True)
# DeepSpeed 0.19.8's ZenFlowConfig, every field (parsed in full: sections.ZenFlowConfig)
ZENFLOW = Section(keys=("topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step", "offload",
                        "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc", "steps_per_epoch"), closed=True)
OFFLOAD_OPTIMIZER = Section(keys=("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                                  "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"), closed=True)

# ---------------------------------------------------------------- the other sections

# DeepSpeed reads aio key by key from a plain dict (no model): other keys are not its, so not refused here either.
AIO = Section(
    keys=("block_size", "queue_depth", "intra_op_parallelism", "single_submit"),
    aliases={"thread_count": "intra_op_parallelism"},  # older DeepSpeed's name, still in transformers' NVMe example
    inert={"overlap_events": True},
    unsupported={"use_gds": (False, "GPUDirect Storage is not supported; remove use_gds (NVMe offload reads through host memory)")},
)

CHECKPOINT = Section(
    # hf_zero's: keep_last (save_checkpoint keeps the N newest checkpoints of its folder; null: all);
    # save_on_signal, save_dir, grace_seconds (a preemption's resume checkpoint, hf_zero/training/preemption.py);
    # async_save (checkpoints written by a background thread, hf_zero/checkpoint/background.py).
    # tag_validation is DeepSpeed's (Warn / Ignore / Fail across ranks).
    keys=("keep_last", "tag_validation", "save_on_signal", "save_dir", "grace_seconds", "async_save"),
    inert={"load_universal": False, "use_node_local_storage": False,
           "checkpoint_serialization": True, "parallel_write": SECTION, "writer": SECTION},
)
COMPILE = Section(
    # hf_zero's: torch.compile of each block. They were DeepSpeed's fields in 0.14.0-0.14.3; 0.14.4-0.16.5 read no
    # compile section at all, and 0.16.6 on has the DeepCompile model below, which refuses them.
    keys=("enabled", "backend", "kwargs"),  # kwargs: torch.compile's keyword arguments (COMPILE_KWARGS)
    # DeepSpeed's DeepCompile (its own graph passes) is another engine; its tuning keys mean nothing here
    unsupported={"deepcompile": (False, 'DeepSpeed\'s DeepCompile is not supported; use "compile": {"enabled": true} '
                                        "(torch.compile of each block)")},
    inert={
        "free_activation": False, "free_activation_threshold": 10 * 1024 * 1024, "offload_activation": False,
        "offload_activation_pin_memory": True, "offload_opt_states": False, "double_buffer": True,
        "symmetric_memory": False, "debug_log": False, "offload_parameters": False, "sync_before_reduce": False,
        "sync_after_reduce": False, "sync_before_allgather": False, "sync_after_allgather": False,
        "keep_int_input_tensors": True, "keep_all_input_tensors": False, "autoep_non_moe": False, "passes": None,
        "disable": ANY,  # no DeepSpeed's field ever, but axolotl's configs carry it
    },
    closed=True,
    legacy={"disable": "not a field of its compile section; DeepSpeed 0.14.4-0.16.5 read no compile section at all"},
)
# hf_zero's float8 training (DeepSpeed 0.19.8 has no such section): torchao's recipes by their names
FLOAT8_RECIPES = ("tensorwise", "rowwise")
FP8 = Section(keys=("enabled", "recipe", "fp8_all_gather", "skip", "emulate"), closed=True)
OPTIMIZER = Section(keys=("type", "params"), inert={"legacy_fusion": False})
SCHEDULER = Section(keys=("type", "params"))
ACTIVATION_CHECKPOINTING = Section(keys=(
    "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing", "number_checkpoints",
    "synchronize_checkpoint_boundary", "profile",
    "checkpoint_blocks",  # hf_zero's: recompute every block (unit) in backward instead of storing activations
    "keep_attention",  # hf_zero's: with checkpoint_blocks, keep attention kernels' outputs instead of recomputing them
))
PIPELINE = Section(
    keys=("stages", "activation_checkpoint_interval",
          "schedule"),  # hf_zero's: "1f1b" (DeepSpeed's, the default) or "gpipe"
    auto=frozenset({"stages"}),
    inert={"partition": "best", "seed_layers": False, "pipe_partitioned": True, "grad_partitioned": True,
           "use_reentrant": True},
)

# DeepSpeed's AutoTP training section. hf_zero splits the linear layers named by the model's own plan
# (config.base_model_tp_plan), so DeepSpeed's other ways of choosing the split are refused by name.
TENSOR_PARALLEL = Section(
    keys=("autotp_size", "tensor_parallel"),
    aliases={"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject"},
    inert={
        "dtype": None,  # the model's dtype comes from the bf16/fp16 sections, as for every other engine
        "tp_overlap_comm": False,  # the forward all-reduce runs on the compute stream
        "vocab_parallel_ce_backend": "torch", "keep_module_on_host": False,
    },
    unsupported={
        "vocab_parallel_lm_head": (ANY, "a vocabulary-parallel lm_head is not supported yet (hf_zero keeps the lm_head "
                                        "whole on every rank); set it to false or remove it"),
        "partition_config": (ANY, "custom partition rules are not supported yet; hf_zero splits the layers the model's "
                                  "base_model_tp_plan names, so remove partition_config"),
        "preset_model": (ANY, "AutoTP presets are not supported; hf_zero splits the layers the model's base_model_tp_plan "
                              "names, so remove preset_model"),
        "injection_policy_tuple": (ANY, "injection policies are not supported; hf_zero splits the layers the model's "
                                        "base_model_tp_plan names, so remove injection_policy_tuple"),
        "replace_with_kernel_inject": (False, "kernel injection belongs to DeepSpeed's inference engine; remove it"),
    },
    closed=True,
)
TENSOR_PARALLEL_GROUPS = Section(
    keys=("tp_size",),
    inert={"tp_grain_size": 1},
    unsupported={
        "mpu": (ANY, "a model-parallel unit cannot come from a JSON config; remove it (hf_zero makes the groups)"),
        "tp_group": (ANY, "a process group cannot come from a JSON config; remove it (hf_zero makes the groups)"),
    },
    closed=True,
)

# DeepSpeed 0.19.8's AutoEP section (deepspeed/module_inject/auto_ep_config.py reads it key by key, so unknown keys
# are not refused there). hf_zero finds each MoE layer's experts from the model's own transformers classes and keeps
# the model's router, aux loss and shared experts; so the keys that change routing or name modules by pattern are
# accepted only at the value that asks for the model's own behaviour, and DeepSpeed's kernel/communication knobs that
# change no number are inert.
_OWN_ROUTER = "hf_zero routes with the model's own router (its top-k, normalisation, scaling and aux loss), so remove "
_OWN_CLASSES = "hf_zero finds the experts from the model's own transformers classes, so remove "
EXPERT_PARALLEL = Section(
    keys=("enabled", "autoep_size", "preset_model", "use_grouped_mm", "top_k", "expert_tensor_parallel_size"),
    inert={
        "disable_triton_grouped_mm": False, "combine_impl": "auto", "row_weighting_impl": "auto",
        "gate_up_impl": "separate", "comm_num_sm": 12, "comm_qp_margin": 4, "comm_max_tokens_per_rank": 0,
        "async_split_plan": False, "validate_folding_routing": False,
    },
    unsupported={
        "comm_backend": ("comm", "only the torch.distributed all-to-all backend (\"comm\") is built; remove comm_backend"),
        "route_norm": (None, _OWN_ROUTER + "route_norm"),
        "route_scale": (1.0, _OWN_ROUTER + "route_scale"),
        "score_apply": ("auto", _OWN_ROUTER + "score_apply"),
        "score_func": ("auto", _OWN_ROUTER + "score_func"),
        "routed_scaling_factor": ("auto", _OWN_ROUTER + "routed_scaling_factor"),
        "num_expert_groups": (None, _OWN_ROUTER + "num_expert_groups"),
        "num_limited_groups": (None, _OWN_ROUTER + "num_limited_groups"),
        "load_balance_coeff": (None, "auxiliary-loss-free load balancing (an expert bias) is not supported, as in "
                                     "DeepSpeed 0.19.8; set load_balance_coeff to null or remove it"),
        **{k: (ANY, _OWN_CLASSES + k) for k in (
            "moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3",
            "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
            "shared_experts_gate_pattern", "expert_activation")},
    },
)
# DeepSpeed 0.19.8's AutoEP presets; hf_zero reads the same layers from the model's classes, so a preset is a check
# that the model is of the family it names (its transformers model_type values, as DeepSpeed's presets list them).
EXPERT_PRESETS: dict[str, tuple[str, ...]] = {
    "mixtral": ("mixtral",), "qwen3_moe": ("qwen3_moe", "qwen2_moe"), "qwen3_5_moe": ("qwen3_5_moe_text",),
    "deepseek_v2": ("deepseek_v2",), "deepseek_v3": ("deepseek_v3",), "minimax_m3": ("minimax_m3_vl_text",),
}

# Every section hf_zero reads key by key, by JSON path; a key of one of these that is itself here is a
# sub-section (optimizer.params and scheduler.params are free-form: optim.py checks them).
SECTIONS: dict[str, Section] = {
    "": TOP, "fp16": FP16, "bf16": BF16, "zero_optimization": ZERO,
    "zero_optimization.offload_param": OFFLOAD_PARAM, "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER, "zero_optimization.zenflow": ZENFLOW,
    "checkpoint": CHECKPOINT, "compile": COMPILE, "aio": AIO, "torch_autocast": TORCH_AUTOCAST, "fp8": FP8, "optimizer": OPTIMIZER, "scheduler": SCHEDULER,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING, "pipeline": PIPELINE,
    "tensor_parallel": TENSOR_PARALLEL, "tensor_parallel.tensor_parallel": TENSOR_PARALLEL_GROUPS,
    "expert_parallel": EXPERT_PARALLEL,
}


# DeepSpeed 0.19.8's closed sections that hf_zero takes whole (an inert or refused key of a section above), with
# the names their pydantic models take: an unknown key inside one is refused as DeepSpeed refuses it. The names
# are checked against DeepSpeed's models by tests/test_ds_config_oracle.py.
CLOSED_WHOLE: dict[str, frozenset[str]] = {
    "tensorboard": frozenset({"enabled", "output_path", "job_name"}),
    "csv_monitor": frozenset({"enabled", "output_path", "job_name"}),
    "wandb": frozenset({"enabled", "group", "team", "project"}),
    "comet": frozenset({"enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
                        "experiment_key", "online", "mode"}),
    "comms_logger": frozenset({"enabled", "prof_all", "prof_ops", "verbose", "debug"}),
    "hybrid_engine": frozenset({"enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
                                "pin_parameters", "tp_gather_partition_size", "enable_cuda_graph"}),
    "timers.throughput": frozenset({"enabled", "synchronized"}),  # "timers" itself is read key by key
    "weight_quantization": frozenset({"enabled", "num_bits", "q_type", "q_groups", "quantized_initialization",
                                      "post_init_quant"}),
    "zero_optimization.leaf_module": frozenset({"classes", "names", "name_suffixes"}),
}


def classify(path: str) -> str | None:
    """What hf_zero does with the DeepSpeed key at a dotted ``path``: "acted", "inert", "refused", or None.

    "refused" means refused when it asks for its feature; a key inside an inert or refused section
    shares its section's fate; None means hf_zero does not know the key.
    """
    here = ""
    parts = path.split(".")
    for i, part in enumerate(parts):
        section = SECTIONS[here]
        name = section.aliases.get(part, part)
        if name in section.inert:
            return "inert"
        if name in section.unsupported:
            return "refused"
        if name not in section.keys:
            return None
        child = f"{here}.{name}" if here else name
        if i == len(parts) - 1 or child not in SECTIONS:
            return "acted"
        here = child
    return "acted"
