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

The degree may also come from the DeepSpeed config alone (``"sequence_parallel_size"``, or LLaMA-Factory's
``sequence_parallel`` section): LLaMA-Factory's ALST config (tests/ds_configs/sequence_parallel/) through
``TrainingArguments(deepspeed=...)`` on 4 ranks, bf16, against the same config without SP on one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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


# ------------------------------------------------- the degree from the DeepSpeed config itself (no ParallelismConfig)

ALST = Path(__file__).resolve().parent / "ds_configs" / "sequence_parallel" / "llamafactory_ds_z3_alst_config.deepspeed.json"


def _alst_run(out_dir: str, world: int, fp32: bool = False) -> dict:
    """LLaMA-Factory's ALST config (ZeRO-3, optimizer and parameter offload, bf16, degree 4) through
    ``TrainingArguments(deepspeed=...)`` alone; on one process the same config without its sequence-parallel keys,
    each micro-batch its own token mean (``model_accepts_loss_kwargs`` off, as transformers sets it under ALST) so
    that both runs mean the same loss; ``fp32``: the same with ``bf16`` off."""
    import json

    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = json.loads(ALST.read_text())
    if world == 1:
        config = {k: v for k, v in config.items() if k not in ("sequence_parallel_size", "sequence_parallel")}
    if fp32:
        config["bf16"] = {"enabled": False}
    args = hf_zero.TrainingArguments(deepspeed=config, **_alst_args(out_dir, bf16=not fp32))
    trainer = hf_zero.Trainer(model=_model(), args=args, train_dataset=_data())
    if world == 1:
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    engine = trainer.engine
    groups = engine.sequence_parallel_groups
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    out = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
           "weights": {k: v.float().reshape(-1).tolist() for k, v in state.items()},
           "sp": groups.sp_size if groups is not None else 1, "total_batch": trainer.get_total_train_batch_size(args),
           "optimizer_steps": engine.global_steps, "stage": engine.zero_optimization_stage(), "dtype": str(engine.compute_dtype),
           "offload": [engine.config.zero_optimization.offload_optimizer is not None,
                       engine.config.zero_optimization.offload_param is not None]}
    if world == 1:  # the largest logit the trained model gives on the data (the loss tolerance's scale)
        data = _data()[:]
        with torch.no_grad():
            logits = trainer.model_wrapped(input_ids=torch.tensor(data["input_ids"]),
                                           attention_mask=torch.tensor(data["attention_mask"])).logits
        out["max_logit"] = float(logits.float().abs().max())
    return out


def _alst_args(out_dir: str, bf16: bool = True) -> dict:
    return dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=1e-2, warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, bf16=bf16, logging_steps=1,
                report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                train_sampling_strategy="sequential")  # so that one process draws the batches in the same order


def _alst(rank: int, world: int, out_dir: str) -> list:
    if world == 1:
        return [_alst_run(f"{out_dir}/one", 1), _alst_run(f"{out_dir}/one32", 1, fp32=True)]
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState

    import hf_zero

    both = {}
    for sp in (4, 2):  # the degree in both places: the same value is one setting, another is refused
        try:
            hf_zero.TrainingArguments(deepspeed=str(ALST), parallelism_config=ParallelismConfig(sp_size=sp), **_alst_args(out_dir))
            both[sp] = "accepted"
        except Exception as e:  # noqa: BLE001 - the sentence is the result
            both[sp] = f"{type(e).__name__}: {e}"
        AcceleratorState._reset_state(True)
    return [_alst_run(f"{out_dir}/sp", world), both]


def _rel_weights(a: dict, b: dict) -> float:
    return max(float((torch.tensor(a[n]) - torch.tensor(b[n])).norm() / torch.tensor(b[n]).norm()) for n in b)


def test_a_deepspeed_configs_own_sequence_parallel_size_runs_through_the_trainer(tmp_path: Path) -> None:
    """LLaMA-Factory's ALST config on 4 ranks with no ParallelismConfig: the Trainer takes degree 4 from the config,
    splits the batches, and trains as the same config without sequence parallelism on one process.

    Tolerances (bf16 compute, fp32 masters; the arithmetic, not a measurement elsewhere):

    - Losses. SP regroups sums (each rank's sequence quarter, a quarter of the heads in attention, the token sum
      of the loss in four parts); in fp32 that leaves the runs ~1e-7 apart (test_sequence_parallel_engine). In bf16
      a regrouped sum can round to the neighbouring bf16 value: with 8 significant bits, one ulp is at most 2^-7 of
      the value, so a logit z may differ by |dz| <= 2^-7 |z| between the runs. A token's loss -log softmax(z)_y
      moves by at most sum_j |p_j - [j = y]| * |dz_j| <= 2 max|dz|, so the mean loss L by at most 2^-6 max|z|,
      relative 2^-6 max|z| / L (max|z| measured on the trained one-process model, on the training data).
    - Weights. After Adam steps the bf16 weights of two runs whose gradients round differently are not within
      an ulp (Adam normalises each element's step, so where a gradient is as small as its rounding the step's sign
      is a coin toss), and no bound follows from bf16's precision alone. What does: each run is some distance
      from exact arithmetic, so they are at most the sum apart; the one-process run's distance from the same run
      in fp32 measures it here, and SP rounds the same values (plus its partial gradients once more), so the
      tolerance is twice that distance (triangle inequality), on the same CPU, with the same kernels.
    """
    import time

    start = time.perf_counter()
    sp_results = spawn(_alst, 4, str(tmp_path))
    one, one32 = spawn(_alst, 1, str(tmp_path))[0]
    seconds = time.perf_counter() - start
    both = {int(k): v for k, v in sp_results[0][1].items()}
    assert both[4] == "accepted", both
    assert both[2] == ("SequenceParallelError: zero_config asks for sequence-parallel degree 4 (sequence_parallel_size) "
                       "but the ParallelismConfig has sp_size=2; give the degree in one place, or the same value in both")
    for r in (one, one32, *(x[0] for x in sp_results)):
        r["losses"] = {int(k): v for k, v in r["losses"].items()}
    assert sorted(one["losses"]) == [1, 2, 3, 4]
    loss_tol = 2.0**-6 * one["max_logit"] / min(one["losses"].values())
    bf16_vs_fp32 = _rel_weights(one["weights"], one32["weights"])
    init = {k: v.float().reshape(-1).tolist() for k, v in _model().state_dict().items()}
    moved = _rel_weights(one["weights"], {n: init[n] for n in one["weights"]})
    assert moved > 10 * 2 * bf16_vs_fp32, (moved, bf16_vs_fp32)  # the run trains: the weights moved far beyond the tolerance
    errors = []
    for got, _ in sp_results:
        assert got["sp"] == 4 and got["stage"] == 3 and got["offload"] == [True, True], got
        assert got["dtype"] == one["dtype"] == "torch.bfloat16" and one["sp"] == 1
        assert got["total_batch"] == one["total_batch"] == 4 and got["optimizer_steps"] == one["optimizer_steps"] == 4
        errors.append((max(abs(got["losses"][s] - v) / v for s, v in one["losses"].items()),
                       _rel_weights(got["weights"], one["weights"])))
        assert errors[-1][0] <= loss_tol, (got["losses"], one["losses"], loss_tol)
        assert errors[-1][1] <= 2 * bf16_vs_fp32, (errors[-1][1], bf16_vs_fp32)
    loss_err, w_err = (max(e[i] for e in errors) for i in (0, 1))
    print(f"SP 4 vs one process (bf16): losses {loss_err:.3g} (tolerance {loss_tol:.3g}), weights {w_err:.3g} "
          f"(tolerance 2 x {bf16_vs_fp32:.3g}); weights moved {moved:.3g}; {seconds:.0f} s")


def test_the_degree_comes_from_either_place_and_both_must_agree() -> None:
    """resolve_sp_size, which TrainingArguments and the Trainer ask: the verbatim LLaMA-Factory file names its degree
    only in its own section, which counts as the config's; a ParallelismConfig alone, or the same value twice, is one
    setting; two different values are refused, naming where each came from."""
    import json

    from accelerate.parallelism_config import ParallelismConfig

    from hf_zero.sequence.groups import SequenceParallelError
    from hf_zero.sequence.setup import config_sp_size, parallelism_config_for, resolve_sp_size

    verbatim = json.loads((ALST.parent / "llamafactory_ds_z3_alst_config.json").read_text())
    assert config_sp_size(verbatim) == (4, "its sequence_parallel section")
    assert config_sp_size(json.loads(ALST.read_text())) == (4, "sequence_parallel_size")
    assert config_sp_size({"sequence_parallel_size": "auto"}) == (1, "") and config_sp_size(None) == (1, "")
    assert resolve_sp_size(None, verbatim) == 4 and resolve_sp_size(ParallelismConfig(sp_size=2), {}) == 2
    assert resolve_sp_size(ParallelismConfig(sp_size=4), verbatim) == 4
    with pytest.raises(SequenceParallelError, match=r"degree 4 \(its sequence_parallel section\) but the ParallelismConfig "
                                                    r"has sp_size=2; give the degree in one place"):
        resolve_sp_size(ParallelismConfig(sp_size=2), verbatim)
    made = parallelism_config_for(None, 4)
    assert (made.sp_size, made.sp_backend, made.sp_enabled) == (4, "deepspeed", True)
    given = ParallelismConfig(sp_size=4)
    assert parallelism_config_for(given, 4) is given
