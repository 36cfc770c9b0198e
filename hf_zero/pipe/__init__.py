"""Pipeline parallelism with DeepSpeed's names: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``.

- :mod:`hf_zero.pipe.module`: the layer specs and ``PipelineModule`` (partitioning, tied weights,
  process groups, activation checkpointing);
- :mod:`hf_zero.pipe.schedule`: 1F1B and GPipe as plain lists of actions;
- :mod:`hf_zero.pipe.engine`: ``PipelineEngine`` (``train_batch`` / ``eval_batch``), what
  ``hf_zero.initialize(model=PipelineModule)`` returns;
- :mod:`hf_zero.pipe.hf`: ``split_causal_lm``, a transformers causal LM cut into stages under its own
  parameter names;
- :mod:`hf_zero.pipe.consolidated`: the stages' weights consolidated into one ``from_pretrained`` folder
  (resume checkpoints of a pipeline are :mod:`hf_zero.checkpoint`'s, like every engine's).
"""

from __future__ import annotations

from typing import Any

from hf_zero.pipe.module import LayerSpec, NamedLayerSpec, PipelineError, PipelineModule, TiedLayerSpec


def split_causal_lm(model_or_config: Any, num_stages: int, **kwargs: Any) -> PipelineModule:
    """A transformers causal LM (Llama family, GPT-2) or its config as a ``PipelineModule``; see :mod:`hf_zero.pipe.hf`."""
    from hf_zero.pipe.hf import split_causal_lm as split

    return split(model_or_config, num_stages, **kwargs)


__all__ = ["LayerSpec", "NamedLayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec", "split_causal_lm"]
