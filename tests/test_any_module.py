"""Any ``nn.Module`` at ZeRO stages 0-3: real model files nobody here wrote, against one process.

nanoGPT's and minGPT's ``model.py`` and torchvision's ResNet, vendored verbatim under ``tests/thirdparty/``
(see its README), a timm-style ViT built here (``cls_token`` and ``pos_embed`` parameters on the root, the
blocks in an ``nn.Sequential``), and T5 and GPT-2 from transformers with ``_no_split_modules`` cleared (so
stage 3 finds their units on its own: an encoder-decoder, tied embeddings). Each trains at stages 0-3 on 2
and 3 gloo ranks to the numbers of one process training on the concatenated batch (fp32, max abs diff of
losses and weights 1e-5), and at stage 3 resumes from a checkpoint saved after ``SAVE_AT`` steps by a fresh
engine to exactly the uninterrupted run. The ResNet keeps its BatchNorm, which normalises each rank's own
micro-batch under any data parallelism (DDP's numbers): its oracle is one process running the ranks'
micro-batches one after the other, as gradient accumulation over ``world`` micro-batches.

Then the reads stage 3 cannot hook (:mod:`hf_zero.zero.external`), each at stage 3 against one process: a
block called twice per forward, the same layer object three times in a ModuleList, ``F.linear(x,
self.head.weight)`` in the root's forward, a module used through a method other than its ``forward``, a
block reading the next block's weight, a first read in a no-grad forward, ``register_external_parameter``
before and after ``initialize`` for a read that first happens at step 2, and the one-sentence error for
such a read left unregistered.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import spawn

THIRDPARTY = str(Path(__file__).resolve().parent / "thirdparty")
if THIRDPARTY not in sys.path:
    sys.path.insert(0, THIRDPARTY)

STEPS = 4
SAVE_AT = 2
MICRO = 2
SEQ = 8
VOCAB = 61
LR = 1e-3
# A bias whose true gradient is exactly zero (the key bias of attention: softmax ignores it) gets rounding noise
# as its gradient, which Adam with a tiny eps turns into lr-sized steps in either implementation.
EPS = 1e-4
TOL = 1e-5
KINDS = ["nanogpt", "mingpt", "resnet", "vit", "t5", "gpt2"]


# ----------------------------------------------------------------------------- the models


class _Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, dim * 3)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class _ViTBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(torch.nn.Module):
    """timm's VisionTransformer in miniature: patch embedding, class token and position table on the root."""

    def __init__(self, image: int = 8, patch: int = 4, dim: int = 24, depth: int = 3, heads: int = 3, classes: int = 7) -> None:
        super().__init__()
        self.patch_embed = torch.nn.Conv2d(3, dim, patch, patch)
        n = (image // patch) ** 2
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = torch.nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = torch.nn.Sequential(*[_ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return F.cross_entropy(self.head(x[:, 0]), labels)


class _MLP(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 2 * dim)
        self.out = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        inner = F.gelu(self.fc(self.norm(x)))
        h = self.out(inner)
        return h if other is None else h + F.linear(inner, other)  # `other`: another unit's `out.weight`


class Twice(torch.nn.Module):
    """A block of a ModuleList called again after the next one, before its first call's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.layers = torch.nn.ModuleList([_MLP(16), _MLP(16)])
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        h = h + self.layers[0](h)
        assert self.head.weight.shape[1] == h.shape[-1]  # a shape is not a read: the head is not pinned for it
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class Repeated(torch.nn.Module):
    """ALBERT's shared layer: the same module object three times in a ModuleList (one unit, called thrice)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        shared = _MLP(16)
        self.layers = torch.nn.ModuleList([shared, shared, shared])
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class HeadByWeight(torch.nn.Module):
    """The root's forward reads the head's weights with ``F.linear``; the head module itself never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.body = torch.nn.ModuleList([_MLP(16)])
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.body[0](self.emb(ids))
        return F.cross_entropy(F.linear(h, self.head.weight, self.head.bias).flatten(0, 1), labels.flatten())


class _Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called: the model uses encode()
        raise AssertionError("unused")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class ByMethod(torch.nn.Module):
    """Forward is not the entry point: a method of the root reads a child's table, a child runs through ``encode``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.tower = _Tower()
        self.head = torch.nn.Linear(16, VOCAB)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.tok.weight) * 2.0

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.tower.encode(self.embed(ids))).flatten(0, 1), labels.flatten())


class CrossRead(torch.nn.Module):
    """Block 0 reads block 1's weight inside its own forward, while block 1 is not running.

    From the second step on prefetch has gathered block 1 when block 0 runs, so a watch asking "is it gathered?"
    rather than "is its unit running?" would miss it on a first no-grad forward after training; and block 0's
    backward, which comes after block 1's, reads it again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.blocks = torch.nn.ModuleList([_MLP(16), _MLP(16), _MLP(16)])
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.blocks[0](h, other=self.blocks[1].out.weight)
        for block in self.blocks[1:]:
            h = h + block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class LateRead(torch.nn.Module):
    """An auxiliary head read with ``F.linear`` only from step 2 on: a path the first forwards do not take."""

    def __init__(self, register: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.body = torch.nn.Sequential(_MLP(16), _MLP(16))
        self.head = torch.nn.Linear(16, VOCAB)
        self.aux = torch.nn.Linear(16, VOCAB)
        if register:  # as DeepSpeed's docs do it, in __init__
            from hf_zero.zero import register_external_parameter

            register_external_parameter(self, self.aux.weight)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = self.body(self.emb(ids))
        logits = self.head(h)
        if aux:
            logits = logits + F.linear(h, self.aux.weight, self.aux.bias)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


HOOKLESS = {"twice": Twice, "repeated": Repeated, "head_by_weight": HeadByWeight, "no_grad_first": HeadByWeight, "by_method": ByMethod,
            "cross_read": CrossRead, "late_registered": lambda: LateRead(register=True),
            "late_registered_after": LateRead, "late_unregistered": LateRead}


def _build(kind: str) -> torch.nn.Module:
    import contextlib
    import io

    torch.manual_seed(0)
    if kind in HOOKLESS:
        return HOOKLESS[kind]()
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT and minGPT print their size
        if kind == "nanogpt":
            from nanogpt.model import GPT, GPTConfig

            return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True))
        if kind == "mingpt":
            from mingpt.model import GPT

            cfg = GPT.get_default_config()
            cfg.merge_from_dict({"model_type": None, "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": VOCAB,
                                 "block_size": SEQ, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0})
            return GPT(cfg)
    if kind == "resnet":
        from torchvision_resnet import BasicBlock, ResNet

        return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=7)
    if kind == "vit":
        return ViT()
    if kind == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        model = T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model._no_split_modules = None  # stage 3 finds the units by itself
    return model


def _data(kind: str, global_batch: int) -> list[dict]:
    """Per step, the whole global batch as the model's inputs."""
    g = torch.Generator().manual_seed(7)
    steps = []
    for t in range(STEPS):
        if kind.startswith("late"):
            ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
            steps.append({"ids": ids, "labels": torch.randint(0, VOCAB, (global_batch, SEQ), generator=g), "aux": t >= 2})
        elif kind in HOOKLESS:
            ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
            steps.append({"ids": ids, "labels": torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)})
        elif kind in ("resnet", "vit"):
            size = 48 if kind == "resnet" else 8
            steps.append({"x": torch.randn(global_batch, 3, size, size, generator=g),
                          "labels": torch.randint(0, 7, (global_batch,), generator=g)})
        else:
            ids = torch.randint(1, VOCAB, (global_batch, SEQ), generator=g)
            steps.append({"ids": ids, "labels": torch.randint(1, VOCAB, (global_batch, SEQ), generator=g)})
    return steps


def _loss(kind: str, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model called its own way on a (micro-)batch, and its loss."""
    if kind.startswith("late"):
        return model(batch["ids"], batch["labels"], aux=batch["aux"])
    if kind in HOOKLESS:
        return model(batch["ids"], batch["labels"])
    if kind in ("nanogpt", "mingpt"):
        return model(batch["ids"], batch["labels"])[1]
    if kind == "resnet":
        return F.cross_entropy(model(batch["x"]), batch["labels"])
    if kind == "vit":
        return model(batch["x"], batch["labels"])
    if kind == "t5":
        return model(input_ids=batch["ids"], labels=batch["labels"]).loss
    return model(input_ids=batch["ids"], labels=batch["ids"]).loss


def _slice(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi] if torch.is_tensor(v) else v for k, v in batch.items()}


def _oracle(kind: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: the concatenated batch (the ResNet: the ranks' micro-batches in turn, BatchNorm per micro-batch)."""
    model = _build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in _data(kind, MICRO * world):
        if kind == "resnet":
            total = 0.0
            for r in range(world):
                loss = _loss(kind, model, _slice(batch, r * MICRO, (r + 1) * MICRO)) / world
                loss.backward()
                total += loss.item()
        else:
            loss = _loss(kind, model, batch)
            loss.backward()
            total = loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- the engine side


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01}},
        # every parameter sharded at stage 3 (the root's position table and class token too)
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }


def _engine(model: torch.nn.Module, stage: int):  # noqa: ANN202
    import hf_zero

    engine, _, _, _ = hf_zero.initialize(model=model, config=_config(stage))
    return engine


def _train(engine, kind: str, rank: int, world: int, steps: range, save_to: str | None = None) -> list[float]:  # noqa: ANN001
    """Train on this rank's micro-batches of ``steps``; with ``save_to``, save a checkpoint after step ``SAVE_AT``."""
    import torch.distributed as dist

    data = _data(kind, MICRO * world)
    losses = []
    for t in steps:
        loss = _loss(kind, engine, _slice(data[t], rank * MICRO, (rank + 1) * MICRO))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if save_to is not None and engine.global_steps == SAVE_AT:
            engine.save_checkpoint(save_to)
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from hf_zero.zero import GatheredParameters

    params = dict(engine.module.named_parameters())
    with GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _families(rank: int, world: int, kinds: list[str], ckpt_root: str) -> list[dict]:
    """Every kind at stages 0-3 against the oracle (on rank 0, which alone runs it); at stage 3 a resume too."""
    import time

    out = []
    for kind in kinds:
        t0 = time.perf_counter()
        ref_losses, ref_w = _oracle(kind, world) if rank == 0 else (None, None)
        for stage in (0, 1, 2, 3):
            t1 = time.perf_counter()
            engine = _engine(_build(kind), stage)
            ckpt = f"{ckpt_root}/{kind}" if stage == 3 else None
            losses = _train(engine, kind, rank, world, range(STEPS), save_to=ckpt)
            w = _weights(engine)
            row: dict = {"kind": kind, "stage": stage}
            if rank == 0:
                row["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
                row["w_diff"] = _max_diff(w, ref_w)
            if stage == 3:
                rt = engine.zero_optimizer.runtime
                row["units"] = [u.name for u in rt.units]
                row["pinned"] = [u.name for u in rt.units if u.pinned]
                # a fresh engine loads what the run above saved after SAVE_AT steps and finishes: the same numbers
                resumed = _engine(_build(kind), 3)
                resumed.load_checkpoint(ckpt)
                rest = _train(resumed, kind, rank, world, range(SAVE_AT, STEPS))
                row["resume_loss_diff"] = max(abs(a - b) for a, b in zip(rest, losses[SAVE_AT:]))
                row["resume_w_diff"] = _max_diff(_weights(resumed), w)
            row["secs"] = round(time.perf_counter() - (t1 if stage else t0), 2)  # stage 0's includes the oracle
            out.append(row)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_model_families_train_like_one_process_at_every_stage(world: int, tmp_path: Path) -> None:
    results = spawn(_families, world, KINDS, str(tmp_path))
    for r in results[0]:  # rank 0 ran the oracle
        assert r["loss_diff"] < TOL and r["w_diff"] < TOL, r
    for per_rank in results:
        assert [(r["kind"], r["stage"]) for r in per_rank] == [(k, s) for k in KINDS for s in range(4)]
        for r in per_rank:
            if r["stage"] == 3:
                assert r["resume_loss_diff"] == 0.0 and r["resume_w_diff"] == 0.0, r
                assert not r["pinned"], r  # these models read every weight inside its own unit
    units = {r["kind"]: r["units"] for r in results[0] if r["stage"] == 3}
    # found through the containers whose forward never runs (ModuleDict, ModuleList) or only chains (Sequential)
    assert units["nanogpt"] == ["transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"], units
    assert units["mingpt"] == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                               "transformer.ln_f", "lm_head"], units
    assert "layer1.0" in units["resnet"] and "layer4.0" in units["resnet"], units
    assert units["vit"] == ["patch_embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"], units
    assert {"encoder.block.1", "decoder.block.1", "decoder.final_layer_norm"} <= set(units["t5"]), units
    assert "transformer.h.1" in units["gpt2"] and "lm_head" not in units["gpt2"], units  # tied: in the root


def _hookless(rank: int, world: int, kinds: list[str]) -> list[dict]:
    """Each model at stage 3 against one process (run on rank 0); which units the reads pinned."""
    import hf_zero
    from hf_zero.errors import UsageError

    out = []
    for kind in kinds:
        row: dict = {"kind": kind}
        engine = _engine(_build(kind), 3)
        if kind == "late_registered_after":
            hf_zero.zero.register_external_parameter(engine.module, engine.module.aux.weight)
        if kind == "no_grad_first":  # an evaluation before any training forward finds the read
            first = _data(kind, MICRO * world)[0]
            with torch.no_grad():
                row["eval"] = _loss(kind, engine, _slice(first, rank * MICRO, (rank + 1) * MICRO)).item()
        try:
            losses = _train(engine, kind, rank, world, range(STEPS))
        except UsageError as e:
            row["error"] = str(e)
            out.append(row)
            continue
        w = _weights(engine)
        row["pinned"] = sorted(u.name for u in engine.zero_optimizer.runtime.units if u.pinned)
        row["units"] = [u.name for u in engine.zero_optimizer.runtime.units]
        if rank == 0:
            ref_losses, ref_w = _oracle(kind, world)
            row["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
            row["w_diff"] = _max_diff(w, ref_w)
            if kind == "no_grad_first":
                model = _build(kind)
                with torch.no_grad():
                    ref = [_loss(kind, model, _slice(first, r * MICRO, (r + 1) * MICRO)).item() for r in range(world)]
                row["eval_diff"] = abs(row["eval"] - ref[0])
        out.append(row)
    return out


def test_reads_no_hook_sees_train_like_one_process() -> None:
    """Parameters read outside their unit's forward: found on the first forward (or registered), the same numbers."""
    kinds = ["twice", "repeated", "head_by_weight", "no_grad_first", "by_method", "cross_read", "late_registered",
             "late_registered_after", "late_unregistered"]
    results = spawn(_hookless, 2, kinds)
    pinned = {
        "twice": [], "repeated": [],  # called more than once, but always through their hooks
        "head_by_weight": ["head"], "no_grad_first": ["head"], "by_method": ["tok", "tower"],
        "cross_read": ["blocks.1"], "late_registered": ["aux"], "late_registered_after": ["aux"],
    }
    for per_rank in results:
        by_kind = {r["kind"]: r for r in per_rank}
        for kind, names in pinned.items():
            assert by_kind[kind]["pinned"] == names, by_kind[kind]
        # a read first made at step 2 and never registered: one sentence naming it, on every rank
        err = by_kind["late_unregistered"].get("error", "")
        assert "parameter 'aux.weight' (sharded with unit 'aux')" in err and "register_external_parameter" in err and "test_any_module.py" in err, err
    for r in results[0]:
        if r["kind"] != "late_unregistered":
            assert r["loss_diff"] < TOL and r["w_diff"] < TOL, r
    by_kind = {r["kind"]: r for r in results[0]}
    assert by_kind["no_grad_first"]["eval_diff"] < TOL, by_kind["no_grad_first"]
    assert by_kind["repeated"]["units"] == ["emb", "layers.0", "head"], by_kind["repeated"]


def test_register_external_parameter_speaks_deepspeed() -> None:
    """DeepSpeed's names, attribute and refusals (RuntimeError, as DeepSpeed raises)."""
    import hf_zero as deepspeed
    from hf_zero.zero import register_external_parameter, unregister_external_parameter

    assert deepspeed.zero.register_external_parameter is register_external_parameter
    model = LateRead()
    register_external_parameter(model, model.aux.weight)
    register_external_parameter(model, model.aux.weight)  # twice is a no-op, as in DeepSpeed
    assert list(model._external_params.values()) == [model.aux.weight]
    unregister_external_parameter(model, model.aux.weight)
    assert model._external_params == {}
    with pytest.raises(RuntimeError, match="not registered"):
        unregister_external_parameter(model, model.aux.weight)
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        register_external_parameter(model, model.aux.weight.detach())
    # GatheredParameters(fwd_module=...) registers them, as DeepSpeed's does
    with deepspeed.zero.GatheredParameters([model.head.weight], fwd_module=model.body):
        pass
    assert list(model.body._external_params.values()) == [model.head.weight]


def test_units_are_found_through_containers() -> None:
    """Where find_units stops: blocks in a ModuleList, lists of lists, an MoE block (one unit), a Sequential root."""
    from hf_zero.zero.stage3 import find_units

    class MoE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))  # stays with the root
            self.embed = torch.nn.Embedding(5, 4)
            self.moe_blocks = torch.nn.ModuleList([MoE(), MoE()])  # each block one unit, experts inside it
            self.pairs = torch.nn.ModuleList([torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Dropout()])])
            self.encoder = torch.nn.Module()  # a plain module holding a container: walked into
            self.encoder.layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
            self.encoder.norm = torch.nn.LayerNorm(4)
            self.act = torch.nn.ReLU()

    names = [n for n, _ in find_units(Net())]
    assert names == ["embed", "moe_blocks.0", "moe_blocks.1", "pairs.0.0", "encoder.layers.0", "encoder.layers.2",
                     "encoder.norm"], names
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), MoE())
    assert [n for n, _ in find_units(seq)] == ["0", "2"]
