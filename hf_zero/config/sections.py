"""The typed sections of a parsed DeepSpeed config: what ``ZeroConfig`` holds besides its scalars.

Each dataclass holds only the keys hf_zero acts on, under DeepSpeed's names and with
DeepSpeed's defaults; these defaults are the one source of them (the parser reads them from
here, and the engine takes its values from the parsed config). Keys hf_zero accepts without
acting on them are not fields: they are tabulated in ``config/schema.py`` and named in the
"accepts but ignores" warning when they ask for something.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OptimizerConfig:
    """``optimizer``: the type in canonical spelling ("Adam", "AdamW", "SGD"); params as given, minus "auto"."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    """``scheduler``: one of DeepSpeed's Warmup* schedules; ``optim.py`` checks the params."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class FP16Config:
    """``fp16``: DeepSpeed's names and defaults, so a loss-scale history carries over unchanged."""

    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    # DeepSpeed's fp16.auto_cast: engine(...) casts its floating inputs to fp16 (without it they go in as given)
    auto_cast: bool = False


@dataclass
class BF16Config:
    """``bf16`` (or DeepSpeed's older ``bfloat16``).

    ``master_weights_and_grads`` keeps the masters and the reduced gradients in bf16 instead of fp32,
    and ``optimizer_states`` the optimizer's state: 6 bytes per parameter less than fp32 masters and
    Adam moments, for less precise updates (DeepSpeed's ``bf16_master_weights_and_grads`` and
    ``bf16_optimizer_states``; it allows the first without the second only with its own CPU Adam).
    """

    enabled: bool = False
    master_weights_and_grads: bool = False
    optimizer_states: bool = False


@dataclass
class TorchAutocastConfig:
    """``torch_autocast``: the forward under ``torch.autocast(device, dtype)``.

    The parameters stay in the dtype the fp16/bf16 sections give (fp32 when neither is on), so
    autocast picks the precision op by op. ``dtype`` None is torch's default for the device
    (fp16 on CUDA, bf16 on the CPU), as DeepSpeed leaves it.
    """

    enabled: bool = False
    dtype: str | None = None  # "bf16" | "fp16"


@dataclass
class OffloadParamConfig:
    """``zero_optimization.offload_param``, DeepSpeed's fields and defaults (parameters in host memory or NVMe).

    Parsed in full; "cpu" and "nvme" run at stage 3 (hf_zero/zero/offload.py, hf_zero/zero/nvme.py): on NVMe the
    shards beyond ``max_in_cpu`` elements live in files under ``nvme_path``, read ahead by up to ``buffer_count``
    reads; ``buffer_size`` is accepted and named in the "accepts but ignores" warning (each shard is read into a
    buffer of its own size).
    """

    device: str = "none"  # "none" | "cpu" | "nvme"
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = True


@dataclass
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``, DeepSpeed's fields and defaults (optimizer state on the host).

    "cpu": the masters and the optimizer state in host memory; "nvme": in files under ``nvme_path``, swapped
    through ``buffer_count`` buffers (hf_zero/zero/nvme.py). ``pipeline_read`` / ``pipeline_write`` are what the
    NVMe step always does (reads ahead, writes behind); ``fast_init`` changes nothing here.
    """

    device: str = "none"  # "none" | "cpu" | "nvme"
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    # the share of the trainable groups whose optimizer state is offloaded; the first groups in parameter order keep
    # theirs on the device and step there (DeepSpeed: stage 3 only; hf_zero/zero/offload.py device_group_count)
    ratio: float = 1.0
    super_offload: bool = False
    # DeepSpeed's default is 0.8 (for its SuperOffload; cores_share applies it there); None otherwise: the host step
    # uses the whole share of this rank's CPUs (hf_zero/zero/host_step.py host_step_threads), a given value that part
    cpuadam_cores_perc: float | None = None

    def cores_share(self) -> float | None:
        """The part of this rank's share of the cores the host optimizer step runs on (None: all of it).

        ``cpuadam_cores_perc`` when given. Without it, under ``super_offload`` DeepSpeed's default of 0.8: the host step
        then runs during backward, beside the thread that drives the backward and its collectives, which keeps the
        rest; the ordinary host step runs after backward and takes the whole share.
        """
        if self.cpuadam_cores_perc is not None:
            return self.cpuadam_cores_perc
        return 0.8 if self.super_offload else None


@dataclass
class ZenFlowConfig:
    """``zero_optimization.zenflow``: DeepSpeed 0.19.8's ZenFlow keys and defaults (``hf_zero/zero/zenflow.py`` runs it).

    Each step the ``topk_ratio`` most important columns of every 2-D weight (by the summed magnitude of their
    gradient; every element of the other parameters) are stepped with Adam at once, on the device; the others'
    gradients are summed and the host steps them every ``update_interval`` steps ("auto": when the unimportant
    columns' summed gradient catches up with the important ones'), one update late with ``overlap_step``. The
    columns are chosen again every ``select_interval`` steps (``select_strategy`` "step") or epochs ("epoch";
    "auto" is once an epoch); the first ``full_warm_up_rounds`` steps are ordinary offloaded steps. ``offload``
    keeps the important columns' Adam state in host memory, ``pt_reserved_cores_perc`` is the share of the rank's
    cores the host update leaves to training while it runs in the background (``overlap_step``).
    ``steps_per_epoch`` is the epoch's length when the engine has no training loader (DeepSpeed sets it itself).
    """

    topk_ratio: float = 0.1
    select_strategy: str = "auto"  # "auto" | "step" | "epoch"
    select_interval: int | str = "auto"  # "auto" or a count of steps / epochs (0: choose once)
    update_interval: int | str = "auto"  # "auto" or a count of steps (at least 1)
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = 0.99
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = 0.5
    steps_per_epoch: int | None = None


@dataclass
class AioConfig:
    """``aio``: how NVMe offload reads and writes its files (DeepSpeed 0.19.8's keys and defaults).

    ``intra_op_parallelism`` (older DeepSpeed's and transformers' docs' ``thread_count``) is the I/O thread pool's
    size, ``block_size`` the bytes of one request, ``queue_depth`` the requests queued per thread, ``single_submit``
    one request at a time. ``overlap_events`` is accepted (hf_zero's reads and writes always overlap the step);
    ``use_gds`` (GPUDirect Storage) is refused.
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False


@dataclass
class ZeroOptimizationConfig:
    """``zero_optimization``: the knobs hf_zero uses. Their defaults are DeepSpeed's and the only copy here.

    The ``stage3_*`` names are DeepSpeed's aliases; its field names (``prefetch_bucket_size``, ...)
    are accepted as well and land in the same fields.
    """

    stage: int = 0
    reduce_bucket_size: int = 500_000_000  # elements per gradient bucket (and per flat group)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements gathered ahead of use at stage 3
    stage3_param_persistence_threshold: int = 100_000  # parameters smaller than this stay whole at stage 3
    stage3_max_live_parameters: int = 1_000_000_000  # gathered elements alive at once at stage 3
    # a unit used again within this many elements of other units may stay gathered (no-grad forwards: evaluation,
    # generate; hf_zero/zero/inference.py InferenceKeep.after_unit), under stage3_max_live_parameters
    stage3_max_reuse_distance: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig | None = None  # None: the section is absent
    offload_param: OffloadParamConfig | None = None
    # hf_zero's: stages 0-2 return from the step with the parameters' all-gathers in flight (with offload_optimizer,
    # each group's CPU step too), each waited for where the next forward first reads it (hf_zero/zero/overlap.py);
    # direct reads of module.parameters() between step() and the next forward then need engine.wait_params() first,
    # so it is asked for, not on by default
    overlap_param_gather: bool = False
    # MiCS's key (DeepSpeed before 0.19.8): above 0, hybrid sharding with shard groups of this many consecutive
    # data-parallel ranks, replicated across the rest (hf_zero/parallel/grid.py); -1 (DeepSpeed's default) or 0: off
    mics_shard_size: int = -1
    # DeepSpeed's: false makes a trainable parameter that got no gradient in an optimizer step's backward passes an
    # error at stages 1-2 (ShardedOptimizer.check_unused_parameters); true (the default) tolerates it, as DDP's
    # find_unused_parameters does
    ignore_unused_parameters: bool = True
    # DeepSpeed's: parameters taken in order into sub-groups of at least this many elements (0: one parameter each); here
    # the granularity of the offloaded host step (hf_zero/zero/host_step.py sub_group_ranges), read with offload only
    sub_group_size: int = 1_000_000_000
    # DeepSpeed's ZenFlow (hf_zero/zero/zenflow.py): important columns stepped at once, the rest every few steps; None: off
    zenflow: ZenFlowConfig | None = None


@dataclass
class PipelineConfig:
    """``pipeline``: read when the model is a ``PipelineModule`` (``stages`` None: whatever the module says)."""

    stages: int | None = None
    activation_checkpoint_interval: int = 0
    schedule: str = "1f1b"  # hf_zero's key: "1f1b" or "gpipe"


@dataclass
class Float8Config:
    """``fp8``: hf_zero's float8 training section (DeepSpeed 0.19.8 has none; torchtitan's float8 converter is the model).

    The linear layers compute in float8 through torchao's ``Float8Linear`` (``recipe``: torchao's "tensorwise" or
    "rowwise" scaling); the parameters, masters, optimizer state and checkpoints stay in the bf16/fp32 the rest of the
    config gives, so a float8 run resumes in bf16 and back. ``fp8_all_gather`` (stage 3, tensorwise only): the
    gathers move float8 shards scaled over the whole weight, half the bytes of bf16. ``skip``: regular expressions
    matched (``re.search``) against module names, added to the default skips (:mod:`hf_zero.precision.float8`). ``emulate``:
    torchao's matmuls in high precision on float8-rounded values, for hardware without float8 kernels.
    """

    enabled: bool = False
    recipe: str = "tensorwise"  # "tensorwise" | "rowwise" (schema.FLOAT8_RECIPES)
    fp8_all_gather: bool = True
    skip: tuple[str, ...] = ()
    emulate: bool = False
    # Set in code only (Accelerate's AORecipeKwargs, hf_zero/integrations/accelerate.py), never from JSON: torchao's
    # own Float8LinearConfig, used instead of the recipe's, and a module_filter_fn(module, name) used instead of the
    # default filter.
    torchao_config: Any = None
    module_filter: Any = None


@dataclass
class CompileConfig:
    """``compile``: ``torch.compile`` each block at ``initialize`` (see :mod:`hf_zero.training.compile`)."""

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict = field(default_factory=dict)


@dataclass
class ExpertParallelConfig:
    """``expert_parallel``: DeepSpeed's AutoEP section, as hf_zero runs it (``hf_zero/expert/``).

    ``size`` is ``autoep_size``: each MoE layer's experts are split over groups of that many consecutive ranks (1:
    every rank holds every expert, nothing is sent). ``preset_model``, when given, names the model family the run
    expects (checked against the model's ``model_type``). ``use_grouped_mm``: the local experts run as one grouped
    GEMM (transformers' ``grouped_mm`` experts function) instead of the model's own per-expert code. ``top_k``:
    None ("auto") or the model's own ``num_experts_per_tok``, checked when the model is seen.
    """

    enabled: bool = False
    size: int = 1
    preset_model: str | None = None
    use_grouped_mm: bool = True
    top_k: int | None = None

    @property
    def active(self) -> bool:
        """Whether experts are split at all (the section enabled with ``autoep_size`` above 1)."""
        return self.enabled and self.size > 1
