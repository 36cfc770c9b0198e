"""What hf_zero knows about ``peft`` models, without the engine: detection, adapter configs, which tensors.

A ``peft.PeftModel`` trains in the engine like any module (its frozen base is sharded at stage 3
with the rest, only the adapter parameters are trainable); saving is where it differs, and the
saves themselves live in :mod:`hf_zero.checkpoint.adapters`. This module is the part every layer
may ask: is this a PEFT model, what is its base, what do its ``adapter_config.json`` files say,
which saved names does peft give which model tensors, and a copy of the model on the meta device
(the twin that merges and the estimator build).

``peft`` is an optional dependency (``pip install 'hf_zero[peft]'``), imported only when needed:
a ``PeftModel`` cannot exist without it, so checking for one never imports it.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

import torch

from hf_zero.errors import UsageError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ADAPTER = "default"


def is_peft_model(module: Any) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (without importing peft: if it is not imported, it is not one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def require_peft(what: str) -> Any:
    """The ``peft`` module, or one sentence saying that ``what`` needs it and how to install it."""
    try:
        import peft
    except ImportError:
        raise UsageError(f"{what} needs the peft package, which is not installed; install it with "
                         "pip install 'hf_zero[peft]'") from None
    return peft


def adapter_dir(save_directory: str, adapter: str) -> str:
    """Where peft keeps one adapter of a folder: the folder itself for ``default``, else a sub-folder of its name."""
    return save_directory if adapter == DEFAULT_ADAPTER else os.path.join(save_directory, adapter)


def base_model_of(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a ``PeftModel`` (the module itself otherwise)."""
    return module.get_base_model() if is_peft_model(module) else module


# ----------------------------------------------------------------------------- adapter configs


def write_adapter_configs(model: Any, save_directory: str) -> None:
    """Each adapter's ``adapter_config.json``, as ``PeftModel.save_pretrained`` writes it.

    As peft does: the base model's ``name_or_path`` fills a missing ``base_model_name_or_path``,
    ``inference_mode`` is saved as true, and a config without a ``task_type`` records the base
    class (``auto_mapping``) so that ``AutoPeftModel`` can rebuild it. The live configs are not changed.
    """
    base = model.get_base_model()
    for adapter, live in model.peft_config.items():
        cfg = copy.deepcopy(live)
        if cfg.base_model_name_or_path is None:
            holder = model.base_model if cfg.is_prompt_learning else base
            cfg.base_model_name_or_path = holder.__dict__.get("name_or_path", None) or None
        cfg.inference_mode = True
        auto_mapping = None
        if cfg.task_type is None:
            cls = type(model.base_model if cfg.is_prompt_learning else base)
            auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        out = adapter_dir(save_directory, adapter)
        os.makedirs(out, exist_ok=True)
        cfg.save_pretrained(out, auto_mapping_dict=auto_mapping)


def read_adapter_configs(folder: str) -> dict[str, Any]:
    """``{adapter name: PeftConfig}`` of a folder written by :func:`write_adapter_configs` (empty if none)."""
    if not os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)):
        return {}
    peft = require_peft(f"reading the adapter config in {folder}")
    out = {DEFAULT_ADAPTER: peft.PeftConfig.from_pretrained(folder)}
    for name in sorted(os.listdir(folder)):
        sub = os.path.join(folder, name)
        if name != DEFAULT_ADAPTER and os.path.isfile(os.path.join(sub, ADAPTER_CONFIG)):
            out[name] = peft.PeftConfig.from_pretrained(sub)
    return out


# ----------------------------------------------------------------------------- which tensors


def adapter_plan(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, str]]]:
    """For each adapter, ``[(saved name, model name)]``: peft's choice of tensors, traced back to the model's names.

    ``get_peft_model_state_dict`` selects and renames entries of the state dict it is given
    without reading their values, so handing it the model's own tensors and matching the returned
    objects by identity tells which model tensor each saved name holds. A saved tensor that peft
    computes rather than selects (prompt-learning embeddings) maps to ``""``.
    """
    peft = require_peft("saving PEFT adapters")
    by_id: dict[int, str] = {}
    for name, t in state_dict.items():
        by_id.setdefault(id(t), name)
    plan = {}
    for adapter in model.peft_config:
        picked = peft.get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=adapter)
        plan[adapter] = [(key, by_id.get(id(t), "")) for key, t in picked.items()]
    return plan


def peft_values(model: Any, adapter: str) -> dict[str, torch.Tensor]:
    peft = require_peft("saving PEFT adapters")
    return peft.get_peft_model_state_dict(model, adapter_name=adapter)


def build_twin(base_cls: type, base_config: Any, adapters: dict[str, Any]) -> Any:
    """The same ``PeftModel`` built on the meta device: every module and name, no storage.

    Adapter weights are created with plain initialisation (a PiSSA/OLoRA/LoftQ init would read
    base weights that are not there); they are replaced by the real tensors anyway.
    """
    peft = require_peft("merging PEFT adapters")
    structural = {}
    for name, cfg in adapters.items():
        cfg = copy.deepcopy(cfg)
        for attr in ("init_lora_weights", "init_weights"):
            if hasattr(cfg, attr):
                setattr(cfg, attr, True)
        cfg.inference_mode = False
        structural[name] = cfg
    with torch.device("meta"):
        base = base_cls(copy.deepcopy(base_config))
        (first, cfg0), *rest = structural.items()
        twin = peft.get_peft_model(base, cfg0, adapter_name=first)
        for name, cfg in rest:
            twin.add_adapter(name, cfg)
    return twin


def twin_from_folder(path: str, adapters: dict[str, Any]) -> Any:
    import transformers

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UsageError(f"{path} has no config.json, so the base model cannot be rebuilt to merge the adapters into")
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise UsageError(
            f"{cfg_path} does not name a transformers model class in 'architectures' (got {arch!r}), so the base "
            "model cannot be rebuilt; set it to the class that was trained, e.g. [\"LlamaForCausalLM\"]"
        )
    return build_twin(cls, config, adapters)


def copy_adapter_config(src: str, dst: str) -> None:
    with open(os.path.join(src, ADAPTER_CONFIG), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["inference_mode"] = True
    tmp = os.path.join(dst, ADAPTER_CONFIG + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(dst, ADAPTER_CONFIG))
