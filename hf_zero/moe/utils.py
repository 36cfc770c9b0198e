"""DeepSpeed's module path ``deepspeed.moe.utils``: holds ``is_moe_param`` and ``split_params_into_different_moe_groups_for_optimizer``."""

from __future__ import annotations

from typing import Any

import torch

from hf_zero.errors import UsageError

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter: ``param.allreduce`` set to False by its MoE layer."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with expert parameters in groups of their own, as DeepSpeed splits them.

    Without expert parameters DeepSpeed returns the groups it was given (a dict becomes a one-element list, a
    tuple a list; each group's ``params`` a list), and so does this. hf_zero has no expert parallelism, so a
    parameter marked as an expert's is refused rather than trained as if it were replicated.
    """
    del max_group_size  # only sizes DeepSpeed's expert groups, of which there are none here
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise UsageError(f"split_params_into_different_moe_groups_for_optimizer: got {type(param_groups).__name__}, "
                         "expected a param-group dict or a list or tuple of them")
    for group in param_groups:
        group["params"] = list(group["params"])
        experts = [i for i, p in enumerate(group["params"]) if is_moe_param(p)]
        if experts:
            raise UsageError(
                f"parameter group {group.get('name', param_groups.index(group))!r}: parameter {experts[0]} is an "
                "expert parameter of a DeepSpeed MoE layer (allreduce=False); hf_zero has no mixture-of-experts "
                "support, so train this model with DeepSpeed"
            )
    return param_groups
