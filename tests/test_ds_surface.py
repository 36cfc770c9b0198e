"""Smaller pieces of DeepSpeed's public surface that its own unit tests (tests/conformance) showed missing:
``engine.backward``'s return value, HJSON config files, ``deepspeed.moe.utils``' parameter-group helper,
``runtime.utils.see_memory_usage`` and the package's version attributes. One process each."""

from __future__ import annotations

import pytest
import torch

import hf_zero
from hf_zero import ConfigError, UsageError, ZeroConfig
from tests.models import make_data, make_model


def test_backward_returns_the_loss_over_the_accumulation_steps() -> None:
    """DeepSpeed's ``engine.backward(loss)`` returns ``loss / gradient_accumulation_steps`` (``loss`` itself with
    ``scale_wrt_gas=False``), not scaled by fp16's loss scale; scripts log it."""
    engine, *_ = hf_zero.initialize(model=make_model(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    ids, labels = make_data(2, 2)
    loss = engine(ids[0], labels[0])
    returned = engine.backward(loss)
    assert torch.equal(returned.detach(), (loss / 4).detach())
    loss = engine(ids[1], labels[1])
    assert torch.equal(engine.backward(loss, scale_wrt_gas=False).detach(), loss.detach())


def test_hjson_config_files_load_as_deepspeed_reads_them(tmp_path) -> None:
    """DeepSpeed reads a config path with hjson: comments, unquoted keys and trailing commas are fine."""
    path = tmp_path / "ds_config.json"
    path.write_text("{\n  // the batch\n  train_micro_batch_size_per_gpu: 2,\n  gradient_accumulation_steps: 3,\n"
                    '  "zero_optimization": {"stage": 2,},  # ZeRO-2\n}\n')
    cfg = ZeroConfig.load(str(path))
    assert cfg.train_micro_batch_size_per_gpu == 2 and cfg.gradient_accumulation_steps == 3
    assert cfg.zero_optimization.stage == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n  "zero": }')
    with pytest.raises(ConfigError, match=r"bad.json' is not valid JSON \(Expecting value at line 2, column 11\), "
                                          r"nor HJSON"):
        ZeroConfig.load(str(bad))


def test_moe_param_groups_pass_through_without_experts() -> None:
    """``split_params_into_different_moe_groups_for_optimizer``: DeepSpeed returns a model's groups as a list of
    dicts with list ``params`` when it has no expert parameters; an expert parameter is refused here."""
    from hf_zero.moe.utils import is_moe_param
    from hf_zero.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = make_model()
    group = {"params": model.parameters(), "name": "parameters", "lr": 0.1}
    out = split(group)
    assert out == [group] and out[0]["params"] == list(model.parameters()) and out[0]["name"] == "parameters"
    pair = ({"params": [torch.nn.Parameter(torch.zeros(2))], "name": "a"}, {"params": [], "name": "b"})
    assert [g["name"] for g in split(pair)] == ["a", "b"]
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False
    assert is_moe_param(expert) and not is_moe_param(pair[0]["params"][0])
    with pytest.raises(UsageError, match="parameter group 'experts': parameter 1 is an expert parameter"):
        split([{"params": [pair[0]["params"][0], expert], "name": "experts"}])
    engine, *_ = hf_zero.initialize(model=model, model_parameters=split({"params": model.parameters(), "name": "p"}),
                                    config={"train_batch_size": 2, "optimizer": {"type": "Adam"}})
    before = model.fc1.weight.detach().clone()  # the groups, with their extra "name" key, train
    ids, labels = make_data(1, 2)
    engine.backward(engine(ids[0], labels[0]))
    engine.step()
    assert len(engine.optimizer.param_groups) == 1 and not torch.equal(model.fc1.weight, before)


def test_see_memory_usage_prints_only_when_forced(capsys: pytest.CaptureFixture[str]) -> None:
    from hf_zero.runtime.utils import see_memory_usage

    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("after init", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after init" and lines[1].startswith("MA 0.0 GB") and "Max_CA" in lines[1]
    assert lines[2].startswith("CPU Virtual Memory:  used = ")


def test_version_attributes() -> None:
    """DeepSpeed's package carries its version split in three and git build info ("unknown" in its wheels)."""
    parts = tuple(int(v) for v in hf_zero.__version__.split("."))
    assert (hf_zero.__version_major__, hf_zero.__version_minor__, hf_zero.__version_patch__) == parts
    assert hf_zero.__git_hash__ == hf_zero.__git_branch__ == "unknown"


def test_resumed_optimizer_groups_keep_tuple_hyper_parameters(tmp_path) -> None:
    """A checkpoint is JSON, which has no tuples; Adam's ``betas`` come back as the tuple the optimizer holds, so
    the resumed ``optimizer.state_dict()`` equals the saved one (DeepSpeed's own checkpoint tests compare them)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}}}
    engine, *_ = hf_zero.initialize(model=make_model(), config=cfg)
    ids, labels = make_data(1, 2)
    engine.backward(engine(ids[0], labels[0]))
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    again, *_ = hf_zero.initialize(model=make_model(), config=cfg)
    again.load_checkpoint(str(tmp_path))
    saved, loaded = engine.optimizer.param_groups[0], again.optimizer.param_groups[0]
    assert loaded["betas"] == (0.8, 0.9) and type(loaded["betas"]) is tuple
    assert {k: v for k, v in loaded.items() if k != "params"} == {k: v for k, v in saved.items() if k != "params"}


def test_save_between_accumulation_boundaries_holds_the_last_boundary(tmp_path, caplog) -> None:
    """DeepSpeed saves a checkpoint mid-accumulation (its tutorial's loop saves every N micro-batches); what it
    holds is the last boundary's state and the resumed run starts a new window. hf_zero's equals a save made at
    that boundary, and says (once, on rank 0) what is not in it."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    ids, labels = make_data(3, 2)
    engine, *_ = hf_zero.initialize(model=make_model(), config=cfg)
    for i in range(3):  # a boundary after micro-batch 2, then one micro-batch of the next window
        engine.backward(engine(ids[i], labels[i]))
        engine.step()
        if i == 1:
            engine.save_checkpoint(str(tmp_path / "boundary"))
            at_boundary = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with caplog.at_level("WARNING", logger="hf_zero"):
        engine.save_checkpoint(str(tmp_path / "mid"))
    assert "middle of gradient accumulation (micro step 3, accumulation 2)" in caplog.text
    assert "the 1 micro-batches accumulated since are not in it" in caplog.text
    for name in ("boundary", "mid"):
        again, *_ = hf_zero.initialize(model=make_model(seed=5), config=cfg)
        again.load_checkpoint(str(tmp_path / name))
        assert (again.global_steps, again.micro_steps) == (1, 2), name
        for n, p in again.module.named_parameters():
            assert torch.equal(p, at_boundary[n]), (name, n)
        again.backward(again(ids[2], labels[2]))
        assert not again.is_gradient_accumulation_boundary()  # the new window's first micro-batch


def test_the_engine_answers_its_modules_attributes() -> None:
    """DeepSpeed's engine passes an attribute it lacks through to the wrapped module (scripts read
    ``engine.config``, a client's ``engine.id``); its own names come first, and a name neither has is an
    AttributeError naming the engine."""
    model = make_model()
    model.id, model.global_steps = 3, "the module's"
    engine, *_ = hf_zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert engine.id == 3 and engine.global_steps == 0 and engine.emb is model.emb
    with pytest.raises(AttributeError, match="'ZeroEngine' object has no attribute 'no_such_thing'"):
        engine.no_such_thing  # noqa: B018
    assert not hasattr(engine, "no_such_thing")


def test_an_optimizer_given_to_initialize_wins_over_the_configs() -> None:
    """DeepSpeed uses the optimizer passed to ``initialize`` and ignores the config's ``optimizer`` section (its own
    zero-to-fp32 tests pass both); hf_zero does the same and says so in a warning."""
    model = make_model()
    mine = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.warns(UserWarning, match=r"got an optimizer and the config names one too \(optimizer.type 'AdamW'\)"):
        engine, opt, *_ = hf_zero.initialize(model=model, optimizer=mine, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert opt is mine and engine.get_lr() == [0.5]


@pytest.mark.parametrize("stage", [0, 2])
def test_safe_update_full_grad_vectorized(stage: int) -> None:
    """DeepSpeed's ``safe_update_full_grad_vectorized(params, f)``: each gradient the step will use becomes
    ``f(grad, param)``; a frozen parameter is left alone."""
    from hf_zero.utils import safe_get_full_grad, safe_update_full_grad_vectorized

    engine, *_ = hf_zero.initialize(model=make_model(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    ids, labels = make_data(1, 2)
    engine.backward(engine(ids[0], labels[0]))
    params = [p for p in engine.module.parameters()]
    before = [safe_get_full_grad(p) for p in params]
    assert any(g is None for g in before) and any(g is not None for g in before)  # Awkward has a frozen layer
    safe_update_full_grad_vectorized(params, lambda g, p: 2 * g + p.shape[0])
    for p, old in zip(params, before):
        new = safe_get_full_grad(p)
        assert (new is None) if old is None else torch.equal(new, 2 * old + p.shape[0])
