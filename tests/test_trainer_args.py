"""What happens when ``hf_zero.TrainingArguments`` / ``Trainer`` / ``Accelerator`` are built, in one process:

- ``deepspeed=`` is ``zero_config=`` (path or dict), ``HfArgumentParser`` takes ``--deepspeed`` and
  ``--zero_config``, and nothing afterwards sends transformers down its DeepSpeed branches (the
  ``deepspeed`` package is never imported);
- the config is checked at once by hf_zero's parser: a misspelt key, an unsupported feature or a bad
  optimizer/scheduler parameter stops the script before any model is loaded; ignored keys warn once;
- the combinations of config sections and optimizers/schedulers built in code that transformers and
  Accelerate refuse under DeepSpeed are refused here, each with one sentence.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hf_zero.config import ConfigError
from hf_zero.engine import UsageError

SECTIONS = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}


@pytest.fixture(autouse=True)
def _fresh_state():  # noqa: ANN202
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield


def _args(tmp_path: Path, **kw):  # noqa: ANN202
    import hf_zero

    return hf_zero.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)


def test_deepspeed_is_zero_config_and_both_flags_parse(tmp_path: Path) -> None:
    from transformers import HfArgumentParser

    import hf_zero

    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    parser = HfArgumentParser(hf_zero.TrainingArguments)
    for flag in ("--deepspeed", "--zero_config"):
        (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", flag, str(path)])
        assert (args.zero_config, args.deepspeed, args.zero_config_dict) == (str(path), None, cfg)
        assert args.distributed_state.distributed_type.name == "NO"  # not DEEPSPEED: transformers' branches stay off
    by_dict = _args(tmp_path, deepspeed=cfg)
    assert by_dict.zero_config == cfg and by_dict.deepspeed is None and by_dict.to_dict()["zero_config"] == cfg
    trainer = hf_zero.Trainer(model=torch.nn.Linear(2, 2), args=by_dict)
    assert trainer.zero_enabled and not trainer.is_deepspeed_enabled
    assert "deepspeed" not in sys.modules
    with pytest.raises(ValueError, match="got both zero_config and deepspeed"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--deepspeed", str(path), "--zero_config", str(path)])


@pytest.mark.parametrize("config, message", [
    ({"zero_optimisation": {"stage": 2}}, "zero_optimisation: unknown key; did you mean 'zero_optimization'?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}, "without offload_optimizer is not supported yet"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}}, "scheduler.params.warmup_num_step: unknown parameter"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": 0.9}}}, "optimizer.params.betas: got 0.9"),
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu: config has 4, TrainingArguments has 8"),
])
def test_the_config_is_checked_when_the_arguments_are_built(config: dict, message: str, tmp_path: Path) -> None:
    import hf_zero

    with pytest.raises((ConfigError, UsageError)) as info:
        _args(tmp_path, zero_config=config)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    if isinstance(info.value, ConfigError):  # Accelerate's side checks at construction too
        with pytest.raises(ConfigError, match=message.split(":")[0]):
            hf_zero.Accelerator(cpu=True, zero_config=config)


def test_an_ignored_key_warns_once(tmp_path: Path) -> None:
    import torch.distributed as dist

    import hf_zero

    cfg = {"zero_optimization": {"stage": 2}, "memory_breakdown": True, "train_micro_batch_size_per_gpu": "auto"}
    had_group = dist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = _args(tmp_path, zero_config=cfg)
        trainer = hf_zero.Trainer(model=torch.nn.Linear(2, 2), args=args, train_dataset=[{"x": 0}])
        try:  # parsed again on the way to the engine: said no second time
            trainer.accelerator.prepare(trainer.model, torch.optim.SGD(trainer.model.parameters(), lr=0.1))
        finally:
            if not had_group and dist.is_initialized():
                dist.destroy_process_group()
    named = [w for w in caught if "memory_breakdown" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]


def test_asking_for_cuda_without_gpus_is_one_sentence(tmp_path: Path) -> None:
    import torch.distributed as dist

    import hf_zero

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="ddp_backend='nccl' needs CUDA GPUs and this machine has none"):
        _args(tmp_path, zero_config={"zero_optimization": {"stage": 1}}, ddp_backend="nccl")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match=r"dist_backend='nccl'\): NCCL needs CUDA GPUs and none is visible here"):
            hf_zero.init_distributed(dist_backend="nccl")


def test_trainer_refuses_a_section_and_an_object_for_the_same_thing(tmp_path: Path) -> None:
    import hf_zero

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cases = [
        ({"optimizer": SECTIONS["optimizer"]}, {"optimizers": (opt, None)}, "optimizer section and the Trainer was given an optimizer"),
        ({"optimizer": SECTIONS["optimizer"]}, {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1})}, "optimizer section"),
        ({"scheduler": SECTIONS["scheduler"]}, {"optimizers": (opt, sched)}, "scheduler section and the Trainer was given a scheduler"),
        ({"optimizer": SECTIONS["optimizer"]}, {"optimizers": (None, sched)}, "builds the optimizer it would drive"),
    ]
    for config, given, message in cases:
        args = _args(tmp_path, zero_config={"zero_optimization": {"stage": 1}, **config})
        with pytest.raises(UsageError, match=message):
            hf_zero.Trainer(model=model, args=args, **given)
    # allowed, as under DeepSpeed: your optimizer with the config's schedule, or the config's with the Trainer's
    hf_zero.Trainer(model=model, args=_args(tmp_path, zero_config={"scheduler": SECTIONS["scheduler"]}), optimizers=(opt, None))
    trainer = hf_zero.Trainer(model=model, args=_args(tmp_path, zero_config={"optimizer": SECTIONS["optimizer"]}))
    built = trainer.create_optimizer()
    # DeepSpeed's class (its FusedAdam, AdamW arithmetic) and its one group
    assert type(built) is hf_zero.ops.adam.FusedAdam and built.param_groups[0]["decoupled_weight_decay"]
    assert len(built.param_groups) == 1
    assert built.param_groups[0]["lr"] == trainer.args.learning_rate


def test_accelerate_refuses_what_it_refuses_under_deepspeed() -> None:
    import hf_zero
    from hf_zero import DummyOptim, DummyScheduler

    def attempt(config: dict, opt_kind: str, sched_kind: str | None) -> None:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model = torch.nn.Linear(2, 2)
        opt = DummyOptim(model.parameters()) if opt_kind == "dummy" else torch.optim.SGD(model.parameters(), lr=0.1)
        objs = [model, opt]
        if sched_kind == "dummy":
            objs.append(DummyScheduler(opt))
        elif sched_kind == "real":
            objs.append(torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 1.0))
        hf_zero.Accelerator(cpu=True, zero_config={"zero_optimization": {"stage": 1}, **config}).prepare(*objs)

    cases = [
        ({"optimizer": SECTIONS["optimizer"]}, "real", None, "optimizer section and prepare\\(\\) got an optimizer built in code"),
        ({}, "dummy", None, "DummyOptim but zero_config has no optimizer section"),
        ({"scheduler": SECTIONS["scheduler"]}, "real", "real", "scheduler section and prepare\\(\\) got a scheduler built in code"),
        ({}, "real", "dummy", "DummyScheduler without lr_scheduler_callable but zero_config has no scheduler section"),
        ({"optimizer": SECTIONS["optimizer"]}, "dummy", "real", "scheduler built in code with a DummyOptim"),
    ]
    for config, opt_kind, sched_kind, message in cases:
        with pytest.raises(UsageError, match=message):
            attempt(config, opt_kind, sched_kind)


def test_trainer_casts_floating_inputs_to_the_configs_dtype(tmp_path: Path) -> None:
    """The engine passes inputs as given, as DeepSpeed's does; the Trainer casts floating ones to the config's
    dtype, as transformers' ``_prepare_input`` does under DeepSpeed (``hf_ds_config.dtype()``)."""
    import hf_zero

    batch = {"pixel_values": torch.ones(2, 3), "input_ids": torch.ones(2, 3, dtype=torch.long),
             "nested": [torch.zeros(1, dtype=torch.float64)]}
    for kw, want in (({"bf16": True}, torch.bfloat16), ({}, torch.float32)):
        _reset_state()
        args = _args(tmp_path, zero_config={"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}, **kw)
        got = hf_zero.Trainer(model=torch.nn.Linear(3, 2), args=args)._prepare_input(batch)
        assert got["pixel_values"].dtype == want and got["nested"][0].dtype == want, (kw, got)
        assert got["input_ids"].dtype == torch.long


def _reset_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
