"""``from_pretrained`` under ``zero.Init``: every rank reads only its slices of the safetensors files.

The model's skeleton is built with its parameters on ``meta`` (buffers real, so rotary tables and
the like are computed as usual), then each parameter's checkpoint tensor is located and the
flat range this rank owns is read through safetensors' lazy slices — whole rows around the range,
never the whole tensor. Parameters the checkpoint lacks are initialised by the model's own
``_init_weights`` on rank 0 and broadcast, as transformers initialises missing weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.precision.policies import dtype_by_name
from hf_zero.zero.gathered import GatheredParameters
from hf_zero.zero.preshard import is_presharded, preshard_, shard_bounds

logger = logging.getLogger("hf_zero")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
#: What a user learns from reading the last load (tests check each rank read only its slices).
LAST_LOAD_STATS: dict[str, int] = {}

_UNSUPPORTED = (
    "device_map", "quantization_config", "load_in_8bit", "load_in_4bit", "tp_plan", "tp_size", "gguf_file",
    "state_dict", "from_tf", "from_flax", "max_memory", "offload_folder", "offload_state_dict", "adapter_name",
    "adapter_kwargs", "key_mapping", "device_mesh",
)
_HUB_KEYS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")


def _resolve_folder(path: str | os.PathLike, hub: dict[str, Any]) -> str:
    """A local folder as is; otherwise the config and safetensors files of a Hub repo, downloaded."""
    path = os.fspath(path)
    subfolder = hub.get("subfolder") or ""
    if os.path.isdir(path):
        return os.path.join(path, subfolder) if subfolder else path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors"]
    if subfolder:
        patterns = [f"{subfolder}/{p}" for p in patterns]
    local = snapshot_download(
        path,
        revision=hub.get("revision"),
        cache_dir=hub.get("cache_dir"),
        token=hub.get("token"),
        local_files_only=bool(hub.get("local_files_only")),
        force_download=bool(hub.get("force_download")),
        proxies=hub.get("proxies"),
        allow_patterns=patterns,
    )
    return os.path.join(local, subfolder) if subfolder else local


def _weight_map(folder: str) -> dict[str, str]:
    """Checkpoint key -> safetensors file, for a single file or a sharded checkpoint."""
    index = os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, SAFE_WEIGHTS)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as h:
            return dict.fromkeys(h.keys(), single)
    if any(n.endswith(".bin") for n in os.listdir(folder)):
        raise ValueError(
            f"{folder} holds only pickle (.bin) weights; hf_zero.zero.Init loads safetensors only: "
            "convert the checkpoint with save_pretrained(..., safe_serialization=True)"
        )
    raise FileNotFoundError(f"{folder} has no {SAFE_WEIGHTS} or {SAFE_INDEX}; pass a folder written by save_pretrained")


def read_flat_range(handle: Any, key: str, lo: int, hi: int) -> tuple[torch.Tensor, int]:
    """Elements ``lo:hi`` of the flattened tensor ``key``, and how many elements were read for them."""
    sl = handle.get_slice(key)
    shape = sl.get_shape()
    if hi <= lo:
        return torch.empty(0), 0
    if len(shape) <= 1:
        t = sl[lo:hi]
        return t.reshape(-1), t.numel()
    row = math.prod(shape[1:])
    r0, r1 = lo // row, math.ceil(hi / row)
    t = sl[r0:r1].reshape(-1)
    return t[lo - r0 * row : hi - r0 * row], t.numel()


def _candidates(name: str, prefix: str) -> list[str]:
    """Checkpoint keys a parameter may be stored under (with or without the base-model prefix)."""
    out = [name]
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        else:
            out.append(f"{prefix}.{name}")
    return out


def _pop_options(where: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the loading options out of ``kwargs`` (refusing what Init cannot honour); what stays is for the config."""
    adapter = kwargs.get("adapter_kwargs") or {}
    if "_adapter_model_path" not in adapter:
        # with peft installed, transformers' Auto classes pass adapter_kwargs (a revision, a token) on every
        # load; only a folder that holds an adapter (they then add its path) asks for something
        kwargs.pop("adapter_kwargs", None)
    for key in _UNSUPPORTED:
        if kwargs.get(key) not in (None, False):
            raise ValueError(f"{where}: {key}= is not supported under hf_zero.zero.Init; leave it unset")
        kwargs.pop(key, None)
    for key in ("low_cpu_mem_usage", "use_safetensors", "_fast_init", "weights_only", "mirror"):
        kwargs.pop(key, None)
    dtype, torch_dtype = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    return {
        "hub": {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs},
        "trust_remote_code": kwargs.pop("trust_remote_code", None),
        "dtype": dtype if dtype is not None else torch_dtype,
        "attn": kwargs.pop("attn_implementation", None),
        "config": kwargs.pop("config", None),
    }


def _load_config(folder: str, config: Any, trust_remote_code: Any, kwargs: dict[str, Any], where: str) -> Any:
    """The model config: the one given (keyword arguments override its attributes, as in transformers) or the folder's."""
    from transformers import AutoConfig

    if config is None:
        config, unused = AutoConfig.from_pretrained(
            folder, return_unused_kwargs=True, trust_remote_code=trust_remote_code, **kwargs
        )
    else:
        unused = {}
        for k, v in kwargs.items():
            if hasattr(config, k):
                setattr(config, k, v)
            else:
                unused[k] = v
    if unused:
        raise ValueError(f"{where}: unexpected keyword arguments {sorted(unused)}; they are neither config attributes nor loading options")
    return config


def _model_dtype(dtype: Any, config: Any, weight_map: dict[str, str], handle: Any, init: Any) -> torch.dtype:
    """Init's dtype, else the one asked for, else (``"auto"``/None) the config's or the checkpoint's first tensor's."""
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            key, file = next(iter(weight_map.items()))
            name = handle(file).get_slice(key).get_dtype()
            dtype = dtype_by_name(name) if name in ("F32", "BF16", "F16") else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return init.dtype if init.dtype is not None else dtype


def _read_slices(model: torch.nn.Module, weight_map: dict[str, str], handle: Any, init: Any, where: str) -> dict[str, Any]:
    """Give every parameter this rank's slice from the files (zeros where missing) and the buffers their values.

    Returns the missing parameters' ids and first names, the checkpoint keys used, and how many
    elements were read for how many the checkpoint's parameters hold.
    """
    group, device = init.group, init.slice_device
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    prefix = getattr(model, "base_model_prefix", "") or ""
    aliases: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    out: dict[str, Any] = {"missing": {}, "used": set(), "read": 0, "total": 0}
    for pid, p in params.items():
        key = next((c for n in aliases[pid] for c in _candidates(n, prefix) if c in weight_map), None)
        lo, hi, k = shard_bounds(p.numel(), world, rank)
        shard = torch.zeros(k, dtype=p.dtype, device=device)
        if key is None:
            out["missing"][pid] = aliases[pid][0]
        else:
            out["used"].add(key)
            h = handle(weight_map[key])
            got_shape = tuple(h.get_slice(key).get_shape())
            if got_shape != tuple(p.shape):
                raise ValueError(
                    f"{where}: checkpoint tensor '{key}' has shape {got_shape} but the model's "
                    f"'{aliases[pid][0]}' has shape {tuple(p.shape)}; the config does not match the weights"
                )
            values, n = read_flat_range(h, key, lo, hi)
            shard[: hi - lo].copy_(values)
            out["read"] += n
            out["total"] += p.numel()
            p._is_hf_initialized = True  # transformers' init functions leave loaded weights alone
        preshard_(p, shard, group)
    for name, b in model.named_buffers():
        c = next((c for c in _candidates(name, prefix) if c in weight_map), None)
        if c is not None:
            b.copy_(handle(weight_map[c]).get_tensor(c))
            out["used"].add(c)
    return out


def from_pretrained_sharded(cls: type, init: Any, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
    """``cls.from_pretrained`` as it runs inside ``hf_zero.zero.Init``."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import GenerationConfig

    where = f"from_pretrained({str(pretrained_model_name_or_path)!r})"
    if model_args:
        raise ValueError(f"{where} under hf_zero.zero.Init takes no positional model arguments; pass a config instead")
    opts = _pop_options(where, kwargs)
    folder = _resolve_folder(pretrained_model_name_or_path, opts["hub"])
    config = _load_config(folder, opts["config"], opts["trust_remote_code"], kwargs, where)
    weight_map = _weight_map(folder)
    handles: dict[str, Any] = {}

    def handle(file: str) -> Any:
        if file not in handles:
            handles[file] = safe_open(file, framework="pt", device="cpu")
        return handles[file]

    dtype = _model_dtype(opts["dtype"], config, weight_map, handle, init)
    extra = {} if opts["attn"] is None else {"attn_implementation": opts["attn"]}
    init.skeleton = True
    try:
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(config, dtype=dtype, **extra)
    finally:
        init.skeleton = False
    with torch.no_grad():
        got = _read_slices(model, weight_map, handle, init, where)
    LAST_LOAD_STATS.clear()
    LAST_LOAD_STATS.update({"elements_read": got["read"], "elements_in_checkpoint_params": got["total"],
                            "world_size": dist.get_world_size(init.group)})
    if got["missing"]:
        logger.warning("%s: weights not in the checkpoint, newly initialised: %s", where, ", ".join(got["missing"].values()))
        _init_missing(model, init, set(got["missing"]))
    unexpected = sorted(set(weight_map) - got["used"])
    if unexpected:
        logger.warning("%s: checkpoint weights the model does not use: %s", where, ", ".join(unexpected[:20]))
    if os.path.isfile(os.path.join(folder, "generation_config.json")) and getattr(model, "generation_config", None) is not None:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()
    return model


def _init_missing(model: torch.nn.Module, init: Any, missing_ids: set[int]) -> None:
    """Initialise only the parameters the checkpoint lacked, module by module, from rank 0."""
    from transformers import PreTrainedModel

    rank = dist.get_rank(init.group)

    def visit(mod: torch.nn.Module, owner: PreTrainedModel) -> None:
        for child in mod.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        own = [p for p in mod.parameters(recurse=False) if id(p) in missing_ids and is_presharded(p)]
        if own:
            with torch.no_grad(), GatheredParameters(own, modifier_rank=0):
                if rank == 0:
                    owner._init_weights(mod)

    visit(model, model)  # type: ignore[arg-type]
