"""DeepSpeed's module path ``deepspeed.moe``: holds only the parameter-group helper DeepSpeed scripts call on every model.

hf_zero has no DeepSpeed MoE layer (``deepspeed.moe.layer.MoE``); expert parallelism for transformers' own MoE
models is the ``expert_parallel`` section (``hf_zero/expert/``, docs/moe.md). DeepSpeed's MoE tutorial (and its own
checkpoint tests) pass every model's parameter groups through
``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``; for a model without expert
parameters that is the identity, and so it is here. An expert parameter is refused in one sentence.
"""

from hf_zero.moe import utils

__all__ = ["utils"]
