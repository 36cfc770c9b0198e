"""What ``hf-zero plan`` knows of a model: its shape and its trainable parameters, classified as the engine will.

Apart from :mod:`hf_zero.planning.planner` because this half touches transformers and the engine (it builds the model on the
meta device and asks the engine's own stage-3 unit assignment and tensor-parallel plan where each parameter goes),
while the plan's arithmetic reads only the :class:`ModelFacts` it returns: the plan can be tested and reasoned about
on facts alone, and a new architecture changes this file, not the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_zero.planning import estimate

#: Known shapes, from the ``config.json`` Meta publishes with each model on the Hugging Face Hub
#: (meta-llama/Meta-Llama-3-8B and meta-llama/Meta-Llama-3-70B): 8,030,261,248 and 70,553,706,496 parameters.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    },
    "llama-3-70b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    },
}


@dataclass(frozen=True)
class Param:
    """One trainable parameter as the engine sees it.

    ``layer``: its place in the pipeline's layer list (0 the input embedding, 1..L the blocks, L+1 the rest of
    the root, L+2 the output head). ``role``: its stage-3 unit, ``"lookup"`` (the input embedding, never gathered
    in backward), ``"block"`` (gathered again in backward) or ``"root"`` (gathered once per forward, kept through
    backward). ``tp``: ``"colwise"``/``"rowwise"`` when tensor parallelism splits it, with ``features`` the
    width of the activation its collective moves (a colwise layer's input, a rowwise layer's output)."""

    numel: int
    layer: int
    role: str
    tp: str | None = None
    features: int = 0
    is_weight: bool = True  # a bias is split with its colwise weight, but only the weight has a collective


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs of a model: its shape and its trainable parameters (``Param``)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: tuple[Param, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


def load_config(spec: str) -> tuple[Any, str]:
    """A transformers config and a description, from a preset name (:data:`PRESETS`), a folder or a config.json."""
    from transformers import AutoConfig

    key = spec.strip().lower()
    if key in PRESETS:
        values = dict(PRESETS[key])
        return AutoConfig.for_model(values.pop("model_type"), **values), f"{spec} (preset)"
    try:
        return estimate._load_config(spec), spec
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a readable model folder or "
                         f"config.json ({e})") from None


def model_facts(config: Any, name: str = "") -> ModelFacts:
    """Build the model on the meta device and classify its trainable parameters the way the engine will."""
    import torch

    from hf_zero.parallel.tensor_parallel import SPLIT_STYLES, planned_layers
    from hf_zero.zero.units import assign_units  # the engine's own stage-3 units

    model = estimate.build_model_on_meta(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0))
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if not hidden or not heads:
        raise ValueError(f"{name or type(model).__name__}: the config has no hidden_size / num_attention_heads, which the "
                         "activation and tensor-parallel figures need")
    units, unit_of = assign_units(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    blocks = [i for i, (_, m) in enumerate(units) if m is not embedding]
    block_no = {ui: n for n, ui in enumerate(blocks)}
    n_blocks = len(blocks)
    split: dict[int, tuple[str, int, bool]] = {}
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if plan:
        for _, mod, _, style in planned_layers(getattr(model, "base_model", model), plan):
            if style in SPLIT_STYLES and hasattr(mod, "in_features"):
                colwise = SPLIT_STYLES[style] == 0
                for pname, p in mod.named_parameters(recurse=False):
                    split[id(p)] = ("colwise" if colwise else "rowwise", mod.in_features if colwise else mod.out_features,
                                    pname == "weight")
    params = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        ui = unit_of.get(id(p), -1)
        if ui >= 0 and ui in block_no:
            layer, role = 1 + block_no[ui], "block"
        elif ui >= 0:
            layer, role = 0, "lookup" if type(units[ui][1]) is torch.nn.Embedding else "block"
        else:
            layer, role = (n_blocks + 2 if id(p) in head_ids else n_blocks + 1), "root"
        style, features, is_weight = split.get(id(p), (None, 0, True))
        params.append(Param(numel=p.numel(), layer=layer, role=role, tp=style, features=features, is_weight=is_weight))
    return ModelFacts(name=name or type(model).__name__, hidden=hidden, layers=n_blocks, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, vocab=vocab, params=tuple(params))
