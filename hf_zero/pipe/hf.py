"""Split a ``transformers`` causal LM into a ``PipelineModule``: embeddings, blocks, norm + head, loss.

``split_causal_lm(model_or_config, num_stages)`` lists the model as layers (embedding, one layer
per decoder block, final norm, LM head) whose modules are registered under the model's own
paths, so each stage's ``state_dict()`` holds ``model.layers.3.self_attn.q_proj.weight`` and
the like, and a consolidated checkpoint of the pipelined run loads with ``from_pretrained``.

Given a config, every layer is a spec built on its own stage only (seeded per layer, so the
initial weights do not depend on the split); given a model, its existing submodules are used.

What travels between stages is the hidden state (and the 2-D attention mask when the inputs
carry one). Each block rebuilds what the model's top-level ``forward`` computes once — the
position ids, the rotary ``position_embeddings`` and the attention mask for its own attention
type (full or sliding window) — through transformers' own ``create_causal_mask``, because a
decoder layer in transformers 5 no longer derives them itself.

Supported: the Llama family (``LlamaForCausalLM`` and the models that share its layout: Mistral,
Qwen2, Qwen3, ...: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``,
``lm_head``) and GPT-2 (``transformer.wte``/``wpe``/``h``/``ln_f``, the head tied to ``wte``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_zero.pipe.module import LayerSpec, NamedLayerSpec, PipelineError, PipelineModule, TiedLayerSpec


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: predict token t+1 from position t, ignore -100, mean over tokens (fp32)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[..., :-1, :].float().reshape(-1, vocab), labels[..., 1:].reshape(-1).to(logits.device), ignore_index=-100
    )


def _split_inputs(x: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(x, (tuple, list)):
        return x[0], (x[1] if len(x) > 1 else None)
    return x, None


def _join(hidden: torch.Tensor, mask: torch.Tensor | None) -> Any:
    return hidden if mask is None else (hidden, mask)


def _call_mask(fn: Callable, config: Any, hidden: torch.Tensor, mask: torch.Tensor | None,
               position_ids: torch.Tensor) -> Any:
    """``create_causal_mask`` with the arguments this transformers version takes (5.x renamed some)."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": mask, "past_key_values": None, "cache": None,
                              "position_ids": position_ids}  # "cache": past_key_values' name from transformers 5.2x
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    if "cache_position" in params:
        kwargs["cache_position"] = position_ids[0]
    return fn(**{k: v for k, v in kwargs.items() if k in params})


# ---------------------------------------------------------------- forward functions (module, x) -> y


def _embed(module: nn.Embedding, x: Any) -> Any:
    ids, mask = _split_inputs(x)
    return _join(module(ids), mask)


class _SharedInputs:
    """Position ids, attention mask and rotary ``(cos, sin)`` of the current micro-batch, built once for
    all of a stage's blocks.

    A model's own ``forward`` builds them once and hands them to every layer; here each block runs
    on its own, so without this every block rebuilt them (the mask, the rotary kernels and a
    signature lookup per block and micro-batch). They depend only on the sequence length, the
    device, the dtype, the padding mask (the same tensor object travels with the hidden states
    through a stage) and the attention type, which make the key; nothing in them needs gradients.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, torch.Tensor | None, Any]] = {}

    def get(self, kind: str, hidden: torch.Tensor, mask: torch.Tensor | None, build: Callable[[], Any]) -> Any:
        key = (hidden.shape[1], hidden.device, hidden.dtype)
        entry = self._entries.get(kind)
        if entry is not None and entry[0] == key and entry[1] is mask:
            return entry[2]
        value = build()
        self._entries[kind] = (key, mask, value)  # holds the mask, so its identity cannot be reused
        return value


class _Rotary:
    """One rotary embedding per stage, shared by its blocks: the model's own when a model was given.

    It holds buffers only (not in the state dict), so a stage built from a config makes its own.
    """

    def __init__(self, config: Any, given: nn.Module | None) -> None:
        self.config, self.module = config, given
        self.shared = _SharedInputs()

    def get(self, device: torch.device) -> nn.Module:
        if self.module is None:
            arch = _architecture(self.config)
            name = f"{arch.__name__.replace('ForCausalLM', '')}RotaryEmbedding"
            cls = getattr(inspect.getmodule(arch), name, None)
            if cls is None:
                raise PipelineError(f"{arch.__name__} has no {name} beside it, so split_causal_lm cannot rebuild its positions")
            self.module = cls(config=self.config)
        if self.module.inv_freq.device != device:
            self.module.to(device)
        return self.module


class _BlockForward:
    """Run one decoder block the way its model's ``forward`` would: position embeddings and mask first."""

    def __init__(self, config: Any, layer_idx: int, rotary: _Rotary) -> None:
        self.config, self.layer_idx, self.rotary = config, layer_idx, rotary

    def _attention_type(self, block: nn.Module) -> str:
        kind = getattr(block, "attention_type", None)
        types = getattr(self.config, "layer_types", None)
        if kind is None and types:
            kind = types[self.layer_idx]
        if kind is None:
            sliding = getattr(self.config, "sliding_window", None) is not None and getattr(self.config, "use_sliding_window", True)
            kind = "sliding_attention" if sliding else "full_attention"
        return kind

    def __call__(self, block: nn.Module, x: Any) -> Any:
        from transformers import masking_utils

        hidden, mask = _split_inputs(x)
        kind = self._attention_type(block)

        def build() -> tuple:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            fn = (masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention"
                  else masking_utils.create_causal_mask)
            return position_ids, _call_mask(fn, self.config, hidden, mask, position_ids), \
                self.rotary.get(hidden.device)(hidden, position_ids)

        position_ids, attn_mask, cos_sin = self.rotary.shared.get(kind, hidden, mask, build)
        out = block(hidden, attention_mask=attn_mask, position_ids=position_ids, position_embeddings=cos_sin, use_cache=False)
        out = out[0] if isinstance(out, tuple) else out
        return _join(out, mask)


class _GPT2BlockForward:
    """A GPT-2 block with the causal mask its model builds (absolute positions were added at the embedding)."""

    def __init__(self, config: Any, shared: _SharedInputs) -> None:
        self.config, self.shared = config, shared

    def __call__(self, block: nn.Module, x: Any) -> Any:
        from transformers import masking_utils

        hidden, mask = _split_inputs(x)

        def build() -> tuple:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            return position_ids, _call_mask(masking_utils.create_causal_mask, self.config, hidden, mask, position_ids)

        position_ids, attn_mask = self.shared.get("full_attention", hidden, mask, build)
        out = block(hidden, None, attn_mask, use_cache=False, position_ids=position_ids)
        out = out[0] if isinstance(out, tuple) else out
        return _join(out, mask)


class _GPT2Positions:
    """GPT-2's learned position embedding plus the embedding dropout (``transformer.wpe``, ``drop``)."""

    def __init__(self, dropout: float) -> None:
        self.dropout = dropout

    def __call__(self, wpe: nn.Embedding, x: Any) -> Any:
        hidden, mask = _split_inputs(x)
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        hidden = F.dropout(hidden + wpe(pos), self.dropout, wpe.training)
        return _join(hidden, mask)


def _norm(module: nn.Module, x: Any) -> torch.Tensor:
    hidden, _ = _split_inputs(x)
    return module(hidden)


def _head(module: nn.Module, x: Any) -> torch.Tensor:
    return module(x)


def _tied_head(module: nn.Embedding, x: Any) -> torch.Tensor:
    return F.linear(x, module.weight)


# ---------------------------------------------------------------- building the layer list


def _architecture(config: Any) -> type:
    """The ``*ForCausalLM`` class of a config (its ``architectures`` entry, else the auto mapping)."""
    import transformers
    from transformers import AutoModelForCausalLM

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None and name.endswith("ForCausalLM"):
            return cls
    mapping = AutoModelForCausalLM._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        raise PipelineError(f"split_causal_lm: {type(config).__name__} has no causal-LM model in transformers") from None


def _spec(module_path: str, cls: type, args: tuple, kwargs: dict, fn: Callable, given: nn.Module | None) -> Any:
    """A lazily built spec, or (given an existing module) a spec that hands that module over."""
    if given is not None:
        return _GivenSpec(module_path, given, fn)
    return NamedLayerSpec(module_path, cls, *args, forward_fn=fn, **kwargs)


class _GivenSpec(NamedLayerSpec):
    """A spec for a module that already exists (the model was passed in): ``build`` hands it over."""

    def __init__(self, module_path: str, module: nn.Module, forward_fn: Callable) -> None:
        super().__init__(module_path, type(module), forward_fn=forward_fn)
        self.module = module

    def build(self) -> nn.Module:
        return self.module


class _GivenTiedSpec(TiedLayerSpec):
    """``_GivenSpec`` for a tied layer."""

    def __init__(self, key: str, module_path: str, module: nn.Module, forward_fn: Callable) -> None:
        super().__init__(key, type(module), forward_fn=forward_fn, module_path=module_path)
        self.module = module

    def build(self) -> nn.Module:
        return self.module


def _tied(key: str, path: str, given: nn.Module | None, fn: Callable, kwargs: dict) -> TiedLayerSpec:
    if given is not None:
        return _GivenTiedSpec(key, path, given, fn)
    return TiedLayerSpec(key, nn.Embedding, forward_fn=fn, module_path=path, **kwargs)


def _gpt2_layers(config: Any, mod: Any, tied: bool, sub: Callable[[str], nn.Module | None]) -> tuple[list[Any], type]:
    """GPT-2 as layers: token and position embeddings, the blocks, the final norm, the (tied) head."""
    block_cls = mod.GPT2Block
    vocab, d = config.vocab_size, config.n_embd
    wte_kwargs = {"num_embeddings": vocab, "embedding_dim": d}
    layers: list[Any] = []
    if tied:
        layers.append(_tied("wte", "transformer.wte", sub("transformer.wte"), _embed, wte_kwargs))
    else:
        layers.append(_spec("transformer.wte", nn.Embedding, (vocab, d), {}, _embed, sub("transformer.wte")))
    layers.append(_spec("transformer.wpe", nn.Embedding, (config.n_positions, d), {}, _GPT2Positions(config.embd_pdrop),
                        sub("transformer.wpe")))
    shared = _SharedInputs()
    for i in range(config.n_layer):
        layers.append(_spec(f"transformer.h.{i}", block_cls, (config,), {"layer_idx": i}, _GPT2BlockForward(config, shared),
                            sub(f"transformer.h.{i}")))
    layers.append(_spec("transformer.ln_f", nn.LayerNorm, (d,), {"eps": config.layer_norm_epsilon}, _norm,
                        sub("transformer.ln_f")))
    if tied:
        layers.append(_tied("wte", "transformer.wte", sub("transformer.wte"), _tied_head, wte_kwargs))
    else:
        layers.append(_spec("lm_head", nn.Linear, (d, vocab), {"bias": False}, _head, sub("lm_head")))
    return layers, block_cls


def _llama_layers(config: Any, mod: Any, arch: type, tied: bool, sub: Callable[[str], nn.Module | None]) -> tuple[list[Any], type]:
    """A Llama-family model as layers: the embedding, the decoder blocks, the final norm, the (tied) head."""
    prefix = arch.__name__.replace("ForCausalLM", "")
    block_cls = getattr(mod, f"{prefix}DecoderLayer", None)
    norm_cls = getattr(mod, f"{prefix}RMSNorm", None)
    if block_cls is None or norm_cls is None or not hasattr(config, "num_hidden_layers"):
        raise PipelineError(
            f"split_causal_lm supports the Llama family (model.embed_tokens / model.layers / model.norm / lm_head) and GPT-2; "
            f"{arch.__name__} does not have that layout"
        )
    vocab, d = config.vocab_size, config.hidden_size
    emb_kwargs = {"num_embeddings": vocab, "embedding_dim": d, "padding_idx": getattr(config, "pad_token_id", None)}
    layers: list[Any] = []
    if tied:
        layers.append(_tied("embed_tokens", "model.embed_tokens", sub("model.embed_tokens"), _embed, emb_kwargs))
    else:
        layers.append(_spec("model.embed_tokens", nn.Embedding, (), emb_kwargs, _embed, sub("model.embed_tokens")))
    rotary = _Rotary(config, sub("model.rotary_emb"))
    for i in range(config.num_hidden_layers):
        layers.append(_spec(f"model.layers.{i}", block_cls, (config, i), {}, _BlockForward(config, i, rotary),
                            sub(f"model.layers.{i}")))
    layers.append(_spec("model.norm", norm_cls, (d,), {"eps": config.rms_norm_eps}, _norm, sub("model.norm")))
    if tied:
        layers.append(_tied("embed_tokens", "model.embed_tokens", sub("model.embed_tokens"), _tied_head, emb_kwargs))
    else:
        layers.append(_spec("lm_head", nn.Linear, (d, vocab), {"bias": False}, _head, sub("lm_head")))
    return layers, block_cls


def causal_lm_layers(model_or_config: Any) -> tuple[list[Any], Any, str]:
    """The layer list of a causal LM, its config and the block class name (for ``type:`` partitioning)."""
    from transformers import PretrainedConfig

    model = None if isinstance(model_or_config, PretrainedConfig) else model_or_config
    config = copy.deepcopy(model_or_config if model is None else model.config)
    if model is not None and not isinstance(model, nn.Module):
        raise PipelineError(f"split_causal_lm expects a transformers causal-LM model or its config, got {type(model_or_config).__name__}")
    arch = type(model) if model is not None else _architecture(config)
    if not getattr(config, "architectures", None):
        config.architectures = [arch.__name__]
    config.use_cache = False
    if model is None and getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa"
    mod = inspect.getmodule(arch)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def sub(path: str) -> nn.Module | None:
        return model.get_submodule(path) if model is not None else None

    if hasattr(config, "n_layer") and getattr(config, "model_type", "") == "gpt2":
        layers, block_cls = _gpt2_layers(config, mod, tied, sub)
    else:
        layers, block_cls = _llama_layers(config, mod, arch, tied, sub)
    return layers, config, block_cls.__name__


def split_causal_lm(
    model_or_config: Any,
    num_stages: int,
    *,
    partition_method: str | None = None,
    activation_checkpoint_interval: int = 0,
    loss_fn: Callable | None = None,
    seed: int = 1234,
) -> PipelineModule:
    """A transformers causal LM (or its config) as a ``PipelineModule`` of ``num_stages`` stages.

    ``partition_method`` defaults to ``"compute"``: stages balanced by the weights their matmuls
    use, embedding lookups free, so the last stage, which also runs the LM head over the whole
    vocabulary, gets fewer blocks (on the 1.1B Llama shape, equal blocks per stage left stage 0
    idle ~10% of each step waiting for the head's stage). ``"type:<block class>"`` puts equally
    many blocks on each stage; ``"parameters"`` counts the embedding too. ``loss_fn`` defaults to the
    causal-LM loss on ``labels`` (the inputs shifted by one, -100 ignored), as ``model(labels=...)``.
    """
    layers, config, _ = causal_lm_layers(model_or_config)
    given = not _is_config(model_or_config)
    pipe = PipelineModule(
        layers,
        num_stages=num_stages,
        loss_fn=loss_fn or causal_lm_loss,
        partition_method=partition_method or "compute",
        activation_checkpoint_interval=activation_checkpoint_interval,
        seed_layers=not given,
        base_seed=seed,
    )
    pipe.config = config  # save_pretrained writes it as config.json
    # where the model's base (its tensor-parallel plan's root: model.layers.*) sits, as on the transformers model
    pipe.base_model_prefix = getattr(_architecture(config), "base_model_prefix", "") or ""
    if not given:
        _init_weights(pipe, config)
    return pipe


def _is_config(obj: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(obj, PretrainedConfig)


def _init_weights(pipe: PipelineModule, config: Any) -> None:
    """The model's own initialisation (``_init_weights`` of its pretrained class) on this stage's modules."""
    arch = _architecture(config)
    init = getattr(arch, "_init_weights", None)
    if init is None:
        return
    holder = arch.__new__(arch)
    nn.Module.__init__(holder)
    holder.config = config
    with torch.no_grad():
        for idx in range(pipe._local_start, pipe._local_stop):
            torch.manual_seed(pipe.base_seed + 10_000 + idx)
            spec = pipe._layer_specs[idx]
            module = pipe.get_submodule(spec.module_path) if isinstance(spec, LayerSpec) and spec.module_path else None
            if module is not None:
                for m in module.modules():
                    try:
                        init(holder, m)
                    except Exception:  # an init that needs the whole model: keep the layer's own init
                        pass
    pipe._synchronize_tied_weights()


__all__ = ["causal_lm_layers", "causal_lm_loss", "split_causal_lm", "LayerSpec"]
