"""Every config of the corpus (tests/ds_corpus.py) through ``hf_zero.TrainingArguments(deepspeed=<file>)`` +
``hf_zero.Trainer`` on 2 gloo ranks, the file passed verbatim.

Each config either trains a tiny Llama (built from a config, 2 layers, hidden 16) for a few steps
to finite losses, with the weights moved and the ``save_model`` folder loading with
``from_pretrained`` to the weights the engine holds; or it is refused on both ranks when
``TrainingArguments`` is built (no model exists yet) with the sentence naming a feature hf_zero
lacks: offload or sequence parallelism, or the feature a DeepSpeed demo config exists to show.

The arguments are the ones a user of that config sets so that its explicit values agree, as
transformers requires under DeepSpeed (:func:`user_arguments`): the precision it enables (bf16
where it leaves it "auto" and has a bf16 section), its batch sizes, clipping, optimizer and
scheduler values. fp16 rows run in fp16 on the CPU: hf_zero's engine casts the weights and
scales the loss itself, where Accelerate would silently fall back to fp32 on a CPU device.

What each run showed is one line per config in ``tests/ds_corpus_trainer_runs.json``, which
``COMPATIBILITY.md``'s Trainer column is generated from; the test fails when a run shows anything
else, so the table cannot drift from the runs. The expected outcome is data, not code: which
configs are refused follows hf_zero's parser, so when a feature lands (offload, say) its rows
start training, the recorded lines no longer match, and ``HF_ZERO_UPDATE_TRAINER_RUNS=1`` rewrites
both files for review. A config that fails for an hf_zero bug goes in :data:`KNOWN_BUGS` with the
failure: a strict, named xfail, never a silent skip.

All the runs share one spawned pair of processes: starting Python and torch twice per config
would cost more than the training.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import spawn
from tests.ds_corpus import (
    COMPATIBILITY,
    CONFIGS,
    CORPUS,
    TRAINER_RUNS,
    TRAINER_STEPS,
    USER_GAS,
    USER_LR,
    USER_MICRO,
    Source,
    compatibility_markdown,
    refused_for,
)

pytestmark = pytest.mark.filterwarnings("ignore:hf_zero")  # the parser's warnings: tests/test_config_rules.py

WORLD = 2
STEPS = TRAINER_STEPS  # 3: a config's WarmupLR/WarmupDecayLR runs its first two steps at warmup_min_lr 0, as in DeepSpeed
SEQ, VOCAB = 8, 32
UPDATE_ENV = "HF_ZERO_UPDATE_TRAINER_RUNS"

# Configs that fail in the Trainer because of an hf_zero bug: file -> the failure. Each is an explicit xfail.
KNOWN_BUGS: dict[str, str] = {}


# ------------------------------------------------------------------ what a user of a config sets


def _explicit(value: Any) -> bool:
    return value is not None and value != "auto"


def _precision(config: dict) -> dict[str, bool]:
    """bf16/fp16 as the config enables them; where it leaves both "auto", bf16 if it has a bf16 section, else fp16."""
    sections = {"bf16": config.get("bf16", config.get("bfloat16")), "fp16": config.get("fp16")}
    enabled = {k: s.get("enabled") for k, s in sections.items() if isinstance(s, dict)}
    on = [k for k, v in enabled.items() if v is True]
    if on:
        return {on[0]: True}
    auto = [k for k, v in enabled.items() if v == "auto"]
    return {auto[0]: True} if auto else {}


def _batch(config: dict, world: int) -> dict[str, int]:
    """per_device_train_batch_size and gradient_accumulation_steps from the config's three batch keys."""
    micro, gas, total = (config.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                 "train_batch_size"))
    micro = int(micro) if _explicit(micro) else None
    gas = int(gas) if _explicit(gas) else None
    if _explicit(total):
        if micro is None:
            gas = gas or 1
            micro = int(total) // (gas * world)
        elif gas is None:
            gas = int(total) // (micro * world)
    return {"per_device_train_batch_size": micro or USER_MICRO, "gradient_accumulation_steps": gas or USER_GAS}


def user_arguments(config: dict, world: int) -> dict[str, Any]:
    """The ``TrainingArguments`` a user of ``config`` sets so that its explicit values agree with them.

    transformers (and hf_zero's Trainer) refuse a config whose explicit batch sizes, clipping,
    precision, optimizer or scheduler values contradict the arguments; a user reads them off the
    file. Where the config says "auto" (or nothing) the user picks: :data:`USER_LR`, :data:`USER_MICRO`,
    :data:`USER_GAS`, and bf16 where precision is "auto" in a config with a bf16 section.
    """
    kw: dict[str, Any] = {"learning_rate": USER_LR, **_precision(config), **_batch(config, world)}
    clip = config.get("gradient_clipping")
    if _explicit(clip):
        kw["max_grad_norm"] = float(clip)
    opt = (config.get("optimizer") or {}).get("params") or {}
    for key, arg in (("lr", "learning_rate"), ("weight_decay", "weight_decay"), ("eps", "adam_epsilon")):
        if _explicit(opt.get(key)):
            kw[arg] = float(opt[key])
    if _explicit(opt.get("betas")):
        kw["adam_beta1"], kw["adam_beta2"] = (float(b) for b in opt["betas"])
    sched = (config.get("scheduler") or {}).get("params") or {}
    if _explicit(sched.get("warmup_max_lr")):
        kw["learning_rate"] = float(sched["warmup_max_lr"])
    if _explicit(sched.get("warmup_num_steps")):
        kw["warmup_steps"] = int(sched["warmup_num_steps"])
    if _explicit(sched.get("total_num_steps")):
        kw["max_steps"] = int(sched["total_num_steps"])
    return kw


def arguments_text(kw: dict[str, Any]) -> str:
    """The user's arguments as the table shows them: ``bf16=True, learning_rate=0.001, ...``."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items())


# ------------------------------------------------------------------ one config, on every rank


def _model():  # noqa: ANN202
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # 4 heads and 4 key-value heads: tensor-parallel configs split them over up to 4 ranks
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ))


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run_one(file: str, out_dir: str, world: int) -> dict[str, Any]:
    """Build the arguments (a refusal ends here, before any model), then train, save and reload."""
    import hf_zero

    path = str(CONFIGS / file)
    kw = user_arguments(json.loads(Path(path).read_text()), world)
    asked = "bf16" if kw.get("bf16") else "fp16" if kw.get("fp16") else "fp32"
    result: dict[str, Any] = {"args": arguments_text(kw), "asked": asked}
    kw.setdefault("max_steps", STEPS)
    try:
        args = hf_zero.TrainingArguments(output_dir=out_dir, deepspeed=path, report_to="none", disable_tqdm=True,
                                         logging_steps=1, save_strategy="no", seed=0, **kw)
    except (hf_zero.ConfigError, hf_zero.UsageError) as e:
        return {**result, "refused": f"{type(e).__name__}: {e}"}
    try:
        return _train_save_reload(args, result, out_dir, world)
    except Exception as e:  # noqa: BLE001 - one failing config must not hide the others' results
        # (a failure every rank meets alike leaves the pair in step; a one-sided one ends the spawn anyway)
        return {**result, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _train_save_reload(args: Any, result: dict[str, Any], out_dir: str, world: int) -> dict[str, Any]:
    """A few steps on a tiny Llama; what the engine ran, the losses, and the save_model folder read back."""
    import torch
    from datasets import Dataset

    import hf_zero

    model = _model()
    before = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * world * args.max_steps
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (rows, SEQ), generator=g).tolist()
    trainer = hf_zero.Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))
    trainer.train()
    engine = trainer.engine
    result.update(
        stage=engine.zero_optimization_stage(), bf16=engine.config.bf16.enabled, fp16=engine.config.fp16.enabled,
        param_dtype=str(next(engine.module.parameters()).dtype).removeprefix("torch."),
        losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
        skipped=int(engine.skipped_steps),
    )
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    trainer.save_model(os.path.join(out_dir, "final"))
    if trainer.args.should_save:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "final"))
        got = loaded.state_dict()
        result["reloaded_class"] = type(loaded).__name__
        result["reload_diff"] = max(float((got[k].float() - w.float()).abs().max()) for k, w in weights.items())
        result["moved"] = max(float((got[k].float() - before[k]).abs().max()) for k in before)
    return result


def _grid(rank: int, world: int, files: list[str], root: str) -> list[dict]:
    out = []
    for i, file in enumerate(files):
        _reset()
        out.append(_run_one(file, os.path.join(root, str(i)), world))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every corpus config on 2 ranks: {file: [rank 0's result, rank 1's]} (one spawn for the whole corpus)."""
    out: dict[str, list[dict]] = {}
    by_world: dict[int, list[str]] = {}
    for s in CORPUS:
        by_world.setdefault(world_of(s), []).append(s.file)
    for world, files in sorted(by_world.items()):
        per_rank = spawn(_grid, world, files, str(tmp_path_factory.mktemp(f"corpus_trainer{world}")))
        # rank 0 and the last rank: under tensor parallelism they are in different groups, or at the ends of one
        out.update({f: [per_rank[0][i], per_rank[-1][i]] for i, f in enumerate(files)})
    return out


def world_of(source: Source) -> int:
    """2 ranks, or as many as a tensor-parallel config's autotp_size needs (DeepSpeed's own example asks for 4)."""
    tp = (json.loads((CONFIGS / source.file).read_text()).get("tensor_parallel") or {}).get("autotp_size") or 1
    return max(WORLD, int(tp))


# ------------------------------------------------------------------ what the runs show


def outcome(source: Source, result: dict) -> str:
    """The table's one line for a run (no loss values: they differ in the last digits between torch versions)."""
    if "refused" in result:
        return f"refused at `TrainingArguments` ({refused_for(result['refused'], source) or 'unexpectedly'})"
    if "error" in result:
        return f"fails in the Trainer (an hf_zero bug): `{result['error']}`"
    ranks = f" on {world_of(source)} ranks" if world_of(source) != WORLD else ""
    return (f"trains at stage {result['stage']} in {result['param_dtype']}{ranks}: {len(result['losses'])} steps, finite "
            f"losses, `save_model` reloads as {result['reloaded_class']}; with `{result['args']}`")


@pytest.mark.parametrize(
    "source",
    [pytest.param(s, id=s.file, marks=[pytest.mark.xfail(reason=KNOWN_BUGS[s.file], strict=True)] if s.file in KNOWN_BUGS else [])
     for s in CORPUS],
)
def test_config_trains_or_is_refused_for_a_missing_feature(runs: dict[str, list[dict]], source: Source) -> None:
    first, other = runs[source.file]
    assert "error" not in first and "error" not in other, (first.get("error"), other.get("error"))
    if "refused" in first:
        assert other.get("refused") == first["refused"], ("refused on one rank only", first, other)
        assert refused_for(first["refused"], source), f"{source.file} refused for something else: {first['refused']}"
        assert first["refused"].startswith("ConfigError: ") and "\n" not in first["refused"], first["refused"]
        return
    assert "refused" not in other, other
    assert other["losses"] == first["losses"], ("the ranks logged different losses", first, other)
    assert not source.refuses, f"{source.file} was expected to be refused ({source.refuses})"
    assert len(first["losses"]) == STEPS and all(math.isfinite(x) for x in first["losses"]), first
    assert first["moved"] > 0, f"{source.file}: {STEPS} steps left every weight where it started"
    assert first["reloaded_class"] == "LlamaForCausalLM"
    # the folder holds the weights the engine trained (saved in the weights' dtype: exact)
    assert first["reload_diff"] == 0.0, first
    # the engine ran the precision the arguments asked for (fp16 too: on CPU the engine holds fp16 weights)
    ran = "bf16" if first["bf16"] else "fp16" if first["fp16"] else "fp32"
    assert ran == first["asked"] and first["param_dtype"] == {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[ran], first


def test_trainer_runs_json_is_what_the_runs_show(runs: dict[str, list[dict]]) -> None:
    observed = {s.file: outcome(s, runs[s.file][0]) for s in CORPUS}
    if os.environ.get(UPDATE_ENV) == "1":
        TRAINER_RUNS.write_text(json.dumps(observed, indent=1) + "\n", encoding="utf-8")
        COMPATIBILITY.write_text(compatibility_markdown(), encoding="utf-8")
    recorded = json.loads(TRAINER_RUNS.read_text(encoding="utf-8")) if TRAINER_RUNS.exists() else {}
    for file, line in observed.items():
        assert recorded.get(file) == line, (
            f"{file}: the run shows {line!r}, {TRAINER_RUNS.name} says {recorded.get(file)!r}; "
            f"rerun this test with {UPDATE_ENV}=1 and review the diff")
    assert recorded.keys() == observed.keys()
