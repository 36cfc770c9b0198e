"""Ulysses attention on 2 ranks equals plain attention on one process.

A small Llama with GQA (4 heads: 2 KV heads, and 1 KV head that must be repeated for sp 2) is
split along the sequence over 2 ranks (odd lengths, so the batch is padded), with SDPA and
eager attention, with right padding, left padding and packed documents (with and without the KV cache that makes
transformers attend across them), and targets that are
mostly ``-100`` on one shard. The loss on every rank and the gradients averaged over the ranks
(what the engine's reduction does) must equal one process running transformers' own forward on
the whole batch. The same spawn checks the loader that exchanges batches between the ranks and
what ``initialize`` refuses (heads that do not split, compile, pipelines, a degree that does not
divide the world), and a peft LoRA model.
"""

from __future__ import annotations

import torch

from tests.distributed import spawn

SEQ = 37


def _llama(kv: int, impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv, max_position_embeddings=256, attn_implementation=impl)
    return LlamaForCausalLM(cfg).train()


def _data(kind: str) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :25] = -100  # rank 0's shard of sample 0 has no target at all
    batch = {"input_ids": ids, "labels": labels}
    if kind == "right_pad":
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, 29:] = 0
        labels[1, 29:] = -100
        batch["attention_mask"] = mask
    elif kind == "left_pad":
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, :6] = 0
        # the first real token would be predicted from a pad query, which attends to nothing: eager
        # attention averages all keys there, so its output depends on the padded length; real data
        # has no such target
        labels[1, :7] = -100
        batch["attention_mask"] = mask
    elif kind.startswith("packed"):  # three documents in row 0, positions restarting at each
        pos = torch.arange(SEQ).expand(2, SEQ).clone()
        pos[0, 10:] -= 10
        pos[0, 21:] -= 11
        batch["position_ids"] = pos
        # transformers keeps the documents apart only in a forward that builds no KV cache
        batch["use_cache"] = kind == "packed_cache"
    return batch


def _attention_grid(rank: int, world: int, cases: list) -> list:
    import torch.distributed as dist

    from hf_zero.sequence import LongSequenceOptions, make_groups, prepare_model, shard_batch

    groups = make_groups(world)
    out = []
    for impl, kv, kind, tiled, *lora in cases:
        ref, model = _llama(kv, impl), _llama(kv, impl)
        if lora:  # a peft model: SP and the tiled loss reach the causal LM inside it
            from peft import LoraConfig, get_peft_model

            spec = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
            torch.manual_seed(1)
            ref = get_peft_model(ref, spec)
            torch.manual_seed(1)
            model = get_peft_model(model, spec)
        prepare_model(model, groups, LongSequenceOptions(tiled_loss=tiled, loss_tile_tokens=7))
        batch = _data(kind)
        expect = ref(**batch)
        expect.loss.backward()
        got = model(**shard_batch(batch, groups.sp_rank, groups.sp_size))
        got.loss.backward()
        err = 0.0
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is None:  # frozen under LoRA
                continue
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= world
            err = max(err, float((g - q.grad).norm()) / max(float(q.grad.norm()), 1e-12))  # (LoRA A: both 0)
        out.append({"case": [impl, kv, kind, tiled], "loss": got.loss.item(), "ref": expect.loss.item(), "grad_err": err,
                    "finite": bool(torch.isfinite(got.loss))})
    return out + [_loader_exchange(rank, groups), _refusals()]


def _refusals() -> dict:
    """What initialize refuses, in a sentence, on every rank (before any collective could hang)."""
    import hf_zero
    from hf_zero.pipe import split_causal_lm

    cfg = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    said = {}
    attempts = {
        "heads": lambda: hf_zero.initialize(model=_llama_heads(3), config=cfg),
        "compile": lambda: hf_zero.initialize(model=_llama(2, "sdpa"), config={**cfg, "compile": {"enabled": True}}),
        "pipeline": lambda: hf_zero.initialize(model=split_causal_lm(_llama(2, "sdpa"), 2), config=cfg),
        "degree": lambda: hf_zero.initialize(model=_llama(2, "sdpa"), config={**cfg, "sequence_parallel_size": 4}),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            said[name] = None
        except ValueError as e:
            said[name] = str(e)
    return said


def _llama_heads(heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=6 * heads, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=heads, num_key_value_heads=heads))


def _loader_exchange(rank: int, groups) -> dict:
    """gather=True: each rank brings a different batch (different lengths); both are worked through in turn."""
    from hf_zero.sequence import SequenceParallelLoader

    own = [{"input_ids": torch.arange(5 + rank * 4).view(1, -1) + 100 * rank, "attention_mask": torch.ones(1, 5 + rank * 4, dtype=torch.bool)}]
    shards = list(SequenceParallelLoader(own, groups, gather=True))
    return {"n": len(shards), "ids": [s["input_ids"].tolist() for s in shards], "mask_dtype": str(shards[0]["attention_mask"].dtype)}


CASES = [[impl, kv, kind, True] for impl in ("sdpa", "eager") for kv in (2, 1) for kind in ("right_pad", "left_pad", "packed")]
CASES += [["sdpa", 2, "right_pad", False], ["eager", 1, "packed", False], ["sdpa", 1, "packed_cache", True],
          ["sdpa", 2, "right_pad", True, "lora"]]


def test_ulysses_attention_equals_one_process() -> None:
    results = spawn(_attention_grid, 2, CASES)
    refused = [per_rank.pop() for per_rank in results]
    for said in refused:
        assert "3 attention heads" in said["heads"], said
        assert "compile cannot be combined with sequence parallelism" in said["compile"], said
        assert "cannot be combined with a pipeline" in said["pipeline"], said
        assert "sequence_parallel_size 4 does not divide the 2 ranks" in said["degree"], said
    for per_rank in results:
        for r in per_rank[:-1]:
            assert r["finite"], r
            assert abs(r["loss"] - r["ref"]) <= 1e-5 * abs(r["ref"]), r
            assert r["grad_err"] < 1e-5, r
    # the loss is the group's: the same number on both ranks
    for a, b in zip(results[0][:-1], results[1][:-1]):
        assert a["loss"] == b["loss"]
    loader = [per_rank[-1] for per_rank in results]
    assert all(x["n"] == 2 for x in loader)
    # rank 0's batch (5 tokens, padded to 6) then rank 1's (9, padded to 10), each cut in two
    assert loader[0]["ids"] == [[[0, 1, 2]], [[100, 101, 102, 103, 104]]]
    assert loader[1]["ids"] == [[[3, 4, 0]], [[105, 106, 107, 108, 0]]]
    assert loader[0]["mask_dtype"] == "torch.bool"
