"""``activation_checkpointing.checkpoint_blocks``: blocks are recomputed in backward, so the activation
peak falls (measured), at stages 2 and 3; the numbers stay the same (tests/test_stage3.py has the
parity cases with it on)."""

from __future__ import annotations

import torch

from tests.distributed import spawn
from tests.memtrack import PeakBytes


def _peaks(rank: int, world: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    out = {}
    for stage in (2, 3):
        for on in (False, True):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256))
            cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
                   "activation_checkpointing": {"checkpoint_blocks": on}}
            engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
            ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(1))
            losses = []
            for step in range(2):
                if step == 1:
                    with PeakBytes() as m:
                        loss = engine(input_ids=ids, labels=ids).loss
                        engine.backward(loss)
                else:
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[f"{stage}-{on}"] = {"peak": m.peak, "losses": losses}
    return out


def test_checkpoint_blocks_lowers_the_activation_peak() -> None:
    r = spawn(_peaks, 1)[0]
    for stage in (2, 3):
        off, on = r[f"{stage}-False"], r[f"{stage}-True"]
        assert on["peak"] < 0.7 * off["peak"], (stage, on["peak"], off["peak"])
        for a, b in zip(on["losses"], off["losses"]):
            assert abs(a - b) / b < 1e-6, (stage, on["losses"], off["losses"])
