"""``deepspeed.runtime.config.DeepSpeedConfig`` under hf_zero (``hf_zero/config/deepspeed_view.py``) against DeepSpeed 0.19.8's.

The oracle is DeepSpeed's own class, run in its environment (``tests/dsenv.py``): the same script builds a config
with each side's class and prints what it answers; both sides run it as a subprocess, with one process group of one
gloo rank and an ``mpu`` that reports a data-parallel world of 2, then 3 (DeepSpeed reads the batch split from it).
Compared: the batch triple over every subset of given sizes (derived values, or the refusal, which DeepSpeed makes an
``AssertionError``), and the attributes DeepSpeed's users read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import dsenv

SCRIPT = r'''
import json, os, sys
import torch.distributed as dist

side = sys.argv[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
if side == "deepspeed":
    import deepspeed.comm
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    from deepspeed.runtime.config import DeepSpeedConfig
else:
    dist.init_process_group("gloo", rank=0, world_size=1)
    from hf_zero.runtime.config import DeepSpeedConfig


class Mpu:
    def get_data_parallel_world_size(self):
        return world


out = {"batch": [], "attrs": []}
for world in (2, 3):
  cfg = DeepSpeedConfig({"train_batch_size": 2 * world, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                         "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4}}}, mpu=Mpu())
  for t in (1, 6, 7, 12, 33):
      for m in (1, 2, 3, 17):
          for g in (1, 2, 3):
              for given in ("tmg", "tm", "tg", "mg", "m", "t", "g", ""):
                  cfg.train_batch_size = t if "t" in given else None
                  cfg.train_micro_batch_size_per_gpu = m if "m" in given else None
                  cfg.gradient_accumulation_steps = g if "g" in given else None
                  try:
                      cfg._configure_train_batch_size()
                      got = [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps]
                  except AssertionError:
                      got = "AssertionError"
                  out["batch"].append([t, m, g, given, got])

  configs = [
      {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 7,
       "wall_clock_breakdown": True, "gradient_clipping": 0.5,
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1000,
                             "stage3_prefetch_bucket_size": 77},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, "bf16": {"enabled": True}},
      {"train_batch_size": 4 * world, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
       "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
      {"train_batch_size": 3 * world},
  ]
  for c in configs:
      d = DeepSpeedConfig(c, mpu=Mpu())
      fp16 = d.float16_config
      out["attrs"].append({
          "batch": [d.train_batch_size, d.train_micro_batch_size_per_gpu, d.gradient_accumulation_steps],
          "world_size": d.world_size, "global_rank": d.global_rank,
          "stage": d.zero_optimization_stage, "zero_enabled": d.zero_enabled, "zero_config.stage": d.zero_config.stage,
          "persistence": d.zero_config.param_persistence_threshold, "prefetch": d.zero_config.prefetch_bucket_size,
          "reduce_bucket_size": d.zero_config.reduce_bucket_size,
          "fp16": fp16.enabled, "loss_scale": fp16.loss_scale, "initial_scale_power": fp16.initial_scale_power,
          "bf16": d.bfloat16_config.enabled if side == "deepspeed" else d.bfloat16_enabled,
          "clip": d.gradient_clipping, "optimizer": d.optimizer_name, "optimizer_params": d.optimizer_params,
          "scheduler": d.scheduler_name, "scheduler_params": d.scheduler_params, "steps_per_print": d.steps_per_print,
          "wall_clock_breakdown": d.wall_clock_breakdown, "same_dict": d._param_dict is c,
      })
print("RESULT " + json.dumps(out))
'''


def _answers(side: str, tmp_path) -> dict:  # noqa: ANN001
    script = tmp_path / "view.py"
    script.write_text(SCRIPT)
    port = str(dsenv._free_port())
    if side == "deepspeed":
        python, env = str(dsenv.deepspeed_python()), dsenv.ds_environ()
    else:
        python, env = sys.executable, {**os.environ, "PYTHONPATH": str(dsenv.REPO)}
    done = subprocess.run([python, str(script), side, port], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_batch_arithmetic_and_attributes_match_deepspeed(tmp_path) -> None:  # noqa: ANN001
    ours, theirs = _answers("hf_zero", tmp_path), _answers("deepspeed", tmp_path)
    assert len(ours["batch"]) == len(theirs["batch"]) == 2 * 480
    differ = [(a, b) for a, b in zip(ours["batch"], theirs["batch"]) if a != b]
    assert not differ, differ[:5]
    refused = sum(r[-1] == "AssertionError" for r in theirs["batch"])
    assert 0 < refused < len(theirs["batch"])  # both outcomes are exercised
    for a, b in zip(ours["attrs"], theirs["attrs"], strict=True):
        if b["steps_per_print"] is None:  # not in the config: DeepSpeed 0.19.8 never prints, hf_zero every 10 steps
            assert a.pop("steps_per_print") == 10 and b.pop("steps_per_print") is None  # (the view says what it does)
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}


def test_view_follows_hf_zero_and_names_what_it_lacks(tmp_path) -> None:  # noqa: ANN001
    """Without a process group: one rank of one, as DeepSpeed; a file path; hf_zero's refusals; a missing attribute."""
    from hf_zero.errors import BatchSizeError, ConfigError
    from hf_zero.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2}))
    cfg = DeepSpeedConfig(str(path))
    assert (cfg.global_rank, cfg.world_size) == (0, 1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 2)
    assert cfg.optimizer_name is None and cfg.zero_optimization_stage == 0 and not cfg.zero_enabled
    cfg.train_micro_batch_size_per_gpu = 3
    with pytest.raises(AssertionError, match="train_batch_size: got 8"):
        cfg._configure_train_batch_size()
    cfg.train_batch_size = 0
    with pytest.raises(BatchSizeError, match="train_batch_size: got 0, expected an integer >= 1"):
        cfg._configure_train_batch_size()
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage"):  # hf_zero's parser, its sentence
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match="neither an existing file nor a base64"):
        DeepSpeedConfig(str(tmp_path / "missing.json"))
    with pytest.raises(AttributeError, match=r"DeepSpeedConfig.hybrid_engine: .* read the key from ._param_dict"):
        cfg.hybrid_engine  # noqa: B018
    with pytest.raises(AttributeError, match="zero_config.overlap_comm: hf_zero does not act on"):
        DeepSpeedConfig({"train_batch_size": 1}).zero_config.overlap_comm  # noqa: B018
    # the batch refusal is hf_zero's too: initialize's ConfigError, and DeepSpeed's AssertionError
    assert issubclass(BatchSizeError, ConfigError) and issubclass(BatchSizeError, AssertionError)
