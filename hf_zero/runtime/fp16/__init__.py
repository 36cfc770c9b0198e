"""DeepSpeed's module path ``deepspeed.runtime.fp16``: holds DeepSpeed's stage-0 mixed-precision wrapper's class, for ``isinstance``."""
