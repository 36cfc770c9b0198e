"""``benchmarks/bench.py``'s composed-layout engines on 4 gloo ranks: the code the GPU rows run, built by the bench's
own helpers (``hf_engine_config``, ``fsdp2_step``, ``layout_of``) on a tiny transformers Llama in fp32.

``hf3h`` (hybrid 2 x 2 by the default ``--shard``), ``hf3tp`` (AutoTP 2 x ZeRO-3 dp 2) and ``fsdp2tp`` (torch's
``parallelize_module`` over the tp half of a (dp, tp) DeviceMesh, ``fully_shard`` over the dp half) beside the rows
they are compared with on the GPU, ``hf3`` and ``fsdp2``, each trained 3 steps on the same global batch (the two
data streams of the tp rows' dp ranks; the plain rows' rank r reads stream r // 2, so their gradients average the same
samples). Each row's per-step loss (mean over the ranks) equals plain torch AdamW in one process on the concatenated
batch, and fsdp2tp's first loss equals fsdp2's on the same batch (1e-4, fp32): a wrong split (a head count left
whole, a rowwise output not reduced) changes the forward and fails it. The bench's data ranks for the tp rows (what
makes a tp group read one batch) are checked against the engine's grid and the mesh.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from tests.distributed import spawn
from tests.models import tiny_causal_lm, train_one_process

STEPS, MICRO, SEQ, VOCAB, LR = 3, 2, 16, 64, 1e-2
ENGINES = ("fsdp2", "fsdp2tp", "hf3", "hf3h", "hf3tp")
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def _bench():  # noqa: ANN202
    if "hf_zero_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hf_zero_bench", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["hf_zero_bench"] = module
        spec.loader.exec_module(module)
    return sys.modules["hf_zero_bench"]


def _model() -> torch.nn.Module:
    # 4 heads over 2 key/value heads: tp 2 leaves 2 and 1 on each rank (the 8B shape's 32/8 at tp 2: 16/4)
    return tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


def _data() -> torch.Tensor:
    """``[step, stream, micro, seq]``: two data streams (the dp ranks of the tp rows)."""
    return torch.randint(0, VOCAB, (STEPS, 2, MICRO, SEQ), generator=torch.Generator().manual_seed(3))


def _args(engines: str) -> argparse.Namespace:
    # the bench's flags at their defaults (--shard 0: half the GPUs; --tp 2), fp32 and a learning rate that moves
    return argparse.Namespace(model="tiny", micro=MICRO, gas=1, seq=SEQ, bucket=int(5e8), prefetch=None, hf_config="{}",
                              checkpoint_blocks=False, breakdown=False, compile=False, shard=0, tp=2, engines=engines,
                              dtype="fp32", lr=LR)


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hf_zero

    bench, data, out = _bench(), _data(), {}
    for name in ENGINES:
        args = _args(name)
        model = _model()
        if name.startswith("hf"):
            engine = hf_zero.initialize(model=model, config=bench.hf_engine_config(name, args, world))[0]
            data_rank = engine.tensor_parallel_groups.dp_rank if name == "hf3tp" else rank // 2
            local = engine.module.model.layers[0].self_attn.q_proj.weight

            def step(ids: torch.Tensor) -> torch.Tensor:
                loss = engine(input_ids=ids, labels=ids).loss  # noqa: B023 - run before the next engine is built
                engine.backward(loss)  # noqa: B023
                engine.step()  # noqa: B023
                return loss
        else:
            step, data_rank = bench.fsdp2_step(model, args, tp=args.tp if name == "fsdp2tp" else 1)
            if name == "fsdp2":
                data_rank = rank // 2  # stream r // 2: the tp rows' global batch
            local = model.model.layers[0].self_attn.q_proj.weight
            local = local.to_local() if hasattr(local, "to_local") else local
        losses = []
        for t in range(STEPS):
            loss = step(data[t, data_rank]).detach()
            mean = loss.clone()
            dist.all_reduce(mean)
            losses.append({"local": float(loss), "mean": float(mean) / world})
        out[name] = {"losses": losses, "data_rank": data_rank, "q_local": list(local.shape),
                     "label": bench.layout_of(name, args, world)["label"]}
        if name.startswith("hf"):
            engine.destroy()
    return out


def test_composed_layout_engines_train_to_one_process() -> None:
    results = spawn(_ranks, 4)
    data = _data()
    batches = [[{"input_ids": data[t].reshape(-1, SEQ), "labels": data[t].reshape(-1, SEQ)}] for t in range(STEPS)]
    ref, _ = train_one_process(_model(), batches, lr=LR, eps=1e-8)
    still, _ = train_one_process(_model(), batches, lr=0.0, eps=1e-8)  # the same batches through the initial weights
    first = results[0]
    assert [first[n]["label"] for n in ENGINES] == [
        "fsdp2", "fsdp2tp (tp 2 x dp 2)", "hf3", "hf3h (replicate 2 x shard 2)", "hf3tp (tp 2 x dp 2)"]
    for rank, res in enumerate(results):
        # the tp rows: ranks 2d and 2d + 1 form one tp group and read stream d
        assert res["hf3tp"]["data_rank"] == res["fsdp2tp"]["data_rank"] == rank // 2, (rank, res)
        # both splits hold half of q's 4 x 8 = 32 output features (FSDP2 then shards that half over dp 2)
        assert res["hf3tp"]["q_local"] == [16, 32], res["hf3tp"]
        assert res["fsdp2tp"]["q_local"] == [8, 32], res["fsdp2tp"]
        # fsdp2tp's first loss is fsdp2's on the same batch (the forward through the split layers)
        a, b = res["fsdp2tp"]["losses"][0]["local"], res["fsdp2"]["losses"][0]["local"]
        assert abs(a - b) < 1e-4, (rank, a, b)
    for name in ENGINES:
        got = [s["mean"] for s in first[name]["losses"]]
        err = max(abs(g - r) / r for g, r in zip(got, ref))
        print(f"{first[name]['label']}: losses {got}, largest relative difference from one process {err:.2e}")
        assert err < 1e-4, (name, got, ref)
    # the steps move the loss well past the tolerance, so a row whose optimizer step did nothing would fail
    assert min(abs(r - s) / s for r, s in zip(ref[1:], still[1:])) > 1e-3, (ref, still)
