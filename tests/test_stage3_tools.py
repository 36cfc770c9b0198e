"""Stage-3 helpers: GatheredParameters edits reach every shard and master; the prefetch budget
decides how many units are gathered ahead; generate under stage 3 with ranks decoding different
lengths returns the unsharded model's tokens, with one gather per parameter group rather than one
per decoded token."""

from __future__ import annotations

import pytest

from tests.distributed import spawn
from tests.test_stage3 import _model


def _gathered(rank: int, world: int) -> dict:
    import torch

    import hf_zero
    from hf_zero.zero import GatheredParameters

    model = _model("llama")
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
        "bf16": {"enabled": True},
    }
    engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
    w = model.model.layers[0].mlp.down_proj.weight
    norm = model.model.layers[0].input_layernorm.weight  # below the threshold: stays whole
    out = {"sharded_bytes_before": w.untyped_storage().nbytes()}
    with GatheredParameters([w, norm], modifier_rank=0):
        out["full_shape"] = list(w.shape)
        with torch.no_grad():
            w.fill_(1.5 if rank == 0 else 7.0)
            norm.fill_(2.0 if rank == 0 else -3.0)
    out["sharded_bytes_after"] = w.untyped_storage().nbytes()
    with GatheredParameters(w):
        out["w_values"] = sorted(set(w.float().flatten().tolist()))
    out["norm_values"] = sorted(set(norm.float().flatten().tolist()))
    # an optimizer step with lr=0 republishes the fp32 masters: the edit must be in them
    ids = torch.randint(0, 61, (1, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with GatheredParameters(w):
        out["w_after_step"] = sorted(set(w.float().flatten().tolist()))
    out["norm_after_step"] = sorted(set(norm.float().flatten().tolist()))
    return out


LAYER = 2 * 30 * 30 + 2 * 30 * 10 + 3 * 30 * 47  # q, o: 30x30; k, v: 30x10 (one KV head); MLP: 3 x 30x47


def _prefetched(budget: int) -> dict:
    """Which units are gathered when each unit's forward starts, under ``stage3_prefetch_bucket_size=budget``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=30, intermediate_size=47, num_hidden_layers=4,
                                         num_attention_heads=3, num_key_value_heads=1))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                 "stage3_prefetch_bucket_size": budget}}
    engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
    units = engine.zero_optimizer.runtime.units
    seen: list[list[str]] = []
    for u in units:  # registered after the runtime's own pre-hooks, so they run after its gathers
        u.module.register_forward_pre_hook(lambda m, a, u=u: seen.append([x.name for x in units if x.gathered]))
    ids = torch.randint(0, 61, (1, 8))
    for _ in range(2):  # the first forward records the order; prefetching starts with the second
        seen.clear()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return {"units": [u.name for u in units], "numel": [u.numel for u in units], "gathered_at_each_forward": seen}


def _gathered_and_prefetched(rank: int, world: int) -> dict:
    return {"gathered": _gathered(rank, world),
            "prefetch": {str(b): _prefetched(b) for b in (0, 1, 2 * LAYER, 10**9)}}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_gathered_and_prefetched, 2)


def test_prefetch_budget_decides_how_many_units_are_gathered_ahead(two_ranks: list[dict]) -> None:
    """0: none ahead; a budget below one unit: the next one only; two units' elements: two ahead; a large budget: all."""
    for r in two_ranks:
        runs = r["prefetch"]
        names = runs["0"]["units"]
        assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]
        assert runs["0"]["numel"][1:] == [LAYER] * 4  # four blocks of LAYER elements (the norms stay whole)
        for budget, ahead in ((0, 0), (1, 1), (2 * LAYER, 2), (10**9, 4)):
            want = [names[i : i + 1 + ahead] for i in range(len(names))]
            assert runs[str(budget)]["gathered_at_each_forward"] == want, (budget, runs[str(budget)])


def test_gathered_parameters_modifier_rank_reaches_every_shard(two_ranks: list[dict]) -> None:
    for r in (rank["gathered"] for rank in two_ranks):
        assert r["sharded_bytes_before"] == 0 and r["sharded_bytes_after"] == 0
        assert r["full_shape"] == [30, 47]
        assert r["w_values"] == [1.5] and r["w_after_step"] == [1.5]
        assert r["norm_values"] == [2.0] and r["norm_after_step"] == [2.0]


def _generate(rank: int, world: int) -> dict:
    import torch

    import hf_zero
    from hf_zero.zero import collectives

    ref = _model("llama").eval()
    model = _model("llama")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
    engine.eval()
    g = torch.Generator().manual_seed(rank)
    prompt = torch.randint(0, 61, (1, 3 + 3 * rank), generator=g)
    new = 4 + 5 * rank  # ranks decode different lengths
    gathers = []
    orig = collectives.all_gather_
    collectives.all_gather_ = lambda *a, **k: (gathers.append(1), orig(*a, **k))[1]
    with torch.no_grad():
        got = engine.module.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        want = ref.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    collectives.all_gather_ = orig
    n_groups = len(engine.zero_optimizer.stage3_groups)
    # training resumes: the inference gathering is released by the next training forward
    engine.train()
    ids = torch.randint(0, 61, (1, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    sharded = all(grp.full.untyped_storage().nbytes() == 0 for grp in engine.zero_optimizer.stage3_groups)
    return {"got": got.tolist(), "want": want.tolist(), "gathers": len(gathers), "groups": n_groups, "sharded_after": sharded}


def test_generate_under_stage3_matches_unsharded() -> None:
    results = spawn(_generate, 2)
    assert len(results[0]["got"][0]) != len(results[1]["got"][0])
    for r in results:
        assert r["got"] == r["want"]
        assert r["gathers"] == r["groups"], r
        assert r["sharded_after"]


def _views_outlive_gather(rank: int, world: int, ckpt: str) -> dict:
    """DeepSpeed's TestZeroToFP32 at stage 3: tensors taken from parameters inside ``GatheredParameters`` are read
    after it (on the CPU, ``p.detach().cpu()`` is a view of the gathered buffer), by rank 0 only, then every rank
    meets in a collective. Resizing that buffer's storage to 0 under them killed rank 0 (SIGSEGV) and left rank 1
    waiting in the barrier: the faulthandler timer turns a hang into a failure."""
    import faulthandler

    import torch
    import torch.distributed as dist

    import hf_zero
    from hf_zero.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
    from hf_zero.zero import GatheredParameters, Init
    from hf_zero.zero.param_attrs import ZeroParamStatus

    faulthandler.dump_traceback_later(120, exit=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(4)))  # 48 elements: uneven shards
    model[3].weight = model[1].weight  # tied: stored once, under "1.weight"
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, _, _, _ = hf_zero.initialize(model=model, config=cfg, model_parameters=model.parameters())
    for _ in range(4):
        x = torch.randn(2, 3)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(ckpt)
    dist.barrier()
    kept, status = {}, []
    for name, p in engine.module.named_parameters():
        with GatheredParameters(p, modifier_rank=None):
            kept[name] = p.detach().cpu()  # the same storage on the CPU
        status.append(p.ds_status is ZeroParamStatus.NOT_AVAILABLE)
    with GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        loaded = load_state_dict_from_zero_checkpoint(engine.module, ckpt).state_dict()
    groups = engine.zero_optimizer.stage3_groups
    out = {"status_after_exit": status, "released": all(g.full.untyped_storage().nbytes() == 0 for g in groups)}
    if rank == 0:  # only rank 0 reads, as DeepSpeed's test compares
        out["max_diff"] = max((kept[n] - loaded[n]).abs().max().item() for n in kept)
        out["finite"] = all(bool(torch.isfinite(kept[n]).all()) for n in kept)
        # DeepSpeed's pickle holds a tied weight under each name, one tensor (its TestCheckpointConvert checks ids)
        from hf_zero.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(ckpt, ckpt + "_fp32", safe_serialization=False)
        sd = torch.load(ckpt + "_fp32/pytorch_model.bin")
        out["tied"] = [sorted(sd), sd["3.weight"] is sd["1.weight"]]
    dist.barrier()  # the collective rank 1 waited in
    # training goes on over the new buffers
    engine.backward(engine(torch.randn(2, 3)).pow(2).mean())
    engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        out["after_step_finite"] = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    # zero.Init: partitioned (0 elements) before, whole inside, partitioned again after (DeepSpeed's TestScatterGather)
    with Init():
        lin = torch.nn.Linear(6, 3)
    seen = [lin.weight.ds_status.name, list(lin.weight.shape)]
    with GatheredParameters(lin.weight):
        seen += [lin.weight.ds_status.name, list(lin.weight.shape)]
    seen += [lin.weight.ds_status.name, list(lin.weight.shape)]
    out["init_status"] = seen
    faulthandler.cancel_dump_traceback_later()
    return out


def test_tensors_taken_inside_gathered_parameters_stay_readable_after_it(tmp_path) -> None:  # noqa: ANN001
    """Also: ``ds_status`` after the block (an engine's and ``zero.Init``'s), and a tied weight under both names in the
    pickled fp32 state dict (hf_zero/checkpoint/save.py records the tie)."""
    r0, r1 = spawn(_views_outlive_gather, 2, str(tmp_path / "ckpt"))
    assert r0["max_diff"] == 0.0 and r0["finite"]  # what rank 0 kept equals the checkpoint's fp32 weights
    names = sorted(f"{i}.{k}" for i in range(4) for k in ("weight", "bias"))
    assert r0["tied"] == [names, True]
    for r in (r0, r1):
        assert all(r["status_after_exit"]) and r["released"] and r["after_step_finite"], r
        assert r["init_status"] == ["NOT_AVAILABLE", [0], "AVAILABLE", [3, 6], "NOT_AVAILABLE", [0]]
