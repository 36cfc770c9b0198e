"""DeepSpeed's module path ``deepspeed.ops.adam``: re-exports hf_zero.optim's ``FusedAdam`` and ``DeepSpeedCPUAdam``.

DeepSpeed's FusedAdam is a CUDA kernel that updates every tensor of a group in one launch;
PyTorch's ``Adam(fused=True)`` does the same, so FusedAdam here is ``torch.optim.Adam`` taking
DeepSpeed's arguments: ``adam_w_mode=True`` (its default) decouples weight decay as AdamW does,
``False`` adds it to the gradient (L2). Parameters not yet on a GPU (a model moved by
``initialize``, or built under ``zero.Init``) get the fused kernel when the engine places the
optimizer on the GPU shards. ``DeepSpeedCPUAdam`` (Adam on host tensors, for ZeRO-Offload) lives
in ``hf_zero/optim/cpu_adam.py`` and is re-exported here under DeepSpeed's path. FusedAdam itself is defined in
``hf_zero/optim/optimizers.py``, which builds it for a config's ``Adam``/``AdamW`` as DeepSpeed does.
"""

from __future__ import annotations

from hf_zero.optim.cpu_adam import DeepSpeedCPUAdam
from hf_zero.optim.optimizers import FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
