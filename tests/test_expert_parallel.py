"""Expert parallelism (``"expert_parallel": {"enabled": true, "autoep_size": N}``) against one process.

Tiny transformers MoE models, their classes unchanged (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, Qwen2-MoE with its
shared expert, OLMoE; 8 experts, top-2, ``output_router_logits`` on so the router's aux loss is in the loss), train
through ``hf_zero.initialize`` on 4 gloo ranks with EP groups of 2 (two expert-data-parallel ranks per expert) and of
4 (each rank alone with its experts), at ZeRO 0-3, with the optimizer offloaded and with block recomputation (the
exchanges rerun inside backward), 3 steps of 2 accumulated
micro-batches, clipped at 0.3. The oracle is one process with torch's AdamW on the same model whose loss is the mean
of the four ranks' micro-batch losses (the aux loss is per rank, so it is not the loss of the concatenated batch);
computed here, in the test process, and handed to the ranks, each of which compares its own experts (the slice of
the oracle's fused tensors it must hold) and the gathered rest (fp32, 1e-5). The pre-clip norm of the first step
is above the clip, so clipping acts, and equals the oracle's: a norm that counted an expert twice, or missed one,
would change every step after.

The all-to-all itself is checked apart on crafted routings: a rank that sends nothing, a rank that receives nothing,
an expert nobody picks; outputs and gradients (inputs, routing weights, experts) equal one process. Refusals (the
world or the expert count not divisible by autoep_size, DeepSpeed's keys hf_zero does not run) are one sentence.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_zero.config import ConfigError, ZeroConfig
from tests.distributed import spawn
from tests.models import tiny_moe, train_one_process  # tiny_moe: the other expert tests import it from here

WORLD, SEQ, VOCAB = 4, 8, 32
STEPS, GAS, MICRO, LR, EPS, CLIP = 3, 2, 2, 5e-3, 1e-8, 0.3
TOL = 1e-5
RECOMPUTE = {("qwen2_moe", 3, 2, True, False)}  # activation_checkpointing.checkpoint_blocks: the exchanges rerun in backward
GENERATE = ("mixtral", 2, 2, True, False)  # generate with each rank asking for a different number of tokens
SAVED = {("mixtral", 3, 2, False, False), ("gpt_oss", 3, 4, True, False)}  # save_pretrained, then from_pretrained

# (model, ZeRO stage, autoep_size, use_grouped_mm, offload_optimizer)
CASES = [
    ("mixtral", 2, 2, True, False), ("mixtral", 3, 2, False, False), ("mixtral", 2, 4, True, False),
    ("mixtral", 3, 4, True, False),
    ("qwen3_moe", 2, 2, True, False), ("qwen3_moe", 3, 2, True, False), ("qwen3_moe", 3, 4, False, False),
    ("deepseek_v3", 2, 2, True, False), ("deepseek_v3", 3, 2, True, False), ("deepseek_v3", 2, 4, True, False),
    ("gpt_oss", 2, 2, False, False), ("gpt_oss", 3, 2, True, False), ("gpt_oss", 3, 4, True, False),
    ("qwen2_moe", 3, 2, True, False), ("olmoe", 2, 4, True, False),
    ("mixtral", 0, 2, True, False), ("qwen3_moe", 1, 4, True, False),
    ("mixtral", 2, 2, True, True), ("deepseek_v3", 3, 4, True, True),
]


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, WORLD * GAS * MICRO, SEQ), generator=torch.Generator().manual_seed(1))


def _micro(ids: torch.Tensor, t: int, rank: int, g: int) -> torch.Tensor:
    lo = (rank * GAS + g) * MICRO
    return ids[t, lo : lo + MICRO]


def _config(stage: int, ep: int, grouped: bool, offload: bool) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "steps_per_print": 10_000, "zero_optimization": zero,
            "expert_parallel": {"enabled": True, "autoep_size": ep, "use_grouped_mm": grouped}}


def _oracle(kind: str) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    """One process: each step's loss is the mean of the 4 ranks' x 2 micro-batches' losses; the first pre-clip norm."""
    model = tiny_moe(kind)
    ids = _data()
    steps = [[{"input_ids": _micro(ids, t, r, g), "labels": _micro(ids, t, r, g)} for r in range(WORLD)
              for g in range(GAS)] for t in range(STEPS)]
    first = tiny_moe(kind)
    for b in steps[0]:
        (first(**b).loss / len(steps[0])).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(first.parameters(), float("inf")))
    losses, weights = train_one_process(model, steps, lr=LR, eps=EPS, clip=CLIP)
    return losses, norm, weights


def _train_case(rank: int, case: tuple, oracle: tuple, save_dir: str) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.expert.setup import ATTR
    from hf_zero.zero.group import subgroup_of

    kind, stage, ep, grouped, offload = case
    config = _config(stage, ep, grouped, offload)
    if case in RECOMPUTE:
        config["activation_checkpointing"] = {"checkpoint_blocks": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = hf_zero.initialize(model=tiny_moe(kind), config=config,
                                    optimizer=lambda g: torch.optim.AdamW(g, lr=LR, eps=EPS))[0]
    ids = _data()
    losses, norms = [], []
    for t in range(STEPS):
        total = 0.0
        for g in range(GAS):
            batch = _micro(ids, t, rank, g)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        losses.append(total)
        norms.append(float(engine.get_global_grad_norm()))
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= WORLD
    ref_losses, ref_norm, ref_w = oracle
    out = {"loss": max(abs(a - b) for a, b in zip(mean.tolist(), ref_losses)), "norm": abs(norms[0] - ref_norm),
           "norm0": norms[0], "weights": 0.0, "experts": []}
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            ref = ref_w[name]
            if subgroup_of(p) is not None:  # this rank's experts: its slice of the oracle's fused tensor
                shard = getattr(engine.module.get_submodule(name.rsplit(".", 1)[0]), ATTR)
                assert p.shape[0] == shard.local == ref.shape[0] // ep, (name, tuple(p.shape))
                ref = ref[shard.first : shard.first + shard.local]
                out["experts"].append(shard.first)
            out["weights"] = max(out["weights"], (p.detach().float() - ref).abs().max().item())
    if case == GENERATE:
        out["generate"] = _generate(rank, engine, ref_w)
    if case in SAVED:
        out.update(_saved(rank, engine, ref_w, f"{save_dir}/{'-'.join(map(str, case))}"))
    engine.destroy()
    return out


def _generate(rank: int, engine, ref_w: dict) -> bool:  # noqa: ANN001
    """Greedy generate of ``rank + 1`` tokens: the ranks done early keep joining the exchanges (synced_gpus) and each
    rank's tokens equal one process's with the oracle's weights."""
    prompt = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(rank))
    engine.module.eval()
    got = engine.module.generate(prompt, max_new_tokens=rank + 1, do_sample=False, pad_token_id=0)
    engine.module.train()
    ref = tiny_moe(GENERATE[0])
    ref.load_state_dict(ref_w)
    ref.eval()
    want = ref.generate(prompt, max_new_tokens=rank + 1, do_sample=False, pad_token_id=0)
    return got.tolist() == want.tolist()


def _saved(rank: int, engine, ref_w: dict, folder: str) -> dict:  # noqa: ANN001
    """save_pretrained writes the model's own fused expert tensors (every EP rank's experts), which from_pretrained
    reads; save_checkpoint now stores each EP rank's experts apart (tests/test_expert_checkpoint.py checks them)."""
    import torch.distributed as dist
    import transformers

    engine.save_pretrained(folder)
    dist.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    diff = max((p.detach().float() - ref_w[n]).abs().max().item() for n, p in loaded.named_parameters())
    try:
        engine.save_checkpoint(f"{folder}-resume")
        refused = "saved"
    except Exception as e:  # noqa: BLE001 - the sentence is the result
        refused = str(e)
    return {"pretrained": diff, "resume": refused}


def _dispatch_cases(rank: int) -> dict:
    """dispatch_combine on crafted routings over one EP group of 4 against the same experts run in one process."""
    import torch.distributed as dist

    from hf_zero.expert.dispatch import dispatch_combine
    from hf_zero.expert.groups import expert_groups

    groups = expert_groups(WORLD)
    experts, local, hidden, k = 8, 2, 5, 2
    gen = torch.Generator().manual_seed(3)
    scale = torch.randn(experts, hidden, generator=gen)  # expert e: x * scale[e] + e
    routings = {
        # rank 0 sends nothing to rank 1 (experts 2, 3); nobody sends to rank 3 (experts 6, 7); expert 5 unused
        "skips": [torch.tensor([[0, 4], [1, 0], [4, 1]]), torch.tensor([[2, 3]]), torch.tensor([[0, 2], [3, 4]]),
                  torch.tensor([[1, 2], [4, 0], [3, 0], [2, 1]])],
        "rank without tokens": [torch.tensor([[6, 7], [0, 6]]), torch.zeros(0, 2, dtype=torch.long),
                                torch.tensor([[7, 1]]), torch.tensor([[3, 5], [5, 2], [1, 0]])],
    }
    out = {}
    for label, routing in routings.items():
        xs = [torch.randn(r.shape[0], hidden, generator=gen) for r in routing]
        ws = [torch.rand(r.shape[0], k, generator=gen) for r in routing]
        # one process: every rank's tokens with all experts
        full = scale.clone().requires_grad_(True)
        ref_x = [x.clone().requires_grad_(True) for x in xs]
        ref_w = [w.clone().requires_grad_(True) for w in ws]
        ref_y = []
        for x, w, r in zip(ref_x, ref_w, routing):
            y = torch.zeros_like(x)
            for j in range(k):
                y = y + (x * full[r[:, j]] + r[:, j, None].float()) * w[:, j, None]
            ref_y.append(y)
        sum((y * (i + 1)).sum() for i, y in enumerate(ref_y)).backward()
        # this rank: its tokens, experts [rank*2, rank*2+2)
        mine = scale[rank * local : (rank + 1) * local].clone().requires_grad_(True)
        x, w = xs[rank].clone().requires_grad_(True), ws[rank].clone().requires_grad_(True)

        def run_local(xr: torch.Tensor, idx: torch.Tensor, wr: torch.Tensor, mine: torch.Tensor = mine) -> torch.Tensor:
            return (xr * mine[idx[:, 0]] + (idx[:, :1] + rank * local).float()) * wr

        y = dispatch_combine(x, routing[rank], w, local_experts=local, group=groups.ep_group, group_size=WORLD,
                             run_local=run_local, weights=[mine])
        (y * (rank + 1)).sum().backward()
        g_mine = mine.grad.clone() if mine.grad is not None else torch.zeros_like(mine)
        dist.all_reduce(g_mine, group=groups.edp_group)  # one rank per group here: a no-op, kept for the shape
        out[label] = {
            "y": (y - ref_y[rank]).abs().max().item() if y.numel() else 0.0,
            "x_grad": (x.grad - ref_x[rank].grad).abs().max().item() if x.numel() else 0.0,
            "w_grad": (w.grad - ref_w[rank].grad).abs().max().item() if w.numel() else 0.0,
            "expert_grad": (g_mine - full.grad[rank * local : (rank + 1) * local]).abs().max().item(),
            "had_grad": mine.grad is not None,
        }
    return out


def _refusals(rank: int) -> dict:
    import hf_zero

    said = {}
    for label, kind, experts, ep in (("world", "mixtral", 8, 3), ("experts", "mixtral", 6, 4)):
        try:
            hf_zero.initialize(model=tiny_moe(kind, experts), config=_config(2, ep, True, False),
                               optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
            said[label] = "accepted"
        except ConfigError as e:
            said[label] = str(e)
    return said


def _zero_init(rank: int) -> dict:
    """A Mixtral built under zero.Init (its experts arrive as per-rank slices of the world) at ZeRO-3, with EP 2 and
    without: the same losses and norms each step (zero.Init draws its initial weights its own way, so the reference
    is the same model trained without expert parallelism)."""
    import hf_zero

    runs = {}
    for ep in (1, 2):
        cfg = _config(3, ep, True, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with hf_zero.zero.Init(config_dict_or_path=cfg):
                model = tiny_moe("mixtral")
            engine = hf_zero.initialize(model=model, config=cfg,
                                        optimizer=lambda g: torch.optim.AdamW(g, lr=LR, eps=EPS))[0]
        ids, seen = _data(), []
        for t in range(STEPS):
            for g in range(GAS):
                batch = _micro(ids, t, rank, g)
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                seen.append(loss.item())
            seen.append(float(engine.get_global_grad_norm()))
        runs[ep] = seen
        engine.destroy()
    return {"diff": max(abs(a - b) for a, b in zip(runs[1], runs[2]))}


def _world4(rank: int, world: int, oracles: dict, save_dir: str) -> dict:
    results = {"cases": {}}
    for case in CASES:
        results["cases"]["/".join(map(str, case))] = _train_case(rank, case, oracles[case[0]], save_dir)
    results["dispatch"] = _dispatch_cases(rank)
    results["refusals"] = _refusals(rank)
    results["zero_init"] = _zero_init(rank)
    return results


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracles = {kind: _oracle(kind) for kind in dict.fromkeys(c[0] for c in CASES)}
    return spawn(_world4, WORLD, oracles, str(tmp_path_factory.mktemp("ep")))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_equals_one_process(world4: list[dict], case: tuple) -> None:
    key = "/".join(map(str, case))
    for rank, res in enumerate(world4):
        r = res["cases"][key]
        assert r["loss"] < TOL, (rank, r)
        assert r["weights"] < TOL, (rank, r)
        assert r["norm"] < TOL * max(1.0, r["norm0"]), (rank, r)
        assert r["norm0"] > CLIP  # clipping acted on the first step
    ep = case[2]
    firsts = [res["cases"][key]["experts"][0] for res in world4]
    assert firsts == [(rank % ep) * (8 // ep) for rank in range(WORLD)]  # EP rank r holds experts [r*E/ep, ...)


@pytest.mark.parametrize("case", sorted(SAVED), ids=lambda c: "-".join(map(str, c)))
def test_save_pretrained_writes_the_fused_experts(world4: list[dict], case: tuple) -> None:
    key = "/".join(map(str, case))
    for res in world4:
        r = res["cases"][key]
        assert r["pretrained"] < TOL, r  # every expert, from every EP rank, where from_pretrained reads it
        assert r["resume"] == "saved", r


def test_generate_keeps_ranks_in_step(world4: list[dict]) -> None:
    assert [res["cases"]["/".join(map(str, GENERATE))]["generate"] for res in world4] == [True] * WORLD


@pytest.mark.parametrize("label", ["skips", "rank without tokens"])
def test_dispatch_uneven_and_empty(world4: list[dict], label: str) -> None:
    for rank, res in enumerate(world4):
        r = res["dispatch"][label]
        assert r["had_grad"], (rank, r)  # even a rank that ran no pair gives its experts a (zero) gradient
        for what in ("y", "x_grad", "w_grad", "expert_grad"):
            assert r[what] < 1e-6, (rank, label, what, r)


def test_zero_init_model(world4: list[dict]) -> None:
    for res in world4:
        assert res["zero_init"]["diff"] < TOL, res["zero_init"]


def test_refusals_name_the_value(world4: list[dict]) -> None:
    for res in world4:
        assert "autoep_size: got 3, which does not divide the world size 4" in res["refusals"]["world"]
        assert "does not divide the 6 experts of 'model.layers.0.mlp.experts'" in res["refusals"]["experts"]


def _load(section: dict) -> ZeroConfig:
    return ZeroConfig.load({"train_micro_batch_size_per_gpu": 1, "expert_parallel": section})


def test_section_reads_deepspeeds_keys() -> None:
    ep = _load({"enabled": True, "autoep_size": 4, "preset_model": "qwen3_moe", "use_grouped_mm": False,
                "top_k": "auto", "expert_tensor_parallel_size": 1, "load_balance_coeff": None}).expert_parallel
    assert (ep.enabled, ep.size, ep.preset_model, ep.use_grouped_mm, ep.top_k, ep.active) == (
        True, 4, "qwen3_moe", False, None, True)
    assert not _load({"enabled": False, "autoep_size": 4}).expert_parallel.active
    assert _load({"enabled": True, "top_k": 2}).expert_parallel.top_k == 2


@pytest.mark.parametrize("section, sentence", [
    ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size: got 2, but splitting each expert"),
    ({"route_norm": True}, "route_norm: got True, but hf_zero routes with the model's own router"),
    ({"load_balance_coeff": 0.001}, "load_balance_coeff: got 0.001, but auxiliary-loss-free load balancing"),
    ({"expert_pattern": "mlp.experts"}, "expert_pattern: got 'mlp.experts', but hf_zero finds the experts"),
    ({"comm_backend": "deepep"}, "comm_backend: got 'deepep', but only the torch.distributed all-to-all"),
    ({"preset_model": "llama"}, "preset_model: got 'llama', expected one of mixtral"),
    ({"autoep_size": 0}, "autoep_size: got 0, expected a positive integer"),
])
def test_refused_in_one_sentence(section: dict, sentence: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load({"enabled": True, **section})
    assert sentence in str(err.value)
    assert str(err.value).count(". ") == 0
