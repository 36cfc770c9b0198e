"""DeepSpeed's ``DeepSpeedConfig`` and ``DeepSpeedConfigError`` (what ``deepspeed.runtime.config`` answers, through
:mod:`hf_zero.runtime.config`): a view of the parsed config under DeepSpeed's attribute names.

``DeepSpeedConfig(config, mpu=None, mesh_device=None)`` is what DeepSpeed's engine builds from the user's config
and what scripts, libraries and DeepSpeed's own tests build to ask how a config resolves: the batch triple
(``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel world size``,
any two giving the third), the ZeRO stage, the precision, the optimizer and scheduler. Here it is a view of
hf_zero's own parsed config (:class:`hf_zero.config.ZeroConfig`, the parser ``initialize`` uses), under DeepSpeed's
attribute names, so it answers what hf_zero will do with the config, never what a second parser thinks; a config
hf_zero refuses is refused here with the same sentence. An attribute DeepSpeed's class has and this view does not
raises AttributeError naming it and where its value is (``_param_dict``, the dict as given).

Every config hf_zero refuses raises :class:`hf_zero.errors.ConfigError` (a ``ValueError``), one sentence with the
JSON path; naming the class DeepSpeed's way lets ``except DeepSpeedConfigError`` (and
``pytest.raises(deepspeed.DeepSpeedConfigError)``) catch those refusals. Batch sizes that disagree raise
:class:`hf_zero.errors.BatchSizeError`, which is also an ``AssertionError``, as DeepSpeed's batch checks are.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
from typing import Any

import torch.distributed as dist

from hf_zero.config import ZeroConfig
from hf_zero.config.sections import FP16Config, ZeroOptimizationConfig
from hf_zero.errors import BatchSizeError, ConfigError

__all__ = ["ADAM_OPTIMIZER", "BatchSizeError", "DeepSpeedConfig", "DeepSpeedConfigError"]

DeepSpeedConfigError = ConfigError

# named for DeepSpeed's path, where users find it (``print`` logs here as it did before the move)
logger = logging.getLogger("hf_zero.runtime.config")

# DeepSpeed's optimizer names (runtime/config.py's DEEPSPEED_OPTIMIZERS): ``optimizer_name`` is lower-cased for these
ADAM_OPTIMIZER = "adam"
_DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")

# DeepSpeedZeroConfig's field names whose value hf_zero keeps under the stage3_ alias
_ZERO_FIELDS = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "param_persistence_threshold": "stage3_param_persistence_threshold",
                "max_live_parameters": "stage3_max_live_parameters"}


class ZeroSectionView:
    """``DeepSpeedConfig.zero_config``: hf_zero's parsed ``zero_optimization`` under DeepSpeedZeroConfig's field
    names too (``stage``, ``reduce_bucket_size``, ``offload_param``, ``prefetch_bucket_size`` = ``stage3_prefetch_
    bucket_size``, ...); a field hf_zero does not act on raises AttributeError naming it."""

    def __init__(self, section: ZeroOptimizationConfig) -> None:
        self._section = section

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        field = _ZERO_FIELDS.get(name, name)
        if hasattr(self._section, field):
            return getattr(self._section, field)
        raise AttributeError(f"zero_config.{name}: hf_zero does not act on zero_optimization.{name}, so its view of "
                             "the config has no such field; read it from DeepSpeedConfig._param_dict if you need it")

    def __repr__(self) -> str:
        return f"ZeroSectionView({self._section!r})"


def _read(config: str | os.PathLike | dict) -> dict:
    """The config as a dict: a dict as given (the same object, as DeepSpeed keeps it), a JSON/HJSON file, or the
    base64 of a JSON text (DeepSpeed's launcher passes configs that way)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"DeepSpeedConfig: got a {type(config).__name__}, expected a dict, the path of a JSON file "
                          "or a base64-encoded JSON text")
    path = os.fspath(config)
    if os.path.exists(path):
        from hf_zero.config import _read_json

        data = _read_json(path)
    else:
        try:
            data = json.loads(base64.urlsafe_b64decode(path).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise ConfigError(f"DeepSpeedConfig: {path!r} is neither an existing file nor a base64-encoded JSON "
                              "text; pass a dict or the path of a DeepSpeed JSON file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeedConfig: {path!r} does not hold a JSON object; a DeepSpeed config is one")
    return data


def _rank_and_world(config: ZeroConfig, mpu: Any, mesh_device: Any) -> tuple[int, int]:
    """This rank and the data-parallel world size the batch is split over, found as DeepSpeed finds them: the
    ``mpu``'s data-parallel size, else the mesh's ``data_parallel`` axis, else the world over the sequence-parallel
    degree; rank 0 of 1 before ``torch.distributed`` is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank = dist.get_rank()
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return rank, int(mpu.get_data_parallel_world_size())
        return rank, dist.get_world_size() // int(mpu.get_sequence_parallel_world_size())
    if mesh_device is not None:
        return rank, dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    world, sp = dist.get_world_size(), config.sequence_parallel_size
    if world % sp:
        raise ConfigError(f"sequence_parallel_size: got {sp}, which does not divide the world size {world}; choose "
                          "a divisor of the number of processes")
    return rank, world // sp


class DeepSpeedConfig:
    """DeepSpeed's config object: hf_zero's parsed config under DeepSpeed's attribute names (see the module's text).

    ``config`` is a dict (kept as ``_param_dict``, the same object), the path of a JSON or HJSON file, or a
    base64-encoded JSON text. The batch triple is resolved at once over the data-parallel world size (``mpu`` or
    ``mesh_device`` as DeepSpeed takes them); assigning any of the three and calling ``_configure_train_batch_size()``
    resolves them again, as DeepSpeed's tests do.
    """

    def __init__(self, config: str | os.PathLike | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict = _read(config)
        self._config = ZeroConfig.load(self._param_dict)  # the parser initialize uses: the same refusals
        self.global_rank, self.world_size = _rank_and_world(self._config, mpu, mesh_device)
        self._configure_train_batch_size()

    # -------------------------------------------------------------- the batch triple (assignable, as in DeepSpeed)

    @property
    def train_batch_size(self) -> int | None:
        return self._config.train_batch_size

    @train_batch_size.setter
    def train_batch_size(self, value: int | None) -> None:
        self._config.train_batch_size = value

    @property
    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._config.train_micro_batch_size_per_gpu

    @train_micro_batch_size_per_gpu.setter
    def train_micro_batch_size_per_gpu(self, value: int | None) -> None:
        self._config.train_micro_batch_size_per_gpu = value

    @property
    def gradient_accumulation_steps(self) -> int | None:
        return self._config.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int | None) -> None:
        self._config.gradient_accumulation_steps = value

    def _configure_train_batch_size(self) -> None:
        """Derive the missing batch sizes from the others and check that the three agree (DeepSpeed's name).

        Raises :class:`hf_zero.errors.BatchSizeError` (a ``ConfigError`` and an ``AssertionError``) when they
        cannot: the arithmetic is :meth:`hf_zero.config.ZeroConfig.resolve_batch_sizes`, the one initialize runs.
        """
        self._config.resolve_batch_sizes(self.world_size)

    # -------------------------------------------------------------------------------------- read-only answers

    @property
    def zero_config(self) -> ZeroSectionView:
        return ZeroSectionView(self._config.zero_optimization)

    @property
    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        return self._config.zero_optimization.stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    @property
    def float16_config(self) -> FP16Config:
        """hf_zero's parsed ``fp16`` section (DeepSpeed's field names: ``enabled``, ``loss_scale``, ...)."""
        return self._config.fp16

    @property
    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    @property
    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    @property
    def optimizer_name(self) -> str | None:
        opt = self._config.optimizer
        if opt is None:
            return None
        return opt.type.lower() if opt.type.lower() in _DEEPSPEED_OPTIMIZERS else opt.type

    @property
    def optimizer_params(self) -> dict | None:
        return None if self._config.optimizer is None else self._config.optimizer.params

    @property
    def scheduler_name(self) -> str | None:
        return None if self._config.scheduler is None else self._config.scheduler.type

    @property
    def scheduler_params(self) -> dict | None:
        return None if self._config.scheduler is None else self._config.scheduler.params

    @property
    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    @property
    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    @property
    def communication_data_type(self) -> str | None:
        return self._config.communication_data_type

    @property
    def sequence_parallel_size(self) -> int:
        return self._config.sequence_parallel_size

    @property
    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint_tag_validation.lower() != "ignore"

    @property
    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint_tag_validation.lower() == "fail"

    def __getattr__(self, name: str) -> Any:
        # only reached for names the view does not define
        if name.startswith("__") or name in ("_config", "_param_dict"):
            raise AttributeError(name)
        raise AttributeError(f"DeepSpeedConfig.{name}: hf_zero's DeepSpeedConfig is a view of the config keys hf_zero "
                             f"acts on and has no {name!r}; read the key from ._param_dict (the config as given)")

    # ------------------------------------------------------------------------------------------------ printing

    def print_user_config(self) -> None:
        logger.info("  json = %s", json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        """Log every attribute of the view and the user's config, as DeepSpeed's engine does at start."""
        logger.info("%s:", name)
        names = sorted(n for n, v in vars(type(self)).items() if isinstance(v, property)) + ["global_rank", "world_size"]
        for attr in sorted(names):
            logger.info("  %s %s %s", attr, "." * (29 - len(attr)), getattr(self, attr))
        self.print_user_config()
