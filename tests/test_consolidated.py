"""Consolidated weights: ``engine.save_pretrained`` and ``hf-zero consolidate`` give folders that
``from_pretrained`` loads to exactly the engine's weights, single-file or sharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.distributed import spawn

SEQ = 8


def _model(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":  # tied embedding / LM head
        return GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4))
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def _save(rank: int, world: int, cases: list) -> list:
    import hf_zero
    from hf_zero.zero.init import GatheredParameters

    out = []
    for kind, stage, bf16, directory in cases:
        model = _model(kind)
        cfg = {
            "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 50},
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**6,
        }
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        ids = torch.randint(0, 61, (2, SEQ), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_pretrained(os.path.join(directory, "single"))
        engine.save_pretrained(os.path.join(directory, "sharded"), max_shard_size="20KB")
        engine.save_checkpoint(os.path.join(directory, "resume"))
        with GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
        out.append(weights)
    return out


def test_save_pretrained_and_consolidate_load_exactly(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.consolidated import consolidate

    cases = [["gpt2", 3, False], ["llama", 2, False], ["llama", 3, True]]
    dirs = [str(tmp_path / f"c{i}") for i in range(len(cases))]
    results = spawn(_save, 2, [c + [d] for c, d in zip(cases, dirs)])[0]
    for (kind, stage, bf16), d, weights in zip(cases, dirs, results):
        assert os.path.exists(os.path.join(d, "single", "model.safetensors"))
        assert not os.path.exists(os.path.join(d, "single", "model.safetensors.index.json"))
        index = json.loads(Path(d, "sharded", "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, (kind, stage)
        consolidate(os.path.join(d, "resume"), os.path.join(d, "offline"), max_shard_size="30KB", progress=False)
        for sub in ("single", "sharded", "offline"):
            m = AutoModelForCausalLM.from_pretrained(os.path.join(d, sub))
            want_dtype = torch.bfloat16 if bf16 and sub != "offline" else torch.float32
            got = dict(m.named_parameters())
            assert set(got) == set(weights), (kind, sub)
            for n, w in weights.items():
                assert got[n].dtype == want_dtype, (kind, sub, n, got[n].dtype)
                if sub == "offline" and bf16:
                    # the offline copy is the fp32 masters; the engine's bf16 weights are their rounding
                    assert torch.equal(got[n].detach().to(torch.bfloat16).float().reshape(-1), torch.tensor(w)), (kind, sub, n)
                else:
                    assert got[n].detach().float().reshape(-1).tolist() == w, (kind, stage, sub, n)
            if kind == "gpt2":
                assert m.lm_head.weight is m.transformer.wte.weight


def test_consolidate_command_line(tmp_path: Path) -> None:
    spawn(_save, 1, [["llama", 2, False, str(tmp_path)]])
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "hf_zero.launch.cli", "consolidate", str(tmp_path / "resume"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    bad = subprocess.run([sys.executable, "-m", "hf_zero.launch.cli", "consolidate", str(tmp_path / "nope"), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
