"""Small models with awkward shapes for the arithmetic oracles.

7x15 weights, a bias-free layer, a frozen parameter and a tied weight: every case where
padding, uneven shards, parameter de-duplication or frozen weights could go wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 11
SEQ = 5


class Awkward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 7)
        self.fc1 = torch.nn.Linear(7, 15)
        self.fc2 = torch.nn.Linear(15, 7, bias=False)
        self.frozen = torch.nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(7)
        self.head = torch.nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.fc2(torch.tanh(self.fc1(h))) + self.frozen(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_model(seed: int = 0) -> Awkward:
    torch.manual_seed(seed)
    return Awkward()


def param_groups(model: torch.nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """Two groups, as transformers' Trainer builds them: decay for matrices, none for the rest."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_data(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=g)
    return ids, labels


def tiny_causal_lm(kind: str, **shape: int) -> torch.nn.Module:
    """A transformers Llama (untied head) or Qwen2 of ``shape`` (vocab_size, hidden_size, ...), seeded: the grid tests'
    decoder models, built from configs (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    if kind != "llama":
        raise ValueError(f"tiny_causal_lm: got {kind!r}, expected 'llama' or 'qwen2'")
    return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))


def train_one_process(
    model: torch.nn.Module, micro_batches: list[list[dict]], *, lr: float, eps: float, clip: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The arithmetic oracle of the engine tests: plain torch AdamW in one process.

    ``micro_batches[t]`` holds step ``t``'s micro-batches (model keyword arguments); each step's
    loss is the mean of its micro-batches' losses, clipped at ``clip`` (0: no clipping). Returns
    the per-step losses and the final weights by name.
    """
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses = []
    for step in micro_batches:
        total = 0.0
        for batch in step:
            loss = model(**batch).loss / len(step)
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def tiny_moe(kind: str, experts: int = 8, vocab: int = 32, seq: int = 8) -> torch.nn.Module:
    """A seeded tiny MoE causal LM of transformers' class ``kind`` (hidden 32, 2 layers, ``experts`` experts, top-2, aux
    loss on): the expert-parallel tests' and DeepSpeed's AutoEP oracle's (tests/ds_oracle_autoep.py) model."""
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=seq, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    torch.manual_seed(0)
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=24, num_local_experts=experts, **common))
    if kind == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=experts,
                                                      decoder_sparse_step=1, head_dim=8, **common))
    if kind == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                                      shared_expert_intermediate_size=16, num_experts=experts,
                                                      decoder_sparse_step=1, **common))
    if kind == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(intermediate_size=24, num_experts=experts, **common))
    if kind == "gpt_oss":
        return T.GptOssForCausalLM(T.GptOssConfig(intermediate_size=24, num_local_experts=experts, head_dim=8,
                                                  sliding_window=4, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 10000.0}, **common))
    if kind == "deepseek_v3":  # no aux loss in transformers' DeepSeek-V3; a shared expert and group-limited routing
        ds = {k: v for k, v in common.items() if k not in ("output_router_logits", "router_aux_loss_coef")}
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=24, n_routed_experts=experts, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, **ds))
    raise ValueError(f"tiny_moe: unknown kind {kind!r}")
