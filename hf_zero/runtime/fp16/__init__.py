"""``deepspeed.runtime.fp16`` under hf_zero: DeepSpeed's stage-0 mixed-precision wrapper's class, for ``isinstance``."""
