"""Ulysses attention for transformers models, through transformers' attention interface.

A model whose ``config._attn_implementation`` is ``"hf_zero_ulysses_<core>"`` (``<core>`` being
``sdpa``, ``eager`` or a flash-attention name) calls :func:`_ulysses` where it would call the core
attention. Inside a sequence-parallel forward, each rank arrives with q, k, v for its ``1/sp`` of
the tokens and all heads (``[b, h, s/sp, d]``, RoPE already applied with the global positions the
batch carries). One all-to-all per tensor turns that into all tokens for ``1/sp`` of the heads
(``[b, h/sp, s, d]``); the core attention runs on it with the causal mask of the *whole* sequence;
a last all-to-all returns ``[b, s/sp, h, d]``. Attention is independent per head, so the result
is exactly the unsplit computation's.

The model builds its masks through transformers' mask interface, where the same name is
registered (:func:`_mask`): inside a sequence-parallel forward it returns a
:class:`ShardMask` holding the shard's 2D padding mask instead of a mask for the shard alone,
and the first attention layer turns it into the global mask (gathering the padding mask and
the positions once per forward; later layers, and the recomputation of checkpointed blocks in
backward, reuse it). Outside one (evaluation, generation, a model in eval mode) both functions
hand over to the core implementation, so the model behaves as before.

GQA: k and v have fewer heads than q. When their count ``kv`` is at least sp, each rank gets
``kv/sp`` of them; when it is smaller (and divides sp), each KV head is repeated ``sp/kv`` times
before the exchange so that every rank receives the one KV head its query heads use. Head counts
that do not divide are refused when SP is switched on.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_zero.sequence.comm import all_gather_along, all_to_all
from hf_zero.sequence.groups import SequenceParallelError, SequenceParallelGroups

PREFIX = "hf_zero_ulysses_"
_ACTIVE: contextvars.ContextVar[tuple[SequenceParallelGroups, bool] | None] = contextvars.ContextVar("hf_zero_sp", default=None)


@contextlib.contextmanager
def sequence_parallel_forward(groups: SequenceParallelGroups | None, find_documents: bool = True) -> Iterator[None]:
    """Within this block, models using a ``hf_zero_ulysses_*`` attention run sequence-parallel over ``groups``.

    ``find_documents``: whether restarting positions mark packed documents. transformers looks for
    them only when the forward builds no KV cache (``use_cache=False``); with a cache it attends
    across documents, and a split forward must do what the unsplit one would.
    """
    token = _ACTIVE.set((groups, find_documents) if groups is not None and groups.enabled else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class ShardMask:
    """What the mask interface returns inside a sequence-parallel forward: the shard's padding mask,
    turned into the global mask by the first attention layer that needs it."""

    def __init__(self, groups: SequenceParallelGroups, local_mask: torch.Tensor | None, find_documents: bool = True) -> None:
        self.groups = groups
        self.local_mask = local_mask
        self.find_documents = find_documents and local_mask is None
        self._positions: tuple[torch.Tensor, torch.Tensor] | None = None  # (local, global)
        self._mask2d: tuple[bool, torch.Tensor | None] = (False, None)
        self._built: dict[tuple, torch.Tensor | None] = {}

    # --------------------------------------------------------------- pieces

    def global_positions(self, local: torch.Tensor) -> torch.Tensor:
        if self._positions is None or self._positions[0] is not local:
            g = self.groups
            self._positions = (local, all_gather_along(local, -1, g.sp_group, g.sp_size))
            self._built.clear()
        return self._positions[1]

    def global_padding(self) -> torch.Tensor | None:
        """The gathered 2D padding mask (bool), or None when there is none or it masks nothing."""
        done, mask = self._mask2d
        if not done:
            if self.local_mask is not None:
                g = self.groups
                full = all_gather_along(self.local_mask.to(torch.uint8), -1, g.sp_group, g.sp_size).bool()
                mask = None if bool(full.all()) else full
            self._mask2d = (True, mask)
        return mask

    def for_core(self, core: str, positions: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask ``core`` expects for the whole sequence (what transformers would build unsplit)."""
        key = (core, window, dtype)
        if key not in self._built:
            pad = self.global_padding()
            self._built[key] = _global_mask(core, pad, self.find_documents, positions, window, dtype)
        return self._built[key]


def _global_mask(
    core: str, pad: torch.Tensor | None, find_documents: bool, positions: torch.Tensor, window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """transformers' masks, rebuilt for the gathered sequence: causal, the padding of the keys, one
    block per packed document (positions restarting; looked for only when transformers would: no
    padding mask given and no KV cache) and the sliding window when the layer has one.

    Flash attention takes the 2D padding mask itself (and finds packed documents from the global
    positions); SDPA needs no mask when causality is all there is; eager always takes an additive one.
    """
    if "flash" in core:
        return pad
    b, s = positions.shape[0], positions.shape[-1]
    if window is not None and s <= window:
        window = None  # the window cannot bite: transformers then skips it too
    docs = None
    if find_documents:
        first = positions[..., :1] - 1
        starts = torch.diff(positions, prepend=first, dim=-1) != 1
        if bool(starts[..., 1:].any()):
            docs = starts.cumsum(-1)
    if core == "sdpa" and pad is None and docs is None and window is None:
        return None
    idx = torch.arange(s, device=positions.device)
    allowed = (idx[:, None] >= idx[None, :]).expand(b, 1, s, s)
    if window is not None:
        allowed = allowed & (idx[None, :] > idx[:, None] - window)
    if pad is not None:
        allowed = allowed & pad.to(positions.device)[:, None, None, :]
    if docs is not None:
        d = docs.expand(b, s)
        allowed = allowed & (d[:, None, :, None] == d[:, None, None, :])
    if core == "sdpa":
        return allowed
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), torch.finfo(dtype).min)


# ------------------------------------------------------------------ registration


def _core_attention(core: str, module: torch.nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core != "eager":
        return ALL_ATTENTION_FUNCTIONS[core]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise SequenceParallelError(
            f"{type(module).__name__} has no module-level eager_attention_forward to run under sequence parallelism; "
            "load the model with attn_implementation='sdpa'"
        )
    return fn


def _make_attention(core: str) -> Callable:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        fn = _core_attention(core, module)
        if isinstance(attention_mask, ShardMask):
            return _ulysses(fn, core, module, query, key, value, attention_mask, *args, **kwargs)
        if _ACTIVE.get() is not None:
            raise SequenceParallelError(
                f"{type(module).__name__} received a {type(attention_mask).__name__} attention mask inside a "
                "sequence-parallel forward; the model must build its masks through transformers' mask interface "
                "(a 4D attention_mask passed in cannot be split: pass the 2D padding mask)"
            )
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__name__ = f"{PREFIX}{core}"
    return attention


def _make_mask(core: str) -> Callable:
    def mask(*args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        if active is not None:
            return ShardMask(active[0], kwargs.get("attention_mask"), active[1])
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[core](*args, **kwargs)

    return mask


def register(core: str) -> str:
    """Register ``hf_zero_ulysses_<core>`` with transformers' attention and mask interfaces; returns the name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if core.startswith(PREFIX):
        core = core[len(PREFIX) :]
    if core != "eager" and (core not in ALL_ATTENTION_FUNCTIONS or core not in ALL_MASK_ATTENTION_FUNCTIONS):
        raise SequenceParallelError(
            f"attention implementation {core!r} cannot run under sequence parallelism; use 'sdpa', 'eager' or a "
            "flash-attention implementation (attn_implementation=... in from_pretrained)"
        )
    if core == "flex_attention":
        raise SequenceParallelError(
            "flex_attention cannot run under hf_zero's sequence parallelism yet (its block mask is built per shard); "
            "use 'sdpa' or a flash-attention implementation"
        )
    name = PREFIX + core
    AttentionInterface.register(name, _make_attention(core))
    AttentionMaskInterface.register(name, _make_mask(core))
    return name


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int, where: str = "the model") -> None:
    """Refuse, in one sentence, head counts that the all-to-all cannot split over ``sp_size`` ranks."""
    if num_heads % sp_size:
        raise SequenceParallelError(
            f"{where} has {num_heads} attention heads, which do not split over sequence_parallel_size {sp_size}; "
            "choose a sequence-parallel degree that divides the number of heads"
        )
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        raise SequenceParallelError(
            f"{where} has {num_kv_heads} key/value heads, which neither split over nor evenly repeat to "
            f"sequence_parallel_size {sp_size}; choose a degree that divides or is a multiple of {num_kv_heads}"
        )


# ------------------------------------------------------------------ the exchange


def _ulysses(fn: Callable, core: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, mask: ShardMask, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    g = mask.groups
    n, group = g.sp_size, g.sp_group
    if kwargs.get("position_ids") is None:
        raise SequenceParallelError(
            f"{type(module).__name__} got no position_ids under sequence parallelism; each shard's positions must be "
            "global (hf_zero.sequence.shard_batch adds them), so pass position_ids to the model"
        )
    for varlen in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k"):
        if kwargs.get(varlen) is not None:
            raise SequenceParallelError(
                f"{varlen} cannot be split along the sequence; for packed documents pass position_ids that restart at "
                "each document instead"
            )
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, kv_heads, n, type(module).__name__)
    if kv_heads < n:  # each rank's query heads use one KV head: repeat them so the exchange hands it over
        key = key.repeat_interleave(n // kv_heads, dim=1)
        value = value.repeat_interleave(n // kv_heads, dim=1)
    q = all_to_all(query, 1, 2, group, n)
    k = all_to_all(key, 1, 2, group, n)
    v = all_to_all(value, 1, 2, group, n)
    positions = mask.global_positions(kwargs["position_ids"])
    kwargs["position_ids"] = positions
    full_mask = mask.for_core(core, positions, kwargs.get("sliding_window"), query.dtype)
    saved = getattr(module, "num_key_value_groups", None)
    if saved is not None:
        module.num_key_value_groups = q.shape[1] // k.shape[1]
    try:
        out, weights = fn(module, q, k, v, full_mask, *args, **kwargs)
    finally:
        if saved is not None:
            module.num_key_value_groups = saved
    # out: [b, s, h/sp, d] -> [b, s/sp, h, d]
    return all_to_all(out, 1, 2, group, n), weights


def enable(model: torch.nn.Module, groups: SequenceParallelGroups) -> str:
    """Switch ``model`` (a transformers model) to Ulysses attention over ``groups``; returns the new implementation name.

    The heads are checked against the sp degree here, so a model that cannot be split is refused
    before any training step.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise SequenceParallelError(
            f"sequence parallelism needs a transformers model (with a config); got a {type(model).__name__}"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        raise SequenceParallelError(f"{type(model).__name__}'s config has no num_attention_heads to split over sequence parallelism")
    kv = getattr(text, "num_key_value_heads", None) or heads
    check_heads(int(heads), int(kv), groups.sp_size, type(model).__name__)
    current = config._attn_implementation or "eager"
    name = register(current)
    _set_implementation(model, name)
    return name


def _set_implementation(model: torch.nn.Module, name: str) -> None:
    """Point the model's config (and sub-configs sharing its attention setting) at ``name``."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None and "attn_implementation" in inspect.signature(setter).parameters:
        try:
            setter(name)
            return
        except (ValueError, ImportError, KeyError):
            pass
    model.config._attn_implementation = name
