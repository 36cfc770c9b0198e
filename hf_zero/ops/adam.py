"""``deepspeed.ops.adam.FusedAdam``: DeepSpeed's Adam with its arguments, on PyTorch's fused kernel.

DeepSpeed's FusedAdam is a CUDA kernel that updates every tensor of a group in one launch;
PyTorch's ``Adam(fused=True)`` does the same, so FusedAdam here is ``torch.optim.Adam`` taking
DeepSpeed's arguments: ``adam_w_mode=True`` (its default) decouples weight decay as AdamW does,
``False`` adds it to the gradient (L2). Parameters not yet on a GPU (a model moved by
``initialize``, or built under ``zero.Init``) get the fused kernel when the engine places the
optimizer on the GPU shards. ``DeepSpeedCPUAdam`` (Adam on host tensors, for ZeRO-Offload) lives
in ``hf_zero/ops/cpu_adam.py`` and is re-exported here under DeepSpeed's path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.engine import UsageError
from hf_zero.ops.cpu_adam import DeepSpeedCPUAdam
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
