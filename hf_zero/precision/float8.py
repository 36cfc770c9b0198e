"""Float8 training: the model's linear layers swapped for torchao's ``Float8Linear`` before ZeRO lays it out.

Why torchao: its float8 linear is plain PyTorch (``torch._scaled_mm`` under a tensor subclass), so it runs under
``torch.compile`` and under every ZeRO stage unchanged; only the matmuls change. The parameters stay the same
``nn.Parameter`` objects (``Float8Linear.from_float`` adopts them), so the optimizer the user built before
``initialize`` still holds them, and the masters, optimizer state and checkpoints are those of a bf16 run: a float8
run's checkpoint resumes in bf16 and back, and ``save_pretrained`` writes plain weights.

What is converted (:func:`float8_filter`): every ``nn.Linear`` except

- the output projection (the module ``get_output_embeddings()`` returns, or one named ``lm_head``, ``output``,
  ``score``, ``classifier``): its logits feed a softmax over the vocabulary, where float8's 3 mantissa bits cost
  accuracy that the matmul's small share of the step does not pay back (torchtitan skips it too);
- a layer whose ``in_features`` or ``out_features`` is not a multiple of 16: ``torch._scaled_mm`` needs both
  divisible by 16, and such layers are too small to gain anything;
- a layer whose name matches one of the config's ``fp8.skip`` patterns (``re.search``).

At stage 3 with the tensorwise recipe and ``fp8_all_gather``, :func:`mark_float8_all_gather` tags the converted
weights so that ZeRO gathers them as float8 (:mod:`hf_zero.zero.float8_gather`). A model the user converted with
torchao before ``initialize`` is trained the same way without the section (:func:`adopt_converted`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

from hf_zero.config import Float8Config
from hf_zero.errors import UsageError

#: names of output projections, matched against the last part of a module's name
OUTPUT_NAMES = ("lm_head", "output", "score", "classifier")

logger = logging.getLogger("hf_zero")


def require_torchao() -> Any:
    """``torchao.float8``, or one sentence saying how to install it."""
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise UsageError(
            "fp8.enabled (or mixed_precision='fp8') needs torchao's float8 training, which is not importable here "
            f"({e}); install it with pip install 'hf_zero[fp8]' (torchao>=0.18)"
        ) from e
    return ao_float8


def recipe_config(cfg: Float8Config) -> Any:
    """torchao's ``Float8LinearConfig`` for the section's recipe (and ``emulate``)."""
    ao = require_torchao()
    config = cfg.torchao_config if cfg.torchao_config is not None else ao.Float8LinearConfig.from_recipe_name(cfg.recipe)
    # torchao's own float8 all-gather wraps each weight in a new Parameter for FSDP2's hooks; hf_zero gathers float8
    # itself (hf_zero/zero/float8_gather.py) and needs the user's Parameter objects kept
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
    return dataclasses.replace(config, emulate=True) if cfg.emulate else config


def _output_module(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    if get is None:
        return None
    try:
        out = get()
    except (NotImplementedError, AttributeError):
        return None
    return out if isinstance(out, torch.nn.Module) else None


def float8_filter(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> Callable[[torch.nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: True for the linear layers to convert (the module doc says which are not)."""
    head = _output_module(model)
    patterns = [re.compile(p) for p in skip]

    def keep(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return False
        if module is head or name.rsplit(".", 1)[-1] in OUTPUT_NAMES:
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        return not any(p.search(name) for p in patterns)

    return keep


def convert_to_float8(model: torch.nn.Module, cfg: Float8Config) -> list[str]:
    """Swap the linear layers :func:`float8_filter` keeps for torchao's ``Float8Linear``, in place; their names.

    Refuses a model where nothing qualifies, since a run the user asked to be float8 would silently be bf16.
    """
    ao = require_torchao()
    keep = cfg.module_filter if cfg.module_filter is not None else float8_filter(model, cfg.skip)
    names = [n for n, m in model.named_modules() if n and keep(m, n)]
    if not names:
        raise UsageError(
            f"fp8.enabled: no linear layer of {type(model).__name__} can compute in float8 (none is an nn.Linear "
            "with both dimensions multiples of 16 outside the output projection and fp8.skip); turn fp8 off"
        )
    ao.convert_to_float8_training(model, config=recipe_config(cfg), module_filter_fn=keep)
    return names


def is_float8_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torchao's float8 linear (without importing torchao when it is absent)."""
    return any(c.__name__ == "Float8Linear" and c.__module__.startswith("torchao.") for c in type(module).__mro__)


def gathers_as_float8(module: torch.nn.Module) -> bool:
    """Whether stage 3 may hand ``module`` a weight cast to float8 before the all-gather (its config says so).

    The gathered float8 weight serves the forward's matmul and, saved by autograd, the backward's grad-input matmul;
    both casts must be dynamic and tensorwise (one scale per weight, computable from the shards' amaxes) with one
    target dtype. Rowwise needs the scale of every row along the dimension the shards cut across, and torchao
    recasts the weight along the other dimension for the backward anyway.
    """
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts = (module.config.cast_config_weight, module.config.cast_config_weight_for_grad_input)
    return (all(c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE
                for c in casts) and casts[0].target_dtype == casts[1].target_dtype)


def mark_float8_all_gather(model: torch.nn.Module, cfg: Float8Config, stage: int) -> int:
    """Tag the float8 weights that stage 3 gathers as float8 (:func:`gathers_as_float8`); how many."""
    if not (cfg.fp8_all_gather and stage == 3):
        return 0
    n = 0
    for m in model.modules():
        if is_float8_linear(m) and gathers_as_float8(m):
            m.weight.hf_zero_float8 = m  # zero/float8_gather.py reads the module's config and dtype from it
            n += 1
    return n


def adopt_converted(model: torch.nn.Module, stage: int) -> list[str]:
    """A model the user converted with torchao before ``initialize``, without the ``fp8`` section: trained as the
    section would train it (stage 3 gathers its tensorwise weights as float8); the float8 layers' names.

    Without this, the layers still compute in float8 but stage 3 gathers their bf16 weights and casts after the
    gather, moving twice the bytes. torchao's own ``enable_fsdp_float8_all_gather`` is refused: it wraps each weight
    in a new Parameter subclass for FSDP2's all-gather hooks, which ZeRO's flat buffers do not call.
    """
    names = [n for n, m in model.named_modules() if n and is_float8_linear(m)]
    if not names:
        return []
    wrapped = [n for n in names if type(model.get_submodule(n).weight) is not torch.nn.Parameter]
    if wrapped:
        raise UsageError(
            f"{wrapped[0]}: its weight is torchao's FSDP2 float8 all-gather wrapper ({len(wrapped)} such layers); "
            "convert with Float8LinearConfig(enable_fsdp_float8_all_gather=False), or leave the model unconverted and "
            "set the config's fp8 section instead - hf_zero gathers float8 itself"
        )
    gathered = mark_float8_all_gather(model, Float8Config(enabled=True), stage)
    logger.info("fp8: %d linear layers were converted to float8 by torchao before initialize; training them as the "
                "fp8 section would (stage 3 float8 all-gather: %d of them)", len(names), gathered)
    return names


def apply_float8(model: torch.nn.Module, cfg: Float8Config, stage: int) -> list[str]:
    """The engine's one call: convert and mark when the ``fp8`` section is on, adopt a model torchao converted
    before ``initialize`` when it is off (:func:`adopt_converted`); the float8 layers' names.

    It runs before ZeRO lays the parameters out, on the same Parameter objects, so the user's optimizer still holds
    them; at stage 3 the tensorwise recipe's weights are then gathered as float8 (hf_zero/zero/float8_gather.py).
    """
    if not cfg.enabled:
        return adopt_converted(model, stage)
    done = [n for n, m in model.named_modules() if n and is_float8_linear(m)]
    if done:
        raise UsageError(
            f"fp8.enabled: {done[0]} ({len(done)} layers in all) is already torchao's Float8Linear; either turn fp8 off "
            "(the config's fp8 section or mixed_precision='fp8': hf_zero trains a model you converted as it is) or "
            "pass the model unconverted"
        )
    names = convert_to_float8(model, cfg)
    mark_float8_all_gather(model, cfg, stage)
    return names
