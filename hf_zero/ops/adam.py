"""``deepspeed.ops.adam.FusedAdam``: DeepSpeed's Adam with its arguments, on PyTorch's fused kernel.

DeepSpeed's FusedAdam is a CUDA kernel that updates every tensor of a group in one launch;
PyTorch's ``Adam(fused=True)`` does the same, so FusedAdam here is ``torch.optim.Adam`` taking
DeepSpeed's arguments: ``adam_w_mode=True`` (its default) decouples weight decay as AdamW does,
``False`` adds it to the gradient (L2). Parameters not yet on a GPU (a model moved by
``initialize``, or built under ``zero.Init``) get the fused kernel when the engine places the
optimizer on the GPU shards. ``DeepSpeedCPUAdam`` exists for CPU offload, which hf_zero does
not do, so constructing it says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.errors import UsageError
from hf_zero.optim import _adam_kernel, _materialise

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise UsageError("FusedAdam(amsgrad=True): FusedAdam has no AMSGrad variant (DeepSpeed's neither); use torch.optim.Adam(amsgrad=True)")
        if not bias_correction:
            raise UsageError("FusedAdam(bias_correction=False) is not supported by hf_zero; leave it True")
        groups = _materialise(params)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, **_adam_kernel(groups))
        self.set_grad_none = set_grad_none
        self.hf_zero_fuse_on_device = True  # the engine turns the fused kernel on once the shards are on the GPU


class DeepSpeedCPUAdam:
    """Raises: DeepSpeed's CPU Adam serves ZeRO-Offload, which hf_zero does not implement."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(
            "DeepSpeedCPUAdam is for ZeRO-Offload (optimizer state in host memory), which hf_zero does not support yet; "
            "use hf_zero.ops.adam.FusedAdam or torch.optim.AdamW, and ZeRO stage 3 to fit larger models"
        )
