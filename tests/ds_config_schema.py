"""DeepSpeed's config schema, read from DeepSpeed itself: run with DeepSpeed's interpreter (tests/dsenv.py).

``python -m tests.ds_config_schema [CONFIGS.json]`` prints one JSON object: ``keys`` ({path: how}), every
config key DeepSpeed 0.19.8 knows, as a dotted path (``zero_optimization.offload_param.nvme_path``),
with how it was found:

- ``read``: a key :class:`deepspeed.runtime.config.DeepSpeedConfig` looks up while parsing. The
  config given to it is a dict that records every lookup (``get``, ``in``, ``[]``), so the top-level
  keys and the keys of the sections DeepSpeed reads by hand (``activation_checkpointing``,
  ``checkpoint``, ``flops_profiler``, ...) come from DeepSpeed's own code, not from a list here;
- ``field``: a field of one of DeepSpeed's pydantic models (``DeepSpeedZeroConfig``, ...), found by
  walking the models the parsed config holds, nested models included; its alias is listed too.

``aliases`` maps each pydantic alias to its field (``stage3_prefetch_bucket_size`` ->
``prefetch_bucket_size``), ``renamed`` each deprecated field to the one replacing it. ``closed`` maps
the path of every section DeepSpeed validates with a pydantic model whose ``model_config`` forbids
extra keys (``extra="forbid"``: an unknown key there is pydantic's ``extra_forbidden`` error) to the
names that model takes (fields and aliases); ``open`` lists the models that do not forbid extras
(none in 0.19.8, but a model that changes its policy must show). ``removed`` is DeepSpeed's own table
of the keys it refuses on sight (features it removed: ``curriculum_learning``, ``amp``, ...), path to
its message. Given a JSON file of ``{name: config}``, ``verdicts`` holds DeepSpeedConfig's verdict on
each: "ok" or its error.

Nothing here imports hf_zero; the test compares the result with hf_zero's tables
(tests/test_ds_config_oracle.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# DeepSpeedConfig attributes that hold pydantic models, and the config path each one parses.
# A model attribute missing here fails the probe, so a section DeepSpeed adds cannot go unseen.
MODEL_SECTIONS = {
    "zero_config": "zero_optimization",
    "float16_config": "fp16",
    "bfloat16_config": "bf16",
    "monitor_config": "",  # its fields (tensorboard, wandb, csv_monitor, comet) are top-level sections
    "hybrid_engine": "hybrid_engine",
    "compile_config": "compile",
    "timers_config": "timers.throughput",
    "tensor_parallel_config": "tensor_parallel",
    "expert_parallel_config": "expert_parallel",
}
# Sections whose model is built only when the section is present.
OPTIONAL_MODELS = {
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "weight_quantization": ("deepspeed.inference.config", "WeightQuantConfig"),
}


class Recorder(dict):
    """A dict that records the keys looked up in it, and hands out recorders for the sections it holds."""

    seen: dict[str, str] = {}

    def __init__(self, *args: Any, path: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path

    def _note(self, key: Any) -> None:
        if isinstance(key, str):
            Recorder.seen.setdefault(f"{self.path}.{key}" if self.path else key, "read")

    def __contains__(self, key: Any) -> bool:
        self._note(key)
        return super().__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def keys(self) -> Any:
        outer = self

        class Keys(set):
            def __contains__(self, key: Any) -> bool:
                outer._note(key)
                return set.__contains__(self, key)

        return Keys(super().keys())

    def __copy__(self) -> Recorder:
        return Recorder(self, path=self.path)


def _parse(config: dict) -> Any:
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)


def read_keys() -> None:
    """Every key DeepSpeedConfig looks up: at the top, then inside each top-level key given as a section."""
    base = {"train_micro_batch_size_per_gpu": 1}
    _parse(Recorder(base))
    top = [k for k in Recorder.seen if "." not in k]
    for key in top:
        if key in base:
            continue
        try:  # as a section: the keys DeepSpeed reads inside it (most sections read with defaults)
            _parse(Recorder({**base, key: Recorder(path=key)}))
        except Exception:  # a scalar key, a removed feature, a section that needs content: nothing to learn
            continue
    for path in [k for k in Recorder.seen if k.count(".") == 1]:
        section, key = path.split(".")
        try:
            _parse(Recorder({**base, section: Recorder({key: Recorder(path=path)}, path=section)}))
        except Exception:
            continue


def model_fields(model_cls: Any, path: str, out: dict, aliases: dict, renamed: dict, closed: dict, open_: list) -> None:
    """The fields of a pydantic model (and of the models nested in it) as dotted paths; its extras policy."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    if path:  # DeepSpeedMonitorConfig (path "") is built from four named keys, not from the top level
        names = sorted({*model_cls.model_fields, *(i.alias for i in model_cls.model_fields.values() if i.alias)})
        if model_cls.model_config.get("extra") == "forbid":
            closed[path] = names
        else:
            open_.append(f"{path} ({model_cls.__name__}: extra={model_cls.model_config.get('extra')!r})")
    for name, info in model_cls.model_fields.items():
        full = f"{path}.{name}" if path else name
        out[full] = "field"
        if info.alias and info.alias != name:
            alias = f"{path}.{info.alias}" if path else info.alias
            out[alias] = "field"
            aliases[alias] = full
        extra = info.json_schema_extra or {}
        if isinstance(extra, dict) and extra.get("deprecated") and extra.get("new_param"):
            renamed[full] = f"{path}.{extra['new_param']}" if path else extra["new_param"]
        for sub in _models_in(info.annotation):
            if issubclass(sub, DeepSpeedConfigModel):
                model_fields(sub, full, out, aliases, renamed, closed, open_)


def _models_in(annotation: Any) -> list:
    """The classes an annotation names, through Optional[...] and friends."""
    import typing

    args = typing.get_args(annotation)
    if not args:
        return [annotation] if isinstance(annotation, type) else []
    return [c for a in args for c in _models_in(a)]


def all_fields() -> tuple[dict, dict, dict, dict, list]:
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    fields: dict[str, str] = {}
    aliases: dict[str, str] = {}
    renamed: dict[str, str] = {}
    closed: dict[str, list[str]] = {}
    open_: list[str] = []
    parsed = _parse({"train_micro_batch_size_per_gpu": 1})
    for attr, value in vars(parsed).items():
        if isinstance(value, DeepSpeedConfigModel):
            if attr not in MODEL_SECTIONS:
                raise SystemExit(f"DeepSpeedConfig.{attr} is a {type(value).__name__} this probe does not map to a section")
            model_fields(type(value), MODEL_SECTIONS[attr], fields, aliases, renamed, closed, open_)
    for section, (module, name) in OPTIONAL_MODELS.items():
        model_fields(getattr(__import__(module, fromlist=[name]), name), section, fields, aliases, renamed, closed, open_)
    return fields, aliases, renamed, closed, open_


def removed_keys() -> dict[str, str]:
    """DeepSpeed's tables of removed keys, refused on sight by ``_reject_removed_config_keys``: {path: message}."""
    from deepspeed.runtime import config

    out = dict(config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    out.update({f"zero_optimization.{k}": v for k, v in config._REMOVED_ZERO_CONFIG_KEYS.items()})
    return out


def pipeline_keys() -> list[str]:
    """``pipeline`` is a free dict in DeepSpeedConfig; its keys are those of DeepSpeed's default."""
    from deepspeed.runtime.config import get_pipeline_config

    return [f"pipeline.{k}" for k in get_pipeline_config({})]


def verdicts(configs: dict[str, dict]) -> dict[str, str]:
    """DeepSpeedConfig's verdict on each config: "ok", or the exception it raised."""
    out = {}
    for name, config in configs.items():
        try:
            _parse(config)
            out[name] = "ok"
        except Exception as e:  # any refusal is a verdict: pydantic's, an assertion, DeepSpeedConfigError
            out[name] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    import socket

    with socket.socket() as s:  # a free port for the one-process group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # so DeepSpeedConfig reads sequence_parallel_size
    read_keys()
    keys: dict[str, str] = dict(Recorder.seen)
    fields, aliases, renamed, closed, open_ = all_fields()
    for path, how in fields.items():
        keys.setdefault(path, how)
    for path in pipeline_keys():
        keys.setdefault(path, "read")
    configs = json.loads(open(sys.argv[1]).read()) if len(sys.argv) > 1 else {}
    out = {"keys": keys, "aliases": aliases, "renamed": renamed, "closed": closed, "open": open_,
           "removed": removed_keys(), "verdicts": verdicts(configs)}
    sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
