"""What DeepSpeed's engine getters answer for a config: the oracle of tests/test_ds_getters.py.

Under DeepSpeed 0.19.8 (its interpreter, ``DS_ACCELERATOR=cpu``, gloo; ``tests/dsenv.py:run_torchrun`` starts it)::

    python -m torch.distributed.run --nproc-per-node 1 tests/ds_oracle_getters.py OUT.json

builds one engine per config of :data:`CONFIGS` and writes :func:`observe` of each. The test runs the same
:func:`observe` on hf_zero's engines (``hf_zero`` passed as ``deepspeed``) and compares. Nothing of hf_zero is
imported on the oracle side.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

_BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}

#: name -> config; each differs from DeepSpeed's defaults where a getter reads it
CONFIGS: dict[str, dict[str, Any]] = {
    "stage 0 fp32, defaults": {**_BASE, "zero_optimization": {"stage": 0}},
    "stage 1 bf16, clipping, scheduler": {
        **_BASE, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 7}},
        "steps_per_print": 5, "wall_clock_breakdown": True,
    },
    # DeepSpeed refuses fp16 on the CPU ("Type fp16 is not supported on your device"): the section is read with it off
    "stage 2, fp16 section off, buckets": {
        **_BASE, "fp16": {"enabled": False, "loss_scale": 128, "initial_scale_power": 12, "auto_cast": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 12345},
    },
    "stage 3, knobs, torch_autocast": {
        **_BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 777, "stage3_param_persistence_threshold": 55,
                                       "stage3_max_live_parameters": 9999, "stage3_max_reuse_distance": 8888,
                                       "ignore_unused_parameters": False},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    },
}

#: the getters compared (methods of DeepSpeed's engine, called without arguments). Not get_batch_info: DeepSpeed
#: 0.19.8's returns its three getter methods themselves, uncalled; hf_zero's returns their values.
GETTERS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization_stage", "bfloat16_enabled", "fp16_enabled", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "zero_reduce_bucket_size", "zero_prefetch_bucket_size", "zero_param_persistence_threshold",
    "zero_max_live_parameters", "zero_max_reuse_distance", "zero_ignore_unused_parameters",
    "zero_optimization_partition_gradients", "zero_optimization_partition_weights", "zero_cpu_offload",
    "zero_nvme_offload_optimizer", "fp16_auto_cast", "dynamic_loss_scale", "initial_dynamic_scale",
    "torch_autocast_enabled", "torch_autocast_dtype", "optimizer_params", "scheduler_name", "scheduler_params",
)


def _plain(v: Any) -> Any:
    """A getter's value as JSON: dtypes by name, tuples as lists."""
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return f"a {type(v).__name__}"


def _call(engine: Any, getter: str) -> Any:
    """The getter's value, or the kind of error it raised (a getter the engine lacks is a difference to show)."""
    try:
        return _plain(getattr(engine, getter)())
    except Exception as e:
        return f"raised {type(e).__name__}"


def observe(ds: Any) -> dict[str, dict[str, Any]]:
    """Every getter of :data:`GETTERS` on an engine ``ds.initialize`` builds for each config (one rank)."""
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        try:
            engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        except Exception as e:  # a config one side refuses is a finding too
            out[name] = {"initialize": f"{type(e).__name__}: {e}"}
            continue
        out[name] = {g: _call(engine, g) for g in GETTERS}
        engine.destroy()
    return out


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    with open(sys.argv[1], "w") as f:
        json.dump(observe(deepspeed), f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # leave without gloo's C++ teardown (tests/distributed.py says why)


if __name__ == "__main__":
    main()
