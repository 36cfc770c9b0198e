"""``deepspeed.runtime.config`` under hf_zero: ``DeepSpeedConfigError`` is hf_zero's ``ConfigError``.

Every config hf_zero refuses raises :class:`hf_zero.errors.ConfigError` (a ``ValueError``), one
sentence with the JSON path; naming the class DeepSpeed's way lets ``except DeepSpeedConfigError``
(and ``pytest.raises(deepspeed.DeepSpeedConfigError)``) catch those refusals.
"""

from hf_zero.errors import ConfigError

__all__ = ["DeepSpeedConfigError"]

DeepSpeedConfigError = ConfigError
