"""The config keys of sequence parallelism and the long-sequence memory savers.

DeepSpeed's top-level ``"sequence_parallel_size": N`` (what its ALST reads) sets the degree.
hf_zero's own switches live in a ``"sequence_parallel"`` section, the name LLaMA-Factory already
writes into DeepSpeed configs; its keys are read too::

    "sequence_parallel_size": 4,
    "sequence_parallel": {
        "tiled_loss": "auto",        # LM head + cross-entropy in tiles (auto: on when sequence_parallel_size > 1)
        "loss_tile_tokens": "auto",  # tokens per loss tile (auto: 1 GiB of fp32 logits)
        "tiled_mlp": false,          # each block's MLP in tiles of the sequence (costs one more MLP forward)
        "mlp_tile_tokens": "auto",   # tokens per MLP tile (auto: the hidden size)
        # LLaMA-Factory's keys:
        "enabled": true, "size": 4, "mode": "ulysses", "ulysses": {"degree": 4, "seq_length_is_variable": true},
        "tiling": {"enabled": true, "chunk_size": 8192},  # = tiled_mlp and tiled_loss, chunk_size tokens per tile
        "memory_optimizations": {...}                     # LLaMA-Factory's own: named in the warning of unknown keys
    }

The tiled loss costs no extra arithmetic (its gradients are computed in forward, see
:mod:`hf_zero.sequence.loss`) and is on whenever SP is; the tiled MLP recomputes the MLP and is
off unless asked for. Keeping checkpointed block inputs in host memory is DeepSpeed's
``activation_checkpointing.cpu_checkpointing`` with hf_zero's ``checkpoint_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_zero.config.schema import AUTO, ConfigError
from hf_zero.config.values import show

SECTION = "sequence_parallel"
OWN_KEYS = ("tiled_loss", "loss_tile_tokens", "tiled_mlp", "mlp_tile_tokens")
LLAMA_FACTORY_KEYS = ("enabled", "size", "mode", "ulysses", "tiling", "memory_optimizations")
ULYSSES_KEYS = ("degree", "seq_length_is_variable")
TILING_KEYS = ("enabled", "chunk_size")


@dataclass
class SequenceParallelConfig:
    """The resolved settings; ``ignored`` names keys that are accepted but do nothing here (not DeepSpeed's)."""

    size: int = 1
    tiled_loss: bool = False
    loss_tile_tokens: int | None = None
    tiled_mlp: bool = False
    mlp_tile_tokens: int | None = None
    ignored: list[str] = field(default_factory=list)


def _bool(value: Any, path: str, allow_auto: bool = False) -> bool | str:
    if isinstance(value, bool) or (allow_auto and value == AUTO):
        return value
    allowed = 'true, false or "auto"' if allow_auto else "true or false"
    raise ConfigError(f"{path}: got {show(value)}, expected {allowed}")


def _positive_int(value: Any, path: str, allow_auto: bool = False) -> int | None:
    if allow_auto and value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: got {show(value)}, expected an integer >= 1" + (' or "auto"' if allow_auto else ""))
    return value


def _dict(value: Any, path: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: got {show(value)}, expected an object")
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key; allowed keys are {', '.join(keys)}")
    return value


def parse(data: dict) -> SequenceParallelConfig:
    """Read ``sequence_parallel_size`` and the ``sequence_parallel`` section of a config dict."""
    cfg = SequenceParallelConfig()
    top = data.get("sequence_parallel_size")
    top_size = _positive_int(top, "sequence_parallel_size") if top is not None else None
    section = _dict(data.get(SECTION) or {}, SECTION, OWN_KEYS + LLAMA_FACTORY_KEYS)
    enabled = _bool(section.get("enabled", True), f"{SECTION}.enabled")
    sizes = {}
    if top_size is not None:
        sizes["sequence_parallel_size"] = top_size
    if enabled:
        if section.get("size") is not None:
            sizes[f"{SECTION}.size"] = _positive_int(section["size"], f"{SECTION}.size")
        ulysses = _dict(section.get("ulysses") or {}, f"{SECTION}.ulysses", ULYSSES_KEYS)
        if ulysses.get("degree") is not None:
            sizes[f"{SECTION}.ulysses.degree"] = _positive_int(ulysses["degree"], f"{SECTION}.ulysses.degree")
        if "seq_length_is_variable" in ulysses:  # hf_zero takes any length; nothing to switch
            _bool(ulysses["seq_length_is_variable"], f"{SECTION}.ulysses.seq_length_is_variable")
        mode = section.get("mode", "ulysses")
        if mode != "ulysses":
            raise ConfigError(f"{SECTION}.mode: got {show(mode)}, but hf_zero implements Ulysses sequence parallelism only; use \"ulysses\"")
    if len(set(sizes.values())) > 1:
        said = ", ".join(f"{k} {v}" for k, v in sizes.items())
        raise ConfigError(f"the sequence-parallel degree is given more than once and differs ({said}); give one value")
    cfg.size = next(iter(sizes.values()), 1)
    _tiling(section, cfg, enabled)
    if "memory_optimizations" in section:  # LLaMA-Factory's own switch for its own code
        cfg.ignored.append(f"{SECTION}.memory_optimizations")
    return cfg


def _tiling(section: dict, cfg: SequenceParallelConfig, enabled: bool) -> None:
    tiled_loss: bool | str = AUTO
    tiling = _dict(section.get("tiling") or {}, f"{SECTION}.tiling", TILING_KEYS)
    if enabled and _bool(tiling.get("enabled", False), f"{SECTION}.tiling.enabled"):
        chunk = _positive_int(tiling.get("chunk_size", AUTO), f"{SECTION}.tiling.chunk_size", allow_auto=True)
        tiled_loss, cfg.tiled_mlp = True, True
        cfg.loss_tile_tokens = cfg.mlp_tile_tokens = chunk
    if "tiled_loss" in section:
        tiled_loss = _bool(section["tiled_loss"], f"{SECTION}.tiled_loss", allow_auto=True)
    if "tiled_mlp" in section:
        cfg.tiled_mlp = bool(_bool(section["tiled_mlp"], f"{SECTION}.tiled_mlp"))
    if "loss_tile_tokens" in section:
        cfg.loss_tile_tokens = _positive_int(section["loss_tile_tokens"], f"{SECTION}.loss_tile_tokens", allow_auto=True)
    if "mlp_tile_tokens" in section:
        cfg.mlp_tile_tokens = _positive_int(section["mlp_tile_tokens"], f"{SECTION}.mlp_tile_tokens", allow_auto=True)
    cfg.tiled_loss = cfg.size > 1 if tiled_loss == AUTO else bool(tiled_loss)
