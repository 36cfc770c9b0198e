"""Putting a transformers causal LM under sequence parallelism and the long-sequence memory savers.

:func:`prepare_model` switches the model's attention to Ulysses (:mod:`.attention`), tiles its
MLPs when asked (:mod:`.tiling`), and wraps the causal LM's ``forward`` (the instance attribute,
so ``__call__`` and the ZeRO-3 hooks on the model run as before). The wrapped forward steps in
only when there is something to do:

- **Sequence-parallel training** (SP on and the model in training mode): the batch is this rank's
  shard (:func:`hf_zero.sequence.shard_batch`), with ``shift_labels`` and global ``position_ids``.
  Attention runs over the group, and the loss is the mean over the group's targets
  (:func:`.loss.sequence_parallel_mean`), the same number on every rank of the group.
- **Tiled loss** (training with labels): for the architectures whose head is a plain
  ``lm_head(hidden_states)`` (:data:`FUSED_LOSS_MODEL_TYPES`), the decoder runs, then
  :func:`.loss.fused_linear_cross_entropy`, so full logits never exist (the output's ``logits``
  is then None). Others compute their logits as usual and the loss from them.

Everything else (evaluation, generation, a forward without labels outside SP) goes to the
model's own forward untouched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.sequence import attention
from hf_zero.sequence.batch import shift_labels_of
from hf_zero.sequence.groups import SequenceParallelError, SequenceParallelGroups
from hf_zero.sequence.loss import cross_entropy_sum, fused_linear_cross_entropy, sequence_parallel_mean
from hf_zero.sequence.tiling import tile_mlps

# Causal LMs whose forward is ``logits = lm_head(decoder(...).last_hidden_state)`` and the loss from
# them, with nothing in between (no logit scaling or soft-capping, no auxiliary loss), checked
# against their transformers source.
FUSED_LOSS_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3", "gemma", "starcoder2", "glm"}
)


@dataclass(frozen=True)
class LongSequenceOptions:
    """What :func:`prepare_model` switches on (the resolved ``sequence_parallel`` config section)."""

    tiled_loss: bool = True
    loss_tile_tokens: int | None = None  # None: a tile of fp32 logits is about 1 GiB
    tiled_mlp: bool = False
    mlp_tile_tokens: int | None = None  # None: the hidden size, as ALST


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside ``model`` (a peft wrapper is looked through)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner


def fused_loss_supported(lm: torch.nn.Module) -> bool:
    config = getattr(lm, "config", None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    return (
        getattr(config, "model_type", None) in FUSED_LOSS_MODEL_TYPES
        and type(lm).__name__.endswith("ForCausalLM")
        and isinstance(head, torch.nn.Linear)
        and hasattr(lm, getattr(lm, "base_model_prefix", "") or "\0")
    )


def prepare_model(model: torch.nn.Module, groups: SequenceParallelGroups | None, options: LongSequenceOptions) -> dict[str, Any]:
    """Switch ``model`` to sequence parallelism over ``groups`` (None or size 1: no SP) and the options' savers.

    Returns what was done (for the engine's log line). Refuses, in one sentence, a model that
    cannot run under SP (not a transformers model, heads that do not divide).
    """
    lm = causal_lm_of(model)
    done: dict[str, Any] = {"attention": None, "tiled_mlps": 0, "fused_loss": False}
    if getattr(lm, "_hf_zero_long_sequence", None) is not None:
        raise SequenceParallelError(
            f"this {type(lm).__name__} was already prepared for sequence parallelism by another engine; build a fresh model"
        )
    if groups is not None and groups.enabled:
        done["attention"] = attention.enable(lm, groups)
    if options.tiled_mlp:
        hidden = getattr(getattr(lm, "config", None), "hidden_size", None) or 1024
        done["tiled_mlps"] = tile_mlps(lm, int(options.mlp_tile_tokens or hidden))
    done["fused_loss"] = bool(options.tiled_loss and fused_loss_supported(lm))
    if (groups is not None and groups.enabled) or done["fused_loss"]:
        _wrap_forward(lm, groups, options, done["fused_loss"])
    lm._hf_zero_long_sequence = done
    return done


def _wrap_forward(lm: torch.nn.Module, groups: SequenceParallelGroups | None, options: LongSequenceOptions, fused: bool) -> None:
    original = lm.forward
    signature = inspect.signature(original)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def forward(*args: Any, **kwargs: Any) -> Any:
        sp_on = groups is not None and groups.enabled and lm.training
        if not sp_on and not (fused and lm.training):
            return original(*args, **kwargs)
        params = dict(signature.bind_partial(*args, **kwargs).arguments)
        params.update(params.pop(var_kw, {}) if var_kw else {})
        if not sp_on and params.get("labels") is None and params.get("shift_labels") is None:
            return original(*args, **kwargs)
        return _forward(lm, original, params, groups if sp_on else None, options, fused)

    lm.forward = forward


def _forward(lm: torch.nn.Module, original: Any, params: dict[str, Any], groups: SequenceParallelGroups | None,
             options: LongSequenceOptions, fused: bool) -> Any:
    labels, targets = params.pop("labels", None), params.pop("shift_labels", None)
    num_items = params.pop("num_items_in_batch", None)
    return_dict = params.pop("return_dict", None)
    cached = False
    if groups is not None:
        if targets is None and labels is not None:
            raise SequenceParallelError(
                "under sequence parallelism the model takes shift_labels (labels shifted on the whole sample before it "
                "was split), not labels; feed batches from hf_zero.sequence.shard_batch or the engine's data loader"
            )
        if params.get("position_ids") is None:
            raise SequenceParallelError(
                "under sequence parallelism the model needs the global position_ids of its shard; feed batches from "
                "hf_zero.sequence.shard_batch or the engine's data loader"
            )
        if params.get("past_key_values") is not None:
            raise SequenceParallelError("a KV cache cannot be split along the sequence; train without past_key_values")
        use_cache = params.get("use_cache")
        cached = bool(getattr(lm.config, "use_cache", False) if use_cache is None else use_cache)
        params["use_cache"] = False
    elif targets is None and labels is not None:
        targets = shift_labels_of(labels)
    # the unsplit forward would have built a KV cache, and then not looked for packed documents
    with attention.sequence_parallel_forward(groups, find_documents=groups is not None and not cached):
        if targets is None:
            return original(**params)
        if fused and params.get("logits_to_keep", 0) in (0, None):
            params.pop("logits_to_keep", None)
            out = getattr(lm, lm.base_model_prefix)(**params)
            head = lm.get_output_embeddings()
            total, count = fused_linear_cross_entropy(
                out[0], head.weight, head.bias, targets, tile_tokens=options.loss_tile_tokens
            )
            logits = None
        else:
            out = original(**params)
            logits = out.logits
            total, count = cross_entropy_sum(logits, targets)
        loss = sequence_parallel_mean(total, count, groups, num_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    result = CausalLMOutputWithPast(
        loss=loss, logits=logits, past_key_values=getattr(out, "past_key_values", None),
        hidden_states=getattr(out, "hidden_states", None), attentions=getattr(out, "attentions", None),
    )
    return result.to_tuple() if return_dict is False else result
