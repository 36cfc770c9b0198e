"""ZeRO stage 3 against the single-process oracle, and what a rank really holds.

Tiny GPT-2 (tied embedding / LM head), tiny Llama built from configs, and a model whose units
are top-level children (one called twice per step, one frozen, keyword-only forward), fp32:
losses and weights equal one process training on the concatenated batch (rel. 1e-5) at world
sizes 1-4, with and without gradient accumulation and clipping.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import spawn

STEPS = 3
MICRO = 2
SEQ = 8
VOCAB = 61
# GPT-2's key bias has an exactly-zero true gradient (softmax ignores it), so its computed
# gradient is rounding noise that Adam with a tiny eps would blow up into lr-sized steps in
# either implementation. A larger eps keeps the oracle meaningful without loosening it.
EPS = 1e-4


class Reuse(torch.nn.Module):
    """Units that are top-level children: one called twice per step, one frozen; keyword-only forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 30)
        self.block = torch.nn.Sequential(torch.nn.Linear(30, 47), torch.nn.GELU(), torch.nn.Linear(47, 30))
        self.frozen = torch.nn.Linear(30, 30)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(30)
        self.head = torch.nn.Linear(30, VOCAB, bias=False)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor):  # noqa: ANN201
        from transformers.modeling_outputs import CausalLMOutput

        h = self.emb(input_ids)
        h = h + self.block(h)
        h = h + self.block(self.norm(h))  # the same unit again, before the first call's backward
        h = h + self.frozen(h)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def _model(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "reuse":
        return Reuse()
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=30, n_layer=2, n_head=3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=30, intermediate_size=47, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


def _data(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS, global_batch, SEQ), generator=g)


def _oracle(kind: str, global_batch: int, clip: float) -> tuple[list[float], dict]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=EPS)
    ids = _data(global_batch)
    losses = []
    for t in range(STEPS):
        loss = model(input_ids=ids[t], labels=ids[t]).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _grid(rank: int, world: int, cases: list) -> list:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.zero.stage3 import ShardState

    out = []
    for kind, gas, clip, *flags in cases:
        model = _model(kind)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": EPS}},
            # small threshold so norms stay whole while matrices are sharded
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 500},
            "steps_per_print": 1000,
            "activation_checkpointing": {"checkpoint_blocks": "ckpt" in flags},
        }
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        ids = _data(MICRO * gas * world)
        losses = []
        for t in range(STEPS):
            total = torch.zeros((), device=engine.device)
            for g in range(gas):
                lo = (rank * gas + g) * MICRO
                batch = ids[t, lo : lo + MICRO]
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach().float() / gas
            dist.all_reduce(total)
            losses.append(total.item() / world)
        zo = engine.zero_optimizer
        assert all(g.state is ShardState.SHARDED for g in zo.stage3_groups), "units left gathered between steps"
        ref_losses, ref_w = _oracle(kind, MICRO * gas * world, clip)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        # gather the full weights to compare
        w_err = 0.0
        for g in zo.stage3_groups:
            g.wait()
        for n, p in engine.module.named_parameters():
            w_err = max(w_err, float((p.detach().cpu() - ref_w[n]).norm() / ref_w[n].norm()))
        for g in zo.stage3_groups:
            g.reshard()
        sharded = sum(g.numel for g in zo.stage3_groups)
        held = sum((g.master if g.master is not None else g.param_shard).numel() for g in zo.stage3_groups)
        out.append({"case": [kind, gas, clip, *flags], "loss_err": loss_err, "w_err": w_err, "sharded": sharded, "held": held, "n_groups": len(zo.stage3_groups)})
    return out


CASES = [
    ["gpt2", 1, 0.0], ["gpt2", 2, 0.3], ["llama", 1, 0.3], ["llama", 2, 0.0], ["reuse", 1, 0.3], ["reuse", 2, 0.0],
    # blocks recomputed in backward (activation_checkpointing.checkpoint_blocks): same numbers
    ["llama", 2, 0.3, "ckpt"], ["reuse", 1, 0.0, "ckpt"],
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage3_matches_single_process(world: int) -> None:
    results = spawn(_grid, world, CASES)
    for per_rank in results:
        for r in per_rank:
            assert r["n_groups"] > 0, r
            assert r["loss_err"] < 1e-5, r
            assert r["w_err"] < 1e-5, r
            # each rank holds 1/N of the sharded parameters (plus < N elements of padding per group)
            assert r["held"] * world - r["sharded"] < world * r["n_groups"], r


def _embedding_held(rank: int, world: int) -> dict:
    """Bytes behind the input embedding's weight while the LM head runs and when backward starts, and behind the
    LM head's while it runs and when the first layer's backward runs (the last of the layers' backwards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    out = {}
    for tied in (False, True):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=30, intermediate_size=47, num_hidden_layers=2, num_attention_heads=3,
                          num_key_value_heads=1, max_position_embeddings=SEQ, tie_word_embeddings=tied)
        model = LlamaForCausalLM(cfg)
        engine, _, _, _ = hf_zero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1000})
        weight = model.model.embed_tokens.weight
        seen: dict = {}

        def at_head(_m, _args, logits, seen=seen, weight=weight) -> None:  # noqa: ANN001
            seen["forward_end"] = weight.untyped_storage().nbytes()
            logits.register_hook(lambda g: seen.__setitem__("backward_start", weight.untyped_storage().nbytes()))

        head = model.lm_head.weight

        def at_layer0(_m, _args, out, seen=seen, head=head) -> None:  # noqa: ANN001
            h = out[0] if isinstance(out, tuple) else out
            h.register_hook(lambda g: seen.__setitem__("head_at_layer0_backward", head.untyped_storage().nbytes()))

        def head_runs(_m, _args, seen=seen, head=head) -> None:  # noqa: ANN001
            seen["head_forward"] = head.untyped_storage().nbytes()

        model.lm_head.register_forward_hook(at_head)
        model.lm_head.register_forward_pre_hook(head_runs)
        model.model.layers[0].register_forward_hook(at_layer0)
        ids = _data(MICRO * world)[0, rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        seen["after_step"] = weight.untyped_storage().nbytes()
        seen["units"] = [u.name for u in engine.zero_optimizer.runtime.units]
        seen["full"] = VOCAB * 30 * 4
        out["tied" if tied else "untied"] = seen
    return out


def test_untied_embeddings_are_released_when_nothing_needs_them() -> None:
    """Kept in the root unit the input embedding stayed gathered all step; as a unit of its own it is gathered only
    to run. The LM head, in the root, was held to the end of backward; it goes once its gradient is accumulated."""
    for r in spawn(_embedding_held, 2):
        untied, tied = r["untied"], r["tied"]
        assert untied["units"] == ["model.embed_tokens", "model.layers.0", "model.layers.1"], untied
        assert untied["forward_end"] == untied["backward_start"] == untied["after_step"] == 0, untied
        # the untied LM head (the root unit) is whole while it runs and released once its own backward is done
        assert untied["head_forward"] >= untied["full"] and untied["head_at_layer0_backward"] == 0, untied
        # tied to the LM head it must be whole whenever either runs: it stays in the root
        assert tied["units"] == ["model.layers.0", "model.layers.1"], tied
        assert tied["forward_end"] >= tied["full"] and tied["backward_start"] >= tied["full"], tied
        assert tied["head_at_layer0_backward"] >= tied["full"] and tied["after_step"] == 0, tied


def _lora_world1(rank: int, world: int) -> dict:
    """A LoRA Llama on one rank: where its frozen weights live while they are used, and the losses, with stage 3
    and without hf_zero (torch's AdamW over the same peft model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))

    ids = _data(MICRO)[0]
    out: dict = {"plain": [], "stage3": [], "shared": []}
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=EPS)
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["plain"].append(loss.item())

    model = build()
    engine, _, _, _ = hf_zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": EPS}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1000})
    base = model.base_model.model
    watched = [base.lm_head, base.model.embed_tokens, base.model.layers[1].mlp.down_proj.base_layer]

    def at_use(m: torch.nn.Module, *_: object) -> None:
        shard = m.weight.hf_zero_group.param_shard
        out["shared"].append(m.weight.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr())

    for m in watched:
        m.register_forward_pre_hook(at_use)
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out["stage3"].append(loss.item())
    return out


def test_frozen_weights_on_one_rank_are_used_where_they_are_stored() -> None:
    """On one rank a frozen group's shard is the whole of its parameters: they are views of it, not copies
    gathered into a second buffer of the same size (the LM head, the embedding and each layer's base weights of
    a LoRA model), and the numbers do not change."""
    pytest.importorskip("peft")
    r = spawn(_lora_world1, 1)[0]
    assert r["shared"] and all(r["shared"]), r["shared"]
    for a, b in zip(r["stage3"], r["plain"]):
        assert abs(a - b) / b < 1e-5, (r["stage3"], r["plain"])
