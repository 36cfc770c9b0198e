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
