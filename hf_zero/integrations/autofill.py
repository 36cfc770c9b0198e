"""The ``zero_config`` of a Trainer or Accelerate run: read, checked at once, and its ``"auto"`` filled.

transformers (``HfTrainerDeepSpeedConfig``) and Accelerate (``DeepSpeedPlugin`` and
``_prepare_deepspeed``) fill a DeepSpeed config's ``"auto"`` values from the training arguments,
the Accelerator and the objects handed to ``prepare()``. hf_zero does the same here, once for
both integrations, so a config resolves identically under ``hf_zero.Trainer`` and a plain
``hf_zero.Accelerator`` loop:

- :func:`load_zero_config` reads a path or dict and runs hf_zero's own parser on it right away, so
  a misspelt key or a feature hf_zero lacks (offload, ...) stops the script when
  ``TrainingArguments`` or ``Accelerator`` is built, on every rank, before any model is loaded;
- :func:`fill_precision` (``bf16``/``fp16`` ``"enabled"``), :func:`fill_bucket_autos` (sizes from
  the model's hidden size) and :func:`fill_auto` (the Trainer's batch, clipping and optimizer keys);
- :func:`fill_dummy_optimizer` / :func:`fill_dummy_scheduler`: what Accelerate takes from
  ``accelerate.utils.DummyOptim`` / ``DummyScheduler`` when the config's sections build them.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from typing import Any

import torch

from hf_zero.config import ZeroConfig
from hf_zero.engine import UsageError

ENV_VAR = "HF_ZERO_CONFIG"
AUTO = "auto"
BF16_ALIAS = "bfloat16"  # DeepSpeed's older name of the bf16 section
MIN_AUTO_REDUCE_BUCKET = 25_000_000  # elements; 50 MB in bf16, twice DDP's default bucket


# ------------------------------------------------------------------ reading and checking


def load_zero_config(zero_config: str | os.PathLike | dict | None) -> dict | None:
    """The config as a dict (a path is read as JSON), already checked; ``None`` falls back to ``$HF_ZERO_CONFIG``.

    The check is hf_zero's parser with ``"auto"`` allowed where transformers fills it, plus one
    trial build of the ``optimizer`` / ``scheduler`` sections, so their parameter names and values
    are checked too; it raises :class:`hf_zero.ConfigError` (one sentence with the JSON path).
    """
    if zero_config is None:
        zero_config = os.environ.get(ENV_VAR) or None
    if zero_config is None:
        return None
    if isinstance(zero_config, dict):
        config, where = copy.deepcopy(zero_config), "(dict)"
    else:
        path = os.fspath(zero_config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"zero_config: {path} does not exist; pass a DeepSpeed-style JSON file or a dict")
        with open(path) as f:
            config, where = json.load(f), path
    if isinstance(config, dict) and config.get("pipeline"):
        raise UsageError(
            f"zero_config {where} has a pipeline section, but Trainer/Accelerator train the model unsplit; "
            "run pipelines with hf_zero.initialize(model=hf_zero.pipe.split_causal_lm(...)) and engine.train_batch, "
            "or remove the section"
        )
    parse_once(config)
    return config


def parse_once(config: dict) -> ZeroConfig:
    """``ZeroConfig.load`` of a copy of ``config`` (its parser names each ignored key once per process).

    The sections ``optimizer`` and ``scheduler`` are also built once on a stand-in parameter (with
    their ``"auto"`` values left to their defaults), so that a wrong parameter name fails here
    rather than when the Trainer creates the optimizer after loading the model.
    """
    parsed = ZeroConfig.load(copy.deepcopy(config))
    _try_sections(parsed)
    return parsed


def _try_sections(parsed: ZeroConfig) -> None:
    if parsed.optimizer is None and parsed.scheduler is None:
        return
    from hf_zero.optim.optimizers import build_optimizer
    from hf_zero.optim.schedules import build_scheduler

    stand_in = torch.nn.Parameter(torch.zeros(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. total_num_steps < warmup_num_steps: said again when really built
        if parsed.optimizer is not None:
            opt = build_optimizer(parsed.optimizer.type, parsed.optimizer.params, [stand_in])
        else:
            opt = torch.optim.SGD([stand_in], lr=1e-3)
        if parsed.scheduler is not None:
            params = dict(parsed.scheduler.params)
            if parsed.scheduler.type != "WarmupLR" and "total_num_steps" not in params:
                warm = params.get("warmup_num_steps", 1000)
                params["total_num_steps"] = (warm if isinstance(warm, int) and not isinstance(warm, bool) else 1000) + 2
            build_scheduler(parsed.scheduler.type, params, opt)


# ------------------------------------------------------------------ precision and buckets


def fill_precision(cfg: dict, bf16: bool, fp16: bool, *, must_match: bool) -> list[str]:
    """``bf16``/``fp16`` ``"enabled": "auto"`` from the run's precision, in place; returns the contradictions.

    ``must_match`` is transformers' rule (the Trainer): an explicit value that differs from the
    training arguments is a contradiction. Otherwise Accelerate's: an explicit value wins, and
    only enabling the other 16-bit type than the Accelerator's ``mixed_precision`` contradicts it.
    A precision that is on but has no section gets one, as both do.
    """
    contradictions = []
    for key, on in (("bf16", bf16), ("fp16", fp16)):
        name = BF16_ALIAS if key == "bf16" and BF16_ALIAS in cfg and key not in cfg else key
        section = cfg.get(name)
        if not isinstance(section, dict):
            if on:
                cfg[name] = {"enabled": True}
            continue
        have = section.get("enabled", False)
        if have == AUTO:
            cfg[name] = dict(section, enabled=on)
        elif bool(have) != on and (must_match or (bool(have) and (bf16 or fp16))):
            contradictions.append(f"{name}.enabled: config has {have}, the run has {key} {'on' if on else 'off'}")
    return contradictions


def fill_bucket_autos(cfg: dict, model: torch.nn.Module) -> None:
    """``"auto"`` bucket sizes from the model's hidden size, by the rule transformers uses for DeepSpeed,
    except that a gradient bucket is never under :data:`MIN_AUTO_REDUCE_BUCKET` elements.

    transformers' ``hidden_size**2`` gives a BERT-large 1M-element buckets: ~330 reduce-scatters and
    all-gathers per step, each paying launch latency and a hook's Python, which made ZeRO-2 run at
    0.46x of DDP in ``benchmarks/bench_finetune.py`` on 2 H200s. The floor keeps buckets in the tens of MB
    DDP uses, while large models (hidden 8192: 67M) keep transformers' value.
    """
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict):
        return
    mc = getattr(model, "config", None)
    hidden = getattr(mc, "hidden_size", None) or max(getattr(mc, "hidden_sizes", None) or [0]) or None
    rules = {
        "reduce_bucket_size": lambda h: max(h * h, MIN_AUTO_REDUCE_BUCKET),
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    zo = dict(zo)
    for key, rule in rules.items():
        if zo.get(key) == AUTO:
            if hidden is None:
                raise UsageError(
                    f"zero_optimization.{key} is \"auto\" but the model has no config.hidden_size to derive it from; "
                    "set it to a number"
                )
            zo[key] = rule(int(hidden))
    cfg["zero_optimization"] = zo


# ------------------------------------------------------------------ the Trainer


def fill_auto(config: dict, args: Any, world_size: int) -> dict:
    """The engine's config for a Trainer run, with ``"auto"`` taken from the training arguments.

    The Trainer divides the loss for gradient accumulation and decides where steps happen, so the
    engine runs with one micro-step per step (``gradient_accumulation_steps`` 1) and clips at
    whatever ``clip_grad_norm_`` asks; the config's batch keys are checked against the arguments.
    The ``optimizer`` and ``scheduler`` sections are checked here and left out of the result: the
    Trainer builds them itself (``create_optimizer`` / ``create_scheduler``) and steps the scheduler.
    """
    cfg = copy.deepcopy(config)
    mismatches = []

    def check(key: str, want: Any, arg: str) -> None:
        have = cfg.get(key, AUTO)
        if have != AUTO and have is not None and have != want:
            mismatches.append(f"{key}: config has {have}, TrainingArguments has {want} (--{arg})")

    gas = int(args.gradient_accumulation_steps)
    micro = int(args.per_device_train_batch_size)
    check("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    check("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    check("train_batch_size", micro * gas * world_size, "per_device_train_batch_size x gradient_accumulation_steps x world size")
    check("gradient_clipping", float(args.max_grad_norm), "max_grad_norm")
    params = (cfg.get("optimizer") or {}).get("params")
    if isinstance(params, dict):
        for key, want, arg in optimizer_args(args):
            have = params.get(key, AUTO)
            if have != AUTO and (list(have) if isinstance(have, (list, tuple)) else have) != want:
                mismatches.append(f"optimizer.params.{key}: config has {have}, TrainingArguments has {want} (--{arg})")
    sched = (cfg.get("scheduler") or {}).get("params")
    if isinstance(sched, dict) and sched.get("warmup_max_lr", AUTO) not in (AUTO, args.learning_rate):
        mismatches.append(f"scheduler.params.warmup_max_lr: config has {sched['warmup_max_lr']}, TrainingArguments has "
                          f"{args.learning_rate} (--learning_rate)")
    # mixed_precision fp8 (accelerate launch --mixed_precision fp8, read by TrainingArguments from the environment)
    # trains over bf16, as Accelerate's DeepSpeed plugin sets it; the Accelerator adds the fp8 section at prepare
    fp8 = getattr(args, "mixed_precision", None) == "fp8"
    bf16, fp16 = bool(args.bf16 or args.bf16_full_eval or fp8), bool(args.fp16 or args.fp16_full_eval)
    mismatches += [f"{m} (--bf16/--fp16)" for m in fill_precision(cfg, bf16, fp16, must_match=True)]
    if mismatches:
        raise UsageError("zero_config contradicts the training arguments: " + "; ".join(mismatches))
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("train_batch_size", None)
    cfg["gradient_clipping"] = 0.0  # the Trainer clips through accelerator.clip_grad_norm_
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    return cfg


def optimizer_args(args: Any) -> list[tuple[str, Any, str]]:
    """The ``optimizer.params`` keys transformers fills from ``TrainingArguments``: (key, value, flag)."""
    return [("lr", args.learning_rate, "learning_rate"), ("weight_decay", args.weight_decay, "weight_decay"),
            ("betas", [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2"), ("eps", args.adam_epsilon, "adam_epsilon")]


def trainer_scheduler_params(section: dict, args: Any, num_training_steps: int) -> dict:
    """``scheduler.params`` with transformers' fills: "auto" becomes the Trainer's value; a contradiction raises."""
    params = dict(section.get("params") or {})
    fills = {
        "warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate,
        # deepspeed>=0.19.6 refuses warmup_num_steps 0, so transformers keeps it positive
        "warmup_num_steps": max(1, args.get_warmup_steps(num_training_steps)), "total_num_steps": num_training_steps,
    }
    mismatches = []
    for key, value in fills.items():
        have = params.get(key)
        if have == AUTO:
            params[key] = value
        elif key != "warmup_min_lr" and have is not None and have != value:
            # an explicit step count the arguments contradict would warm up or decay over a run nobody asked for
            flag = {"warmup_max_lr": "learning_rate", "warmup_num_steps": "warmup_steps"}.get(key, "max_steps/num_train_epochs")
            mismatches.append(f"scheduler.params.{key}: config has {have}, the Trainer computed {value} (--{flag})")
    if mismatches:
        raise UsageError("zero_config contradicts the training arguments: " + "; ".join(mismatches))
    return params


# ------------------------------------------------------------------ Accelerate's DummyOptim / DummyScheduler


def fill_dummy_optimizer(cfg: dict, dummy: Any) -> None:
    """``optimizer.params`` "auto" lr and weight_decay from a ``DummyOptim``, as Accelerate fills them."""
    params = cfg["optimizer"].setdefault("params", {})
    for key, value in (("lr", dummy.lr), ("weight_decay", dummy.weight_decay)):
        if params.get(key) == AUTO:
            params[key] = value


def fill_dummy_scheduler(cfg: dict, dummy: Any, max_lr: float | None, num_processes: int, split_batches: bool) -> None:
    """``scheduler.params`` "auto" values from a ``DummyScheduler``, as Accelerate fills them.

    Accelerate divides ``total_num_steps`` by the number of processes (unless ``split_batches``):
    a loop counts its steps from the unsharded loader's length before ``prepare``.
    """
    params = cfg["scheduler"].setdefault("params", {})
    fills = {"warmup_min_lr": 0, "warmup_max_lr": max_lr, "warmup_num_steps": max(1, int(dummy.warmup_num_steps or 0))}
    if dummy.total_num_steps is not None:
        total = int(dummy.total_num_steps)
        fills["total_num_steps"] = total if split_batches else math.ceil(total / num_processes)
    for key, value in fills.items():
        if params.get(key) == AUTO and value is not None:
            params[key] = value
