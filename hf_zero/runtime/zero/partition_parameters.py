"""DeepSpeed's module path ``deepspeed.runtime.zero.partition_parameters``: re-exports ``ZeroParamStatus`` (what a stage-3
parameter's ``ds_status`` holds, ``hf_zero/zero/param_attrs.py``), ``Init``, ``GatheredParameters`` and
``partitioned_param_data_shape``.

TRL gathers parameters whose ``ds_status`` is not ``ZeroParamStatus.AVAILABLE`` and imports the enum
from this path. ``partitioned_param_data_shape`` is the shape of a partitioned parameter's data, ``[0]``: true of a
parameter built under ``zero.Init`` outside a gather, as in DeepSpeed; a stage-3 engine's parameter keeps its shape
between gathers instead (its storage is released, ``hf_zero/zero/param_attrs.py`` says why)."""

from hf_zero.zero import GatheredParameters, Init
from hf_zero.zero.param_attrs import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partitioned_param_data_shape"]

partitioned_param_data_shape = [0]
