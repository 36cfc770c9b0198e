"""hf_zero's Trainer in float8 at ZeRO-3 on 2 CPU ranks: through the zero config's ``fp8`` section, and through
Accelerate's ``mixed_precision: fp8`` (an Accelerate YAML under ``accelerate launch``, and ``hf-zero launch
--config_file`` with ``--mixed_precision fp8``), which only set ``ACCELERATE_MIXED_PRECISION`` for the Trainer's
Accelerator to read.

Each run trains a few steps, evaluates and saves; the checks: the engine converted the 14 projections of the tiny
Llama (not its head) and gathered them as float8 at stage 3, the losses are finite and move, evaluation gives a
finite loss, and ``from_pretrained`` reads the saved folder as plain bf16 weights equal to the engine's (gathered
after training), with nothing float8 in the files or the config. tests/test_fp8.py holds the arithmetic oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.float8")

ROOT = Path(__file__).resolve().parent.parent
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class _Ids(torch.utils.data.Dataset):
    """Deterministic token rows (no network): a causal LM learns the repeated pattern within a few steps."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, 64, (4, 16), generator=g)
        self.rows = [base[i % 4] for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def job(out: str, zero_config: dict | None, bf16: bool = False) -> dict:
    """Train, evaluate and save with hf_zero's Trainer; what the checks read (rank 0 writes it to out/result.json)."""
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    import hf_zero
    from hf_zero import Trainer, TrainingArguments
    from hf_zero.zero.float8_gather import Float8ShardedParamGroup
    from tests.test_fp8 import _model

    args = TrainingArguments(output_dir=out, zero_config=zero_config, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, max_steps=6, learning_rate=3e-3, logging_steps=1,
                             save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=bf16)
    trainer = Trainer(model=_model(), args=args, train_dataset=_Ids(48, 1), eval_dataset=_Ids(8, 1))
    trainer.train()
    engine = trainer.engine
    f8 = [g for g in engine.zero_optimizer.stage3_groups if isinstance(g, Float8ShardedParamGroup)]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"mixed_precision": str(trainer.accelerator.mixed_precision), "bf16": engine.config.bf16.enabled,
              "fp8": engine.config.fp8.enabled, "recipe": engine.config.fp8.recipe,
              "layers": len(engine.float8_layers), "head": any("lm_head" in n for n in engine.float8_layers),
              "float8_groups": len(f8), "float8_gathers": sum(g.float8_gathers for g in f8), "losses": losses}
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {n: p.detach().to(torch.bfloat16).clone() for n, p in engine.module.named_parameters()}
    trainer.save_model(f"{out}/final")
    dist.barrier()
    if dist.get_rank() == 0:
        plain = LlamaForCausalLM.from_pretrained(f"{out}/final")
        result["loaded_class"] = type(plain.model.layers[0].self_attn.q_proj).__name__
        result["loaded_equal"] = all(torch.equal(p.detach().to(torch.bfloat16), trained[n]) for n, p in plain.named_parameters())
        with safe_open(f"{out}/final/model.safetensors", "pt") as f:
            result["saved_dtypes"] = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
        result["config_mentions_float8"] = "float8" in Path(f"{out}/final/config.json").read_text()
        result["loaded_loss"] = float(plain(**{k: v[None] for k, v in _Ids(1, 1)[0].items()}).loss)
        Path(out, "result.json").write_text(json.dumps(result))
    return result


def _check(r: dict) -> None:
    assert r["bf16"] and r["fp8"] and r["recipe"] == "tensorwise", r
    assert r["layers"] == 14 and not r["head"], r  # 7 projections a block, 2 blocks; the head stays bf16
    assert r["float8_groups"] == 2 and r["float8_gathers"] >= 4 * 6, r  # both units, forward and backward, each step
    losses = r["losses"]
    assert len(losses) == 6 and all(map(lambda x: x == x and abs(x) < 1e3, losses)) and losses[-1] < losses[0], losses
    assert r["eval_loss"] == r["eval_loss"] and r["eval_loss"] < losses[0], r
    assert r["loaded_class"] == "Linear" and r["loaded_equal"], r
    assert r["saved_dtypes"] == ["torch.bfloat16"] and not r["config_mentions_float8"], r
    assert abs(r["loaded_loss"]) < 1e3, r


def _section(rank: int, world: int, out: str) -> dict:
    return job(out, {**ZERO3, "bf16": {"enabled": "auto"}, "fp8": {"enabled": True}}, bf16=True)


def test_trainer_with_the_fp8_section_trains_evaluates_and_saves_plain_weights(tmp_path: Path) -> None:
    from tests.distributed import spawn

    res = spawn(_section, 2, str(tmp_path))
    _check(res[0])
    assert res[0]["mixed_precision"] in ("no", "bf16"), res[0]  # the section alone, no Accelerate fp8


def _launched(argv: list[str], tmp: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.run([sys.executable, *argv, str(Path(__file__)), str(tmp)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp / "result.json").read_text())


def test_accelerate_yaml_mixed_precision_fp8_runs_the_trainer_in_float8(tmp_path: Path) -> None:
    yaml = (ROOT / "configs" / "accelerate_cpu.yaml").read_text().replace("mixed_precision: 'no'", "mixed_precision: fp8")
    assert "mixed_precision: fp8" in yaml
    cfg = tmp_path / "fp8.yaml"
    cfg.write_text(yaml.replace("main_process_port: 29533", f"main_process_port: {_free_port()}"))
    r = _launched(["-m", "accelerate.commands.launch", "--config_file", str(cfg)], tmp_path)
    _check(r)
    assert r["mixed_precision"] == "fp8", r


def test_hf_zero_launch_mixed_precision_fp8_runs_the_trainer_in_float8(tmp_path: Path) -> None:
    # a DeepSpeed YAML whose ZeRO config is a file (the tiny model's weights sharded, not kept whole as persistent)
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    (tmp_path / "ds.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                      f"  deepspeed_config_file: {tmp_path / 'zero3.json'}\n")
    r = _launched(["-m", "hf_zero.launch.cli", "launch", "--config_file", str(tmp_path / "ds.yaml"), "--mixed_precision", "fp8",
                   "--main_process_port", str(_free_port())], tmp_path)
    _check(r)
    assert r["mixed_precision"] == "fp8", r


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # one rank of a launched run: the config leaves precision to mixed_precision
    from hf_zero.integrations import deepspeed_plugin

    # under hf-zero launch --config_file the DeepSpeed YAML is the zero config, as transformers takes Accelerate's plugin
    job(sys.argv[1], None if deepspeed_plugin.launched_with_deepspeed_yaml() else dict(ZERO3))
