"""Sequence parallelism through transformers' Trainer and Accelerate, as users ask for it:
``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))``.

On 2 ranks with ``sp_size=2`` the ranks still draw different batches (Accelerate shards the loader
over all ranks); the loader hook transformers calls for ALST exchanges them and the group works
through both, one per micro-step (transformers counts ``len(loader) * sp`` micro-batches). With
``gradient_accumulation_steps=2`` that is exactly what plain DDP on 2 ranks does with one micro-step:
the same two batches per optimizer step, each with its own token mean (transformers' ALST loss; the
plain run is told not to average tokens across devices so that it means the same). So the hf_zero Trainer at
sp 2 must log the same losses and end with the same weights as transformers' plain Trainer at
world 2 (fp32, rel. 1e-4 as tests/test_trainer.py). The data has odd lengths, padding and ``-100``
prompts. The same spawn runs a plain Accelerate loop with ``ParallelismConfig(sp_size=2)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed import spawn

SEQ, VOCAB = 23, 64


def _model():  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64))


def _data():  # noqa: ANN202
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (24, SEQ), generator=g)
    labels, mask = ids.clone(), torch.ones_like(ids)
    for i in range(24):
        labels[i, : 3 + i % 9] = -100  # prompt
        end = SEQ - i % 5
        ids[i, end:], labels[i, end:], mask[i, end:] = 0, -100, 0  # right padding
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist(), "attention_mask": mask.tolist()})


def _trainer(rank: int, world: int, cases: list) -> list:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    out = []
    for case in cases:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        kw = dict(output_dir=case["dir"], per_device_train_batch_size=2, max_steps=3, learning_rate=5e-3, max_grad_norm=0.5,
                  logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                  gradient_accumulation_steps=case.get("gas", 1), average_tokens_across_devices=False)
        if case.get("stage") is not None:
            kw["zero_config"] = {"zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 40},
                                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                 "gradient_clipping": "auto"}
            kw["parallelism_config"] = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
        trainer = hf_zero.Trainer(model=_model(), args=hf_zero.TrainingArguments(**kw), train_dataset=_data())
        trainer.train()
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        out.append({"losses": losses, "weights": {k: v.float().reshape(-1).tolist() for k, v in state.items()},
                    "total_batch": trainer.get_total_train_batch_size(trainer.args)})
    out.append(_accelerate_loop(rank, world))
    return out


def _accelerate_loop(rank: int, world: int) -> dict:
    """hf_zero.Accelerator(parallelism_config=...): the loader prepared with the model yields this rank's shards."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ds = _data().with_format("torch")
    loader = torch.utils.data.DataLoader(ds, batch_size=2)
    model = _model()
    acc = hf_zero.Accelerator(cpu=True, zero_config={"zero_optimization": {"stage": 1}},
                              parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    batch = next(iter(loader))
    loss = model(**batch).loss
    acc.backward(loss)
    opt.step()
    return {"shard": list(batch["input_ids"].shape), "keys": sorted(batch), "loss": loss.item(), "n": len(loader)}


def test_trainer_with_parallelism_config_matches_plain_ddp(tmp_path: Path) -> None:
    cases = [{"dir": str(tmp_path / "plain")}, {"dir": str(tmp_path / "sp2"), "stage": 2, "gas": 2},
             {"dir": str(tmp_path / "sp2z3"), "stage": 3, "gas": 2}]
    results = spawn(_trainer, 2, cases)
    loops = [per_rank.pop() for per_rank in results]
    plain, *sp = results[0]
    for r in (plain, *sp):
        r["losses"] = {int(k): v for k, v in r["losses"].items()}
    assert sorted(plain["losses"]) == [1, 2, 3]
    for got in sp:
        assert got["total_batch"] == plain["total_batch"] == 4
        for step, loss in plain["losses"].items():
            assert abs(got["losses"][step] - loss) / loss < 1e-4, (step, got["losses"], plain["losses"])
        for n, w in plain["weights"].items():
            a, b = torch.tensor(got["weights"][n]), torch.tensor(w)
            assert float((a - b).norm() / b.norm()) < 1e-4, n
    for loop in loops:
        # a batch of 2 x 23 tokens padded to 24 and cut in two; 12 batches per rank, each worked through by both
        assert loop["shard"] == [2, 12] and "shift_labels" in loop["keys"] and "labels" not in loop["keys"], loop
        assert loop["n"] == 12
    assert loops[0]["loss"] == loops[1]["loss"]
