"""``deepspeed.runtime.zero.partition_parameters`` under hf_zero: ``ZeroParamStatus`` (what a stage-3
parameter's ``ds_status`` holds, ``hf_zero/zero/param_attrs.py``), ``Init`` and ``GatheredParameters``.

TRL gathers parameters whose ``ds_status`` is not ``ZeroParamStatus.AVAILABLE`` and imports the enum
from this path."""

from hf_zero.zero import GatheredParameters, Init
from hf_zero.zero.param_attrs import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
