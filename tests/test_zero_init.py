"""``zero.Init``: models built (from a config, from a safetensors checkpoint, or plain torch)
without any rank holding them whole, and training from them exactly like an unsharded model.

Peak bytes are measured, not assumed: every tensor storage created inside the block is
watched until it is freed or emptied (tests/memtrack.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn
from tests.memtrack import PeakBytes

SEQ, VOCAB, MICRO, STEPS = 8, 256, 2, 3


def _config():  # noqa: ANN202
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, pad_token_id=0,
    )


@contextlib.contextmanager
def peak_bytes() -> Iterator[dict]:
    """Most CPU tensor-storage bytes alive at once inside the block (see tests/memtrack.py)."""
    box: dict = {}
    with PeakBytes() as m:
        yield box
    box["peak"] = m.peak


def _train(engine, rank: int, world: int, seed: int) -> list[float]:  # noqa: ANN001
    import torch.distributed as dist

    ids = torch.randint(0, VOCAB, (STEPS, MICRO * world, SEQ), generator=torch.Generator().manual_seed(seed))
    losses = []
    for t in range(STEPS):
        batch = ids[t, rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _oracle(model: torch.nn.Module, world: int, seed: int) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=EPS)
    ids = torch.randint(0, VOCAB, (STEPS, MICRO * world, SEQ), generator=torch.Generator().manual_seed(seed))
    losses = []
    for t in range(STEPS):
        loss = model(input_ids=ids[t], labels=ids[t]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# Adam divides each gradient by about sqrt(v) + eps: an element whose gradients stay well below eps (an embedding row
# whose contributions nearly cancel) moves by lr * g / eps, so a rounding difference of the sum order (3 ranks against
# one process) is multiplied by lr / eps. At eps 1e-4 one such element of this model's embedding differed by 4.7e-5
# (the whole tensor by 1.9e-5 relative) with transformers 5.24's initial weights; at 1e-3 the same rounding stays far
# inside 1e-5, and a real fault (a step lost, a slice misplaced) still moves the weights by about lr.
EPS = 1e-3
CFG = {
    "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": EPS}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
    "steps_per_print": 1000,
}


def _gathered_state(engine) -> dict:  # noqa: ANN001
    import hf_zero

    params = list(engine.module.parameters())
    with hf_zero.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def _cases(rank: int, world: int, ckpt: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import hf_zero
    from hf_zero.zero import pretrained

    out: dict = {}
    full_bytes = 4 * sum(p.numel() for p in LlamaForCausalLM(_config()).parameters())
    biggest = 4 * max(p.numel() for p in LlamaForCausalLM(_config()).parameters())
    out["full_bytes"], out["biggest"] = full_bytes, biggest

    # 1. from_config: built sharded, transformers' own initialisation replayed, trains like the unsharded model
    torch.manual_seed(100 + rank)  # ranks draw different numbers: rank 0's must win everywhere
    with peak_bytes() as built:
        with hf_zero.zero.Init():
            model = AutoModelForCausalLM.from_config(_config())
    out["config_peak_build"] = built["peak"]
    # outside the block each parameter is DeepSpeed's 0-element tensor, its whole shape in ds_shape
    full_shapes = {n: list(p.shape) for n, p in LlamaForCausalLM(_config()).named_parameters()}
    out["empty_after_build"] = all(p.numel() == 0 and list(p.ds_shape) == full_shapes[n] and p.ds_status.name == "NOT_AVAILABLE"
                                   for n, p in model.named_parameters())
    with peak_bytes() as init:
        engine, _, _, _ = hf_zero.initialize(model=model, config=CFG)
    out["config_peak_initialize"] = init["peak"]
    start = _gathered_state(engine)
    out["config_q_std"] = float(start["model.layers.0.self_attn.q_proj.weight"].std())
    out["config_norm_ones"] = bool((start["model.norm.weight"] == 1).all())
    ref = LlamaForCausalLM(_config())
    ref.load_state_dict(start)
    losses = _train(engine, rank, world, seed=5)
    want_losses, want_w = _oracle(ref, world, seed=5)
    out["config_loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    out["config_w_err"] = _rel(_gathered_state(engine), want_w)
    out["config_start_first"] = float(start["model.layers.3.mlp.up_proj.weight"][0, 0])

    # 1b. remote_device="cpu" with offload_param and offload_optimizer (transformers' ZeRO-3 offload recipe):
    # the slices wait in host memory, the same start and the same training
    offload = dict(CFG, zero_optimization=dict(CFG["zero_optimization"], offload_param={"device": "cpu"},
                                               offload_optimizer={"device": "cpu"}))
    torch.manual_seed(100 + rank)
    with hf_zero.zero.Init(remote_device="cpu", config_dict_or_path=offload):
        model = AutoModelForCausalLM.from_config(_config())
    out["remote_slices_on_host"] = all(p.hf_zero_preshard.shard.device.type == "cpu" for p in model.parameters())
    engine, _, _, _ = hf_zero.initialize(model=model, config=offload)
    out["remote_same_start"] = _rel(_gathered_state(engine), start) == 0.0
    losses = _train(engine, rank, world, seed=5)
    out["remote_loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    out["remote_w_err"] = _rel(_gathered_state(engine), want_w)

    # 2. from_pretrained of a sharded safetensors checkpoint: each rank reads its slices only
    with peak_bytes() as built:
        with hf_zero.zero.Init():
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    out["ckpt_peak_build"] = built["peak"]
    out["ckpt_stats"] = dict(pretrained.LAST_LOAD_STATS)
    engine, _, _, _ = hf_zero.initialize(model=model, config=CFG)
    saved = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    out["ckpt_exact"] = _rel(_gathered_state(engine), dict(saved.named_parameters())) == 0.0
    losses = _train(engine, rank, world, seed=6)
    want_losses, want_w = _oracle(saved, world, seed=6)
    out["ckpt_loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    out["ckpt_w_err"] = _rel(_gathered_state(engine), want_w)

    # 3. plain torch: each module's own init (incl. a hand-made Parameter) with rank 0's values
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 24)
            self.body = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24))
            self.scale = torch.nn.Parameter(torch.full((24,), 0.5))
            self.head = torch.nn.Linear(24, 50, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.emb(x)) * self.scale)

    torch.manual_seed(200 + rank)
    with hf_zero.zero.Init():
        net = Net()
        # editing a parameter after construction goes through GatheredParameters, as in DeepSpeed
        with hf_zero.zero.GatheredParameters([net.head.weight], modifier_rank=0):
            if rank == 0:
                net.head.weight.data[0].fill_(3.0)
    torch.manual_seed(200)
    want = Net()
    with torch.no_grad():
        want.head.weight[0].fill_(3.0)
    cfg = dict(CFG, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, _, _, _ = hf_zero.initialize(model=net, config=cfg)
    out["plain_exact"] = _rel(_gathered_state(engine), dict(want.named_parameters())) == 0.0

    # 4. DeepSpeed's ZeRO-Inference (transformers' docs): from_pretrained under zero.Init, its parameters left
    # trainable, then initialize with no optimizer: it stays sharded, as DeepSpeed partitions it, and predicts
    # as the whole model does
    with hf_zero.zero.Init():
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    out["inference_trainable_before"] = all(p.requires_grad for p in model.parameters())
    with peak_bytes() as init:
        engine, optimizer, _, _ = hf_zero.initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}})
    out["inference_peak_initialize"] = init["peak"]
    out["inference_optimizer"] = repr(optimizer)
    engine.eval()
    whole = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()  # `saved` has trained since
    ids = torch.arange(SEQ).reshape(1, SEQ) % VOCAB
    with torch.no_grad():
        out["inference_equal"] = torch.equal(engine(input_ids=ids).logits, whole(input_ids=ids).logits)
    out["inference_held"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
    out["inference_persistent"] = sum(4 * p.numel() for p in saved.parameters() if p.numel() < 100)  # the norms
    out["inference_frozen"] = not any(p.requires_grad for p in model.parameters())
    try:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    except hf_zero.UsageError as e:
        out["inference_backward"] = str(e)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("ckpt")
    LlamaForCausalLM(_config()).save_pretrained(path, max_shard_size="300KB")
    assert (path / "model.safetensors.index.json").exists()
    return path


def test_zero_init_builds_sharded_and_trains_like_unsharded(checkpoint: Path) -> None:
    world = 3
    results = spawn(_cases, world, str(checkpoint))
    for r in results:
        full, biggest = r["full_bytes"], r["biggest"]
        # never whole: slices (1/N) plus one module's weights in flight while it is cut
        assert r["empty_after_build"]
        assert r["config_peak_build"] < full / world + 3 * biggest < full, r
        assert r["config_peak_initialize"] < 0.8 * full, r
        assert r["ckpt_peak_build"] < full / world + 3 * biggest < full, r
        # transformers' _init_weights ran (normal(0, 0.02), norms at one), not nn.Linear's default
        assert abs(r["config_q_std"] - 0.02) < 0.004 and r["config_norm_ones"], r
        assert r["config_loss_err"] < 1e-5 and r["config_w_err"] < 1e-5, r
        assert r["remote_slices_on_host"] and r["remote_same_start"], r
        assert r["remote_loss_err"] < 1e-5 and r["remote_w_err"] < 1e-5, r
        assert r["ckpt_exact"] and r["ckpt_loss_err"] < 1e-5 and r["ckpt_w_err"] < 1e-5, r
        stats = r["ckpt_stats"]
        # each rank read about 1/N of the checkpoint (whole rows around its range), never all of it
        assert stats["elements_read"] < stats["elements_in_checkpoint_params"] / world * 1.2, stats
        assert r["plain_exact"], r
        # ZeRO-Inference: never gathered whole at initialize, sharded between forwards, the same logits
        assert r["inference_trainable_before"] and r["inference_optimizer"] == "None", r
        assert r["inference_peak_initialize"] < full / world + 3 * biggest, r
        # between forwards only the persistent norms stay whole (each padded to a multiple of the world size)
        assert 0 < r["inference_persistent"] <= r["inference_held"] <= 1.1 * r["inference_persistent"], r
        assert r["inference_equal"] and r["inference_frozen"], r
        assert r["inference_backward"] == "engine.backward() needs an optimizer; give one in the config or to initialize()", r
    # every rank started from the same (rank 0's) weights
    assert len({r["config_start_first"] for r in results}) == 1


def _unsharded_peak(rank: int, world: int) -> int:
    from transformers import AutoModelForCausalLM

    with peak_bytes() as box:
        AutoModelForCausalLM.from_config(_config())
    return box["peak"]


def test_peak_measurement_sees_a_whole_model() -> None:
    """The instrument works: building without zero.Init allocates the whole model."""
    from transformers import LlamaForCausalLM

    full = 4 * sum(p.numel() for p in LlamaForCausalLM(_config()).parameters())
    assert spawn(_unsharded_peak, 1)[0] >= full
