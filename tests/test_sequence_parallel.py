"""hf_zero.sequence on one process: the pieces that need no group.

The tiled loss and the tiled MLP against their untiled selves (values and gradients), the
offloaded block checkpoint against a plain one, the batch cut (labels shifted before the cut,
global positions, padding), the config keys (a public ALST config of LLaMA-Factory's), and the
refusals. The multi-rank oracles are in tests/test_sequence_parallel_dist.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zero.config import sequence as spc
from hf_zero.config.schema import ConfigError
from hf_zero.sequence import (
    SequenceParallelError,
    checkpoint_offloaded,
    fused_linear_cross_entropy,
    shard_batch,
)
from hf_zero.sequence.attention import check_heads
from hf_zero.sequence.loss import cross_entropy_sum
from hf_zero.sequence.model import LongSequenceOptions, prepare_model
from hf_zero.sequence.tiling import tile_mlps

# The sequence-parallel part of LLaMA-Factory's public ALST config (examples/deepspeed/ds_z3_alst_config.json
# in hiyouga/LLaMA-Factory), as it ships.
LLAMA_FACTORY_ALST = {
    "sequence_parallel": {
        "enabled": True, "size": 4, "mode": "ulysses", "ulysses": {"degree": 4, "seq_length_is_variable": True},
        "tiling": {"enabled": True, "chunk_size": 8192}, "memory_optimizations": {"enabled": True, "pytorch_profiling": False},
    },
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _llama(**kw: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg))


@pytest.mark.parametrize("bias", [False, True])
def test_tiled_loss_equals_untiled(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 50, (3, 37), generator=g)
    y[0, :30] = -100  # a shard mostly without targets
    y[2, :] = -100
    leaves = [t for t in (h, w, b) if t is not None]
    total, count = fused_linear_cross_entropy(h, w, b, y, tile_tokens=7)
    (total * 0.37).backward()
    tiled = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref_total, ref_count = cross_entropy_sum(torch.nn.functional.linear(h, w, b), y)
    (ref_total * 0.37).backward()
    assert int(count) == int(ref_count) == int((y != -100).sum())
    assert abs(total.item() - ref_total.item()) <= 1e-6 * ref_total.item()
    for a, r in zip(tiled, (t.grad for t in leaves)):
        assert _rel(a, r) < 1e-6


def test_tiled_loss_in_a_model_equals_transformers_loss() -> None:
    """The fused path of a Llama (decoder + tiled head) against transformers' own forward."""
    ref, model = _llama(), _llama()
    prepare_model(model, None, LongSequenceOptions(tiled_loss=True, loss_tile_tokens=5))
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :9] = -100
    out, expect = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.logits is None  # full logits never existed
    out.loss.backward()
    expect.loss.backward()
    assert abs(out.loss.item() - expect.loss.item()) < 1e-6 * expect.loss.item()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert _rel(p.grad, q.grad) < 1e-5, n
    model.eval()  # evaluation keeps the model's own forward, logits included
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels).logits.shape == (2, 23, 96)


def test_tiled_mlp_equals_untiled() -> None:
    ref, model = _llama(), _llama()
    assert tile_mlps(model, 6) == 2
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(2))
    out, expect = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    expect.loss.backward()
    assert abs(out.loss.item() - expect.loss.item()) < 1e-6 * expect.loss.item()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert _rel(p.grad, q.grad) < 1e-5, n


def test_offloaded_checkpoint_matches_and_releases_the_input() -> None:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x0 = torch.randn(4, 8, requires_grad=True)
    through: list = []  # a checkpoint function to go through instead

    def run(offload: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in [x0, *block.parameters()]:
            p.grad = None
        hidden = x0 * 2  # a block input that only the checkpoint would keep alive
        alive = weakref.ref(hidden)
        plain = lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False)  # noqa: E731
        out = (through[0] if through else checkpoint_offloaded if offload else plain)(block, hidden)
        del hidden
        gc.collect()
        released = alive() is None
        out.sum().backward()
        return released, [x0.grad.clone(), *(p.grad.clone() for p in block.parameters())]

    released_plain, plain = run(False)
    released, offloaded = run(True)
    assert released and not released_plain  # the plain checkpoint holds its input; ours moved it to the host copy
    for a, b in zip(offloaded, plain):
        assert torch.equal(a, b)
    # DeepSpeed's deepspeed.checkpointing with cpu_checkpointing goes the same way
    from hf_zero import checkpointing

    checkpointing.configure(None, checkpoint_in_cpu=True)
    try:
        through.append(checkpointing.checkpoint)
        released_ds, through_ds = run(True)
    finally:
        checkpointing.configure(None)
    assert released_ds and all(torch.equal(a, b) for a, b in zip(through_ds, plain))


def test_shard_batch_shifts_before_cutting() -> None:
    ids = torch.arange(14).view(2, 7)
    labels = ids + 100
    labels[0, 3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 7, dtype=torch.long), "note": "x"}
    shards = [shard_batch(batch, r, 3, pad_token_id=5) for r in range(3)]
    cat = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("input_ids", "shift_labels", "position_ids", "attention_mask")}
    assert cat["input_ids"].shape == (2, 9) and torch.equal(cat["input_ids"][:, :7], ids) and (cat["input_ids"][:, 7:] == 5).all()
    # every target survives the cut: position t predicts labels[t + 1], the pad predicts nothing
    assert torch.equal(cat["shift_labels"][:, :6], labels[:, 1:]) and (cat["shift_labels"][:, 6:] == -100).all()
    assert torch.equal(cat["position_ids"], torch.arange(9).expand(2, 9))
    assert (cat["attention_mask"] == 1).all()
    assert all("labels" not in s and s["note"] == "x" for s in shards)
    assert torch.equal(batch["labels"], labels)  # the input is left alone
    with pytest.raises(SequenceParallelError, match="2D attention_mask"):
        shard_batch({"input_ids": ids, "attention_mask": torch.ones(2, 1, 7, 7)}, 0, 2)
    with pytest.raises(SequenceParallelError, match="input_ids"):
        shard_batch({"labels": labels}, 0, 2)


def test_heads_that_do_not_split_are_refused() -> None:
    check_heads(8, 2, 4)  # 2 KV heads repeated to 4
    check_heads(8, 8, 4)
    with pytest.raises(SequenceParallelError, match="6 attention heads"):
        check_heads(6, 6, 4)
    with pytest.raises(SequenceParallelError, match="3 key/value heads"):
        check_heads(12, 3, 4)


def test_model_under_sp_refuses_labels_and_missing_positions() -> None:
    """The mistakes a caller can make with a prepared model, each refused in a sentence (world of 1: an sp
    group of one still takes the SP path when built by hand)."""
    from hf_zero.sequence.groups import SequenceParallelGroups

    groups = SequenceParallelGroups(2, 0, None, 1, 0, None, None, (0, 1), (0,))
    model = _llama()
    prepare_model(model, groups, LongSequenceOptions())
    assert model.config._attn_implementation == "hf_zero_ulysses_sdpa"
    ids = torch.randint(0, 96, (1, 8))
    with pytest.raises(SequenceParallelError, match="shift_labels"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(SequenceParallelError, match="position_ids"):
        model(input_ids=ids, shift_labels=ids)
    with pytest.raises(SequenceParallelError, match="already prepared"):
        prepare_model(model, groups, LongSequenceOptions())
    model.eval()  # outside training the model is its plain self
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).logits.shape == (1, 8, 96)


def test_config_keys() -> None:
    cfg = spc.parse(LLAMA_FACTORY_ALST)
    assert (cfg.size, cfg.tiled_loss, cfg.tiled_mlp, cfg.loss_tile_tokens, cfg.mlp_tile_tokens) == (4, True, True, 8192, 8192)
    assert cfg.ignored == ["sequence_parallel.memory_optimizations"]
    cfg = spc.parse({"sequence_parallel_size": 2})
    assert (cfg.size, cfg.tiled_loss, cfg.tiled_mlp) == (2, True, False)  # the tiled loss is on with SP
    assert spc.parse({}).tiled_loss is False
    cfg = spc.parse({"sequence_parallel_size": 2, "sequence_parallel": {"tiled_loss": False, "tiled_mlp": True, "mlp_tile_tokens": 64}})
    assert (cfg.tiled_loss, cfg.tiled_mlp, cfg.mlp_tile_tokens) == (False, True, 64)
    assert spc.parse({"sequence_parallel_size": 4, "sequence_parallel": {"enabled": False, "size": 8}}).size == 4
    bad = [
        ({"sequence_parallel_size": 0}, "sequence_parallel_size: got 0"),
        ({"sequence_parallel_size": 2, "sequence_parallel": {"size": 4}}, "differs"),
        ({"sequence_parallel": {"mode": "ring"}}, "Ulysses"),
        ({"sequence_parallel": {"tiled_mlp": "yes"}}, "sequence_parallel.tiled_mlp: got 'yes'"),
        ({"sequence_parallel": {"loss_tile_tokens": -1}}, "loss_tile_tokens"),
        ({"sequence_parallel": {"tile_mlp": True}}, "sequence_parallel.tile_mlp: unknown key"),
    ]
    for data, match in bad:
        with pytest.raises(ConfigError, match=match):
            spc.parse(data)


def test_public_alst_config_through_the_engine_config() -> None:
    """LLaMA-Factory's ALST config: its sequence-parallel section is read (one key named in a warning); with
    parameter offload to the CPU it still loads (offload_param runs at stage 3), to NVMe it is refused on the
    offload's own account."""
    from hf_zero.config import ZeroConfig

    alst = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                                  "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                                  "stage3_max_reuse_distance": 1e9},
            "bf16": {"enabled": True}, **LLAMA_FACTORY_ALST, "steps_per_print": 10, "wall_clock_breakdown": False}
    with pytest.warns(UserWarning, match="memory_optimizations"):
        cfg = ZeroConfig.load(alst)
    assert (cfg.sequence_parallel_size, cfg.sequence_parallel.tiled_mlp) == (4, True)
    offload = dict(alst, zero_optimization={**alst["zero_optimization"], "offload_param": {"device": "cpu"}})
    cfg = ZeroConfig.load(offload)
    assert cfg.sequence_parallel_size == 4 and cfg.zero_optimization.offload_param.device == "cpu"
    nvme = dict(alst, zero_optimization={**alst["zero_optimization"], "offload_param": {"device": "nvme", "nvme_path": "/x"}})
    with pytest.raises(ConfigError, match="offload_param"):  # NVMe params need offload_optimizer (tests/test_nvme.py)
        ZeroConfig.load(nvme)
    assert ZeroConfig.load({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 8}).sequence_parallel_size == 8


def test_tiling_lowers_the_peak() -> None:
    """What the tiles are for: full logits (and the MLP's full intermediate activations) never exist.

    Measured (1024 tokens): loss 53.5 MB -> 6.4 MB with a 4096 vocabulary; MLP 52.8 MB -> 9.4 MB at
    intermediate size 2048.
    """
    from tests.memtrack import PeakBytes

    def peak(model: torch.nn.Module) -> tuple[int, float]:
        ids = torch.randint(0, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(4))
        model(input_ids=ids[:, :8], labels=ids[:, :8]).loss.backward()  # warm-up: lazy buffers outside the measure
        model.zero_grad(set_to_none=False)
        with PeakBytes() as m:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return m.peak, loss.item()

    plain_loss, fused_loss = _llama(vocab_size=4096, num_hidden_layers=1), _llama(vocab_size=4096, num_hidden_layers=1)
    prepare_model(fused_loss, None, LongSequenceOptions(tiled_loss=True, loss_tile_tokens=128))
    (p0, l0), (p1, l1) = peak(plain_loss), peak(fused_loss)
    assert p1 < 0.5 * p0 and abs(l0 - l1) < 1e-5 * l0, (p0, p1)
    plain_mlp, tiled_mlp = _llama(intermediate_size=2048, num_hidden_layers=1), _llama(intermediate_size=2048, num_hidden_layers=1)
    tile_mlps(tiled_mlp, 128)
    (p0, l0), (p1, l1) = peak(plain_mlp), peak(tiled_mlp)
    assert p1 < 0.6 * p0 and abs(l0 - l1) < 1e-5 * l0, (p0, p1)
