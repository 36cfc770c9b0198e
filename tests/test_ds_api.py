"""DeepSpeed's API beyond ``initialize``: what a script written for DeepSpeed calls, with the import swapped.

One 2-rank run (gloo) of a script in the shape of DeepSpeed's tutorials: ``add_config_arguments``
and ``initialize(args=...)``, ``comm`` for its all-reduce, ``get_accelerator()`` for the device,
``ops.adam.FusedAdam`` as the optimizer, ``checkpointing.checkpoint`` inside the model's forward,
``runtime.lr_schedules.WarmupLR``, then ``save_checkpoint`` and ``utils.zero_to_fp32``. The
oracle is one process training the same model with torch's AdamW and no checkpointing on the
concatenated batch: losses and weights equal to rel. 1e-5 (fp32), and the fp32 state dict read
back from the checkpoint equals the engine's weights exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn

STEPS, MICRO, SEQ, VOCAB = 3, 2, 6, 37
LR, WD = 1e-2, 0.01


def _llama(tied: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                                        tie_word_embeddings=tied))


CALLS: list[int] = []  # the layers' inner forwards run: once in forward, once more when backward recomputes


def _checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder layer's forward through deepspeed.checkpointing.checkpoint, as Megatron-style code does."""
    import hf_zero as deepspeed

    for layer in model.model.layers:
        inner = layer.forward

        def run(h, args, kwargs, _inner=inner):  # noqa: ANN001, ANN202
            CALLS.append(1)
            return _inner(h, *args, **kwargs)

        def forward(hidden_states, *args, _run=run, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            return deepspeed.checkpointing.checkpoint(lambda h: _run(h, args, kwargs), hidden_states)

        layer.forward = forward
    return model


def _data(world: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, world * MICRO, SEQ), generator=torch.Generator().manual_seed(3))


def _script(rank: int, world: int, root: str, cpu_checkpointing: bool) -> dict:
    import argparse

    import hf_zero as deepspeed
    import hf_zero.comm as dist
    from hf_zero.accelerator import get_accelerator
    from hf_zero.runtime.lr_schedules import WarmupLR
    from hf_zero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg_path = Path(root, f"ds_config_{rank}.json")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}, "steps_per_print": 1000,
           "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": cpu_checkpointing}}
    cfg_path.write_text(json.dumps(cfg))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(cfg_path)])

    deepspeed.init_distributed()
    acc = get_accelerator()
    out = {"device": acc.device_name(), "backend": acc.communication_backend_name(), "rank": dist.get_rank(),
           "world": dist.get_world_size(), "local_rank": dist.get_local_rank(), "args": [args.deepspeed, args.local_rank],
           "ranks": [dist.get_all_ranks_from_group(), dist.get_all_ranks_from_group(dist.new_group([world - 1]))]}
    try:
        acc.lazy_call(print)
    except AttributeError as e:
        out["missing"] = str(e)
    deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
    out["configured"] = deepspeed.checkpointing.is_configured()

    model = _checkpointed(_llama()).to(acc.device_name())
    opt = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=LR, weight_decay=WD)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=LR, warmup_num_steps=2, warmup_type="linear")
    engine, opt, _, sched = deepspeed.initialize(args=args, model=model, optimizer=opt, lr_scheduler=sched)
    ids = _data(world)
    losses = []
    for t in range(STEPS):
        batch = ids[t, rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.save_checkpoint(str(Path(root, "ckpt")))
    dist.barrier()
    state = get_fp32_state_dict_from_zero_checkpoint(str(Path(root, "ckpt")))
    weights = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    out["losses"] = losses
    out["calls"] = len(CALLS)
    out["state_equal"] = sorted(state) == sorted(weights) and all(torch.equal(state[n], w) for n, w in weights.items())
    out["weights"] = {n: w.reshape(-1).tolist() for n, w in weights.items()}
    inner = engine.zero_optimizer.optimizer  # initialize returns the engine's wrapper, as DeepSpeed does
    out["fused_flag"] = isinstance(inner, deepspeed.ops.adam.FusedAdam) and inner.param_groups[0]["decoupled_weight_decay"]
    out["fused_kernel"] = bool(inner.param_groups[0]["fused"])  # on GPU shards: torch's fused Adam
    return out


def _oracle(world: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    from hf_zero.runtime.lr_schedules import WarmupLR

    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=LR, warmup_num_steps=2, warmup_type="linear")
    ids = _data(world)
    losses = []
    for t in range(STEPS):
        loss = model(input_ids=ids[t], labels=ids[t]).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _both(rank: int, world: int, root: str) -> list[dict]:
    """The script twice in one process group (starting processes is the slow part): plain, then cpu_checkpointing."""
    CALLS.clear()
    first = _script(rank, world, str(Path(root, "plain")), False)
    CALLS.clear()
    return [first, _script(rank, world, str(Path(root, "cpu")), True)]


def test_a_deepspeed_script_runs_with_the_import_swapped(tmp_path: Path) -> None:
    ref_losses, ref_w = _oracle()
    (tmp_path / "plain").mkdir()
    (tmp_path / "cpu").mkdir()
    for r in (case for per_rank in spawn(_both, 2, str(tmp_path)) for case in per_rank):
        assert (r["device"], r["backend"], r["world"], r["local_rank"]) == ("cpu", "gloo", 2, r["rank"]), r
        assert r["args"] == [True, -1] and r["configured"] and r["fused_flag"], r
        assert r["calls"] == 2 * 2 * STEPS, r["calls"]  # 2 layers, each recomputed in backward
        assert r["ranks"] == [[0, 1], [1]] if r["rank"] == 1 else r["ranks"][0] == [0, 1], r
        assert r["missing"] == ("get_accelerator().lazy_call (of DeepSpeed's accelerator interface) is not supported by "
                                "hf_zero yet; use torch.backends.cpu directly"), r
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) < 1e-5, (r["losses"], ref_losses)
        for n, w in r["weights"].items():
            ref = ref_w[n].reshape(-1)
            assert float((torch.tensor(w) - ref).norm() / ref.norm()) < 1e-5, n
        assert r["state_equal"], "zero_to_fp32's state dict differs from the engine's weights"


def test_zero_to_fp32_convert_and_load_and_refusals(tmp_path: Path) -> None:
    """The other two zero_to_fp32 functions, on a checkpoint written by a 1-rank engine of a transformers model."""
    from transformers import AutoModelForCausalLM

    import hf_zero as deepspeed
    from hf_zero.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    spawn(_one_rank_checkpoint, 1, str(tmp_path))
    ckpt = tmp_path / "ckpt"
    tag_dir = ckpt / "global_step1"
    by_parent = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    by_tag = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir))  # the tag folder itself, as DeepSpeed's script allows
    assert by_parent.keys() == by_tag.keys() and all(torch.equal(by_parent[k], by_tag[k]) for k in by_parent)
    assert all(t.dtype == torch.float32 for t in by_parent.values())
    trainable = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), exclude_frozen_parameters=True)
    assert sorted(set(by_parent) - set(trainable)) == ["model.norm.weight"]
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path / "trainable"), exclude_frozen_parameters=True)
    from safetensors.torch import load_file

    assert sorted(load_file(str(tmp_path / "trainable" / "model.safetensors"))) == sorted(trainable)
    files = convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path / "out"), max_shard_size="20KB")
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file(), files
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(p, by_parent[n]) for n, p in loaded.named_parameters())
    fresh = load_state_dict_from_zero_checkpoint(_llama(), str(ckpt))
    assert all(torch.equal(p, by_parent[n]) for n, p in fresh.named_parameters())
    with pytest.raises(deepspeed.UsageError, match="does not fit Linear: missing"):
        load_state_dict_from_zero_checkpoint(torch.nn.Linear(2, 2), str(ckpt))
    # safe_serialization=False: DeepSpeed's pickles, whole or sharded with transformers' index, read by from_pretrained
    for out, size, expect in (("pickle", "5GB", 1), ("pickle_shards", "20KB", len(files))):
        written = convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path / out), max_shard_size=size,
                                                             safe_serialization=False)
        assert len(written) == expect and all(f.startswith("pytorch_model") and f.endswith(".bin") for f in written), written
        assert (expect > 1) == (tmp_path / out / "pytorch_model.bin.index.json").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / out))
        assert all(torch.equal(p, by_parent[n]) for n, p in loaded.named_parameters())
    assert torch.load(str(tmp_path / "pickle" / "pytorch_model.bin"), weights_only=True).keys() == by_parent.keys()


def _one_rank_checkpoint(rank: int, world: int, root: str) -> dict:
    import hf_zero

    model = _llama()
    model.model.norm.weight.requires_grad_(False)  # a frozen parameter, for exclude_frozen_parameters
    engine, _, _, _ = hf_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "steps_per_print": 1000})
    ids = _data()[0, :MICRO]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(str(Path(root, "ckpt")))
    return {}


def test_fused_adam_checkpointing_options_and_what_is_not_there() -> None:
    import hf_zero as deepspeed
    from hf_zero.ops.adam import FusedAdam

    # adam_w_mode=False: weight decay added to the gradient (L2), as torch's Adam does
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opts = [FusedAdam(a.parameters(), lr=0.1, weight_decay=0.1, adam_w_mode=False), torch.optim.Adam(b.parameters(), lr=0.1, weight_decay=0.1)]
    for _ in range(3):
        for m, o in zip((a, b), opts):
            m(torch.ones(2, 4)).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.allclose(p, q, rtol=0, atol=1e-7) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(deepspeed.UsageError, match="no AMSGrad variant"):
        FusedAdam(a.parameters(), amsgrad=True)
    with pytest.raises(deepspeed.UsageError, match="model parallelism is not supported"):
        deepspeed.checkpointing.configure(object())
    with pytest.raises(deepspeed.UsageError, match="profile: got true"):
        deepspeed.checkpointing.configure(None, profile=True)
    with pytest.raises(AttributeError, match="belongs to model parallelism"):
        deepspeed.checkpointing.get_cuda_rng_tracker  # noqa: B018
    with pytest.raises(AttributeError, match="set_z3_leaf_modules .* is not supported by hf_zero yet"):
        deepspeed.utils.set_z3_leaf_modules  # noqa: B018
    with pytest.raises(deepspeed.UsageError, match="--deepspeed_mpi"):
        import argparse

        args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_mpi"])
        deepspeed.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_batch_size": 1})
    assert deepspeed.comm.all_to_all_single is torch.distributed.all_to_all_single  # torch's names pass through
    with pytest.raises(AttributeError, match="hf_zero.comm has no 'all_to_all_everything'"):
        deepspeed.comm.all_to_all_everything  # noqa: B018


def _engine_methods(rank: int, world: int, root: str) -> dict:
    import safetensors.torch

    import hf_zero as deepspeed

    model = _llama(tied=True)  # tied embeddings: one tensor under two names in the state dict
    model.model.norm.weight.requires_grad_(False)  # one frozen parameter, for exclude_frozen_parameters
    engine, _, _, _ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.8, 0.99]}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "bf16": {"enabled": True},
        "steps_per_print": 1000})
    ids = _data(world)
    for t in range(2):
        batch = ids[t, rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    out = {"batch_info": list(engine.get_batch_info()), "mom": [list(m) for m in engine.get_mom()],
           "types": [str(t) for t in engine.get_data_types()], "mp": engine.mp_world_size}
    layer_w = engine.module.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        engine(input_ids=ids[0, :MICRO])  # evaluation releases every block after it, as training does
    out["gathered_after_eval"] = layer_w.untyped_storage().nbytes()
    seen: dict[str, int] = {}

    def empty_inside(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # a logits processor runs between two decoding steps of generate, where blocks stay gathered (within the caps)
        if not seen:
            seen["kept"] = layer_w.untyped_storage().nbytes()
            engine.empty_partition_cache()
            seen["emptied"] = layer_w.untyped_storage().nbytes()
        return scores

    with torch.no_grad():
        engine.module.generate(ids[0, :1, :4], max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
                               logits_processor=[empty_inside])
    out["gathered_in_generate"], out["gathered_after_empty"] = seen["kept"], seen["emptied"]
    out["gathered_after_generate"] = layer_w.untyped_storage().nbytes()
    # DeepSpeed's unwrap_model_for_generation (TRL's pattern): greedy decoding on the whole weights, as without it
    from hf_zero.runtime.zero import unwrap_model_for_generation

    prompt = ids[0, rank : rank + 1, :3]
    with torch.no_grad():
        plain = engine.module.generate(prompt, max_new_tokens=3, do_sample=False)
    engine.empty_partition_cache()
    with unwrap_model_for_generation(engine) as unwrapped:
        out["held_in_unwrap"] = layer_w.untyped_storage().nbytes()
        fast = unwrapped.module.generate(prompt, max_new_tokens=3, do_sample=False)
    out["generate_equal"] = torch.equal(plain, fast) and fast.shape[1] == SEQ
    out["held_after_unwrap"] = layer_w.untyped_storage().nbytes()
    assert engine.save_16bit_model(str(Path(root, "w16"))) is True
    engine.save_16bit_model(str(Path(root, "w16")), "trainable.safetensors", exclude_frozen_parameters=True)
    engine.save_pretrained(str(Path(root, "pretrained")))  # the reference: save_pretrained's consolidation
    # A DeepSpeed script's own name (its default): torch.save of the state dict, as DeepSpeed writes it
    assert engine.save_16bit_model(str(Path(root, "bin"))) is True  # hf_zero's default name, then DeepSpeed's
    engine.save_16bit_model(str(Path(root, "bin")), "pytorch_model.bin")
    names = list(engine.module.state_dict().keys())
    if rank == 0:
        from transformers import LlamaForCausalLM

        full = safetensors.torch.load_file(str(Path(root, "w16", "model.safetensors")))
        ref = safetensors.torch.load_file(str(Path(root, "pretrained", "model.safetensors")))
        trainable = safetensors.torch.load_file(str(Path(root, "w16", "trainable.safetensors")))
        out["equal_to_pretrained"] = full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)
        pickled = torch.load(str(Path(root, "bin", "pytorch_model.bin")), weights_only=True)
        out["bin_names"] = list(pickled) == names and "lm_head.weight" in pickled and "lm_head.weight" not in full
        out["bin_equal"] = all(torch.equal(pickled[k], full[k]) for k in full)
        out["bin_tied"] = pickled["lm_head.weight"].data_ptr() == pickled["model.embed_tokens.weight"].data_ptr()
        engine.module.config.save_pretrained(str(Path(root, "bin")))
        os.remove(str(Path(root, "bin", "model.safetensors")))  # from_pretrained reads the .bin alone
        loaded = LlamaForCausalLM.from_pretrained(str(Path(root, "bin")), dtype=torch.bfloat16).state_dict()
        out["bin_from_pretrained"] = all(torch.equal(loaded[k], full[k]) for k in full)
        out["dtypes"] = sorted({str(t.dtype) for t in full.values()})
        out["excluded"] = sorted(set(full) - set(trainable))
    # "ignore_unused_parameters": false with a head that only rank 0 runs: every rank stops the step, naming it
    torch.manual_seed(0)
    heads = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    e2, _, _, _ = deepspeed.initialize(model=heads, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2, "ignore_unused_parameters": False}})
    x = torch.ones(1, 4)
    e2.backward(sum(e2.module[n](x).sum() for n in ("ab" if rank == 0 else "a")))
    try:
        e2.step()
    except deepspeed.errors.UnusedParameterError as e:
        out["unused"] = str(e)
    return {**out, **_shared_loss(rank)}


def _shared_loss(rank: int) -> dict:
    """DeepSpeed's "jointly training models with shared loss": one loss.backward() over two engines' modules, then
    each engine's _backward_epilogue() and step(); against each engine's own engine.backward of its part of the loss."""
    import hf_zero as deepspeed

    out: dict = {}
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(2, 8, generator=g) for _ in range(2)]
    for stage in (1, 2, 3):
        finals = []
        for shared in (True, False):
            models = []
            for i in range(2):
                torch.manual_seed(i)
                engine, _, _, _ = deepspeed.initialize(model=torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)), config={
                    "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                    "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
                models.append(engine)
            for x in xs:
                if shared:
                    sum(m.module(x).square().mean() / (i + 1) for i, m in enumerate(models)).backward()
                    for m in models:
                        m._backward_epilogue()
                else:
                    for i, m in enumerate(models):
                        m.backward(m(x).square().mean() / (i + 1))
                for m in models:
                    m.step()
            with deepspeed.zero.GatheredParameters([p for m in models for p in m.parameters()]):
                finals.append([p.detach().clone() for m in models for p in m.parameters()])
        out[f"shared_equal_{stage}"] = all(torch.equal(a, b) for a, b in zip(*finals))
    models[0].module(xs[0]).sum().backward()  # and without the epilogue: step says what is missing
    try:
        models[0].step()
    except deepspeed.UsageError as e:
        out["no_epilogue"] = str(e)
    return out


def test_engine_save_16bit_model_and_the_small_engine_methods(tmp_path: Path) -> None:
    results = spawn(_engine_methods, 2, str(tmp_path))
    for r in results:
        assert r["batch_info"] == [2 * MICRO * 2, MICRO, 2] and r["mom"] == [[0.8, 0.99]] and r["mp"] == 1, r
        assert r["types"] == ["torch.bfloat16", "torch.float32"], r
        assert r["gathered_after_eval"] == 0 and r["gathered_in_generate"] > 0 and r["gathered_after_empty"] == 0, r
        assert r["gathered_after_generate"] == 0, r
        assert r["held_in_unwrap"] > 0 and r["generate_equal"] and r["held_after_unwrap"] == 0, r
        assert r["unused"].startswith("2 trainable parameter(s) got no gradient in this step's backward passes on at "
                                      "least one rank (b.bias, b.weight)"), r
        assert r["shared_equal_1"] and r["shared_equal_2"] and r["shared_equal_3"], r
        assert "after a plain loss.backward(), call engine._backward_epilogue() to reduce them" in r["no_epilogue"], r
    r0 = results[0]
    assert r0["equal_to_pretrained"] and r0["dtypes"] == ["torch.bfloat16"], r0
    assert r0["excluded"] == ["model.norm.weight"], r0
    assert r0["bin_names"] and r0["bin_equal"] and r0["bin_tied"] and r0["bin_from_pretrained"], r0
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["config.json", "pytorch_model.bin"]
