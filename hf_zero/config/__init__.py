"""ZeroConfig: DeepSpeed's config JSON as typed dataclasses, validated before any work starts.

A run that will fail should fail here, on every rank alike, before a process group or a
model exists. So every problem is one ``ConfigError`` sentence with the JSON path, what was
given and what is allowed (``zero_optimization.stage: got 4, expected one of 0, 1, 2, 3``).
What happens to each key is tabulated in ``config/schema.py``: keys hf_zero acts on are parsed
into the dataclasses here and in ``config/sections.py``; DeepSpeed keys it accepts but does not
act on are named once in a warning when they ask for something; DeepSpeed features it does not
have (Apex AMP, ZeRO++, and offload and sequence parallelism for now) are errors, because
training silently without them would not be the run the user configured; a key DeepSpeed does
not know either is an error inside a section DeepSpeed 0.19.8 closes to unknown keys (``bf16``,
``zero_optimization``, ...), as DeepSpeed refuses it there, and elsewhere a "did you mean" error
when it is a near-certain misspelling of one and a warning otherwise; what older DeepSpeed
accepted and 0.19.8 refuses is accepted with a warning saying so. The walk itself is
``config/parse.py``.

``"auto"`` (written by Hugging Face's DeepSpeed configs) means "not given" at this layer: the
batch keys stay ``None`` and are derived by :meth:`ZeroConfig.resolve_batch_sizes`, other keys
take their default, and every such JSON path (as the user spelt it) is recorded in ``auto_keys``
so the Trainer and Accelerate integrations know what to fill in.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_zero.config.parse import BATCH_KEYS, Parser
from hf_zero.config.refusals import refuse_missing_features
from hf_zero.config.schema import AUTO, ConfigError
from hf_zero.config.sections import (
    AioConfig,
    BF16Config,
    CompileConfig,
    ExpertParallelConfig,
    Float8Config,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TorchAutocastConfig,
    ZeroOptimizationConfig,
)
from hf_zero.config.sequence import SequenceParallelConfig
from hf_zero.config.sequence import parse as parse_sequence_parallel
from hf_zero.config.values import Int, json_kind
from hf_zero.errors import BatchSizeError

__all__ = [
    "AUTO", "BF16Config", "CompileConfig", "ConfigError", "ExpertParallelConfig", "Float8Config", "FP16Config", "OffloadOptimizerConfig", "OffloadParamConfig",
    "OptimizerConfig", "PipelineConfig", "SchedulerConfig", "TorchAutocastConfig", "ZeroConfig", "ZeroOptimizationConfig",
]


@dataclass
class ZeroConfig:
    """A parsed, validated DeepSpeed config; build it with :meth:`load`."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 1.0  # DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT: clip at 1.0 unless the config says
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    fp8: Float8Config = field(default_factory=Float8Config)  # hf_zero extension: float8 linears (hf_zero/precision/float8.py)
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    communication_data_type: str | None = None  # "fp32" | "fp16" | "bf16"; None: the engine's default
    steps_per_print: int | None = 10  # null: never print, DeepSpeed's own default
    wall_clock_breakdown: bool = False  # time forward, backward and step, logged every steps_per_print (timers.py)
    seed: int | None = None  # hf_zero extension: the seed of the distributed sampler's shuffle
    sequence_parallel_size: int = 1  # the Ulysses degree, from this key or the sequence_parallel section
    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)  # the tiling switches
    tensor_parallel_size: int = 1  # tensor_parallel.autotp_size (DeepSpeed's AutoTP training); 1: off
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)  # AutoEP (hf_zero/expert/)
    activation_checkpointing: dict = field(default_factory=dict)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    aio: AioConfig = field(default_factory=AioConfig)  # NVMe offload's file I/O (hf_zero/zero/nvme.py)
    nonfinite_loss: str = "skip"  # hf_zero extension: "skip" | "stop" | "off" (schema.NONFINITE_LOSS)
    checkpoint_keep_last: int | None = None  # hf_zero extension: checkpoint.keep_last; None keeps every checkpoint
    checkpoint_tag_validation: str = "Warn"  # checkpoint.tag_validation: "Warn" | "Ignore" | "Fail" (save_checkpoint)
    # hf_zero extensions for long runs (hf_zero/training/preemption.py, hf_zero/checkpoint/background.py):
    checkpoint_save_on_signal: tuple[str, ...] | None = None  # None: not given (the engine watches none, the Trainer
    checkpoint_save_dir: str | None = None  # SIGTERM and SIGUSR1); save_dir None: the last save_checkpoint's folder
    checkpoint_grace_seconds: float | None = None  # after the first signal, exit at once when this has passed
    checkpoint_async_save: bool = False  # save_checkpoint copies to host memory and returns; a thread writes
    raw: dict = field(default_factory=dict)  # the user's dict as given (a deep copy)
    auto_keys: set[str] = field(default_factory=set)  # JSON paths whose value was "auto"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward run in: bf16, fp16, or fp32 when neither is enabled."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        """What masters, reduced gradients and optimizer state are kept in: fp32, or bf16 when bf16 asks for it.

        A torch optimizer keeps its state in its parameters' dtype, so bf16 masters come with bf16 state:
        the two keys go together (``refuse_missing_features`` refuses one without the other).
        """
        bf = self.bf16
        return torch.bfloat16 if bf.enabled and bf.master_weights_and_grads and bf.optimizer_states else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype of ``torch_autocast`` (None: torch's default for the device); only read when it is enabled."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[self.torch_autocast.dtype]

    @classmethod
    def load(cls, config: str | os.PathLike | Mapping | ZeroConfig | None) -> ZeroConfig:
        """Parse a dict or a JSON file (an already-built ZeroConfig is returned as is).

        Raises :class:`ConfigError` at the first problem; warns once about ignored keys.
        """
        if isinstance(config, ZeroConfig):
            return config
        if config is None:
            raise ConfigError("config: none was given, and a config is required; pass config= a dict or a path to a DeepSpeed JSON file")
        source = "config"
        if isinstance(config, (str, os.PathLike)):
            source = f"config: {os.fspath(config)!r}"
            config = _read_json(os.fspath(config))
        elif isinstance(config, Mapping):
            config = dict(config)
        else:
            raise ConfigError(f"config: got a {type(config).__name__}, expected a JSON object (a dict) or the path of a DeepSpeed JSON file")
        if not isinstance(config, dict):
            raise ConfigError(f"{source} holds a JSON {json_kind(config)}, expected a JSON object (a dict of DeepSpeed keys)")
        parser = Parser()
        cfg = cls(raw=copy.deepcopy(config), **parser.parse(config))
        cfg.sequence_parallel = parse_sequence_parallel(config)
        cfg.sequence_parallel_size = cfg.sequence_parallel.size
        parser.unknown.extend(cfg.sequence_parallel.ignored)
        parser.ignored.extend(refuse_missing_features(cfg))
        parser.warn()  # only for a config that will run: a refused one is fixed and parsed again
        return cfg

    def resolve_batch_sizes(self, world_size: int) -> None:
        """Complete the batch triple as DeepSpeed does: train_batch_size = micro x accumulation x world size.

        Any two determine the third; train_batch_size alone or the micro-batch alone imply one
        accumulation step. The derived values are written into this config. Sizes that cannot agree raise
        :class:`BatchSizeError` (a ``ConfigError``, and an ``AssertionError`` as DeepSpeed's checks are).
        """
        Int(1)(world_size, "world_size")
        for key in BATCH_KEYS:  # assigned after parsing (DeepSpeedConfig's attributes): the parser's rule again
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BatchSizeError(f"{key}: got {value!r}, expected an integer >= 1 (or None, to derive it)")
        tbs, mbs, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        ws = world_size
        if tbs is not None and mbs is not None and gas is not None:
            if tbs != mbs * gas * ws:
                raise BatchSizeError(
                    f"train_batch_size: got {tbs}, but train_micro_batch_size_per_gpu {mbs} x gradient_accumulation_steps "
                    f"{gas} x world size {ws} = {mbs * gas * ws}; make them agree or drop one and it will be derived"
                )
        elif tbs is not None and mbs is not None:
            if tbs % (mbs * ws):
                raise BatchSizeError(
                    f"train_batch_size: got {tbs}, which is not a multiple of train_micro_batch_size_per_gpu {mbs} x "
                    f"world size {ws} = {mbs * ws}, so gradient_accumulation_steps cannot be derived; choose sizes that divide"
                )
            gas = tbs // (mbs * ws)
        elif tbs is not None:
            split = f"gradient_accumulation_steps {gas} x world size {ws} = {gas * ws}" if gas else f"world size {ws}"
            gas = gas or 1
            if tbs % (gas * ws):
                raise BatchSizeError(
                    f"train_batch_size: got {tbs}, which is not a multiple of {split}, so "
                    "train_micro_batch_size_per_gpu cannot be derived; choose sizes that divide"
                )
            mbs = tbs // (gas * ws)
        elif mbs is not None:
            gas = gas or 1
            tbs = mbs * gas * ws
        else:
            autos = [k for k in BATCH_KEYS if k in self.auto_keys]
            why = f' (they are "auto": {", ".join(autos)}; the Trainer fills those, initialize() needs numbers)' if autos else ""
            if gas is not None:
                raise BatchSizeError(
                    f"gradient_accumulation_steps: got {gas} alone, which does not fix the batch{why}; also give "
                    "train_micro_batch_size_per_gpu or train_batch_size"
                )
            raise BatchSizeError(
                f"train_batch_size: no batch size given{why}; set train_batch_size or train_micro_batch_size_per_gpu"
            )
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tbs, mbs, gas


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """JSON allows a key twice and keeps the last; DeepSpeed refuses, since one of the two was a mistake."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{key}: appears twice in one JSON object; keep one")
        out[key] = value
    return out


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config: the file {path!r} does not exist; pass a dict or the path of a DeepSpeed JSON file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config: {path!r} is not UTF-8 text; a DeepSpeed config is a JSON file") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {path!r} ({e.strerror or e}); check the path and its permissions") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        return _read_hjson(path, text, e)
    except ConfigError as e:
        raise ConfigError(f"config: in {path!r}, {e}") from None


def _read_hjson(path: str, text: str, error: json.JSONDecodeError) -> Any:
    """DeepSpeed reads its config files as HJSON (JSON plus comments, unquoted keys, trailing commas): so does this."""
    where = f"{error.msg} at line {error.lineno}, column {error.colno}"
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"config: {path!r} is not valid JSON ({where}); DeepSpeed also reads HJSON (comments, "
                          "unquoted keys), which needs the hjson package: pip install hjson") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"config: {path!r} is not valid JSON ({where}), nor HJSON, which DeepSpeed also reads "
                          f"({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ConfigError as e:
        raise ConfigError(f"config: in {path!r}, {e}") from None
