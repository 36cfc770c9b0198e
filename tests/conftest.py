"""pytest settings for hf_zero's own suite."""

# DeepSpeed's unit tests, vendored for the conformance harness (python -m tests.conformance.run), which runs
# them in pytest sessions of their own under DeepSpeed and under hf_zero; they are not hf_zero's tests.
collect_ignore = ["conformance/deepspeed_unit"]
