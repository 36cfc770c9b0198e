"""DeepSpeed's module path ``deepspeed.accelerator``: re-exports hf_zero.distributed.device's ``get_accelerator``.

The device calls DeepSpeed scripts make (``get_accelerator().device_name()``...) are answered by
:mod:`hf_zero.distributed.device`; this path exists so that ``import hf_zero as deepspeed`` scripts find them where DeepSpeed
puts them. It is not Accelerate's ``Accelerator`` (that is :mod:`hf_zero.integrations.accelerate`).
"""

from __future__ import annotations

from hf_zero.distributed.device import DeviceAccelerator, get_accelerator

__all__ = ["DeviceAccelerator", "get_accelerator"]
