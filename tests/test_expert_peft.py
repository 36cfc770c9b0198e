"""PEFT's LoRA on the fused experts (``LoraConfig(target_parameters=[...])``) under expert parallelism.

A tiny Mixtral and a tiny Qwen3-MoE (8 experts, top-2, aux loss on) get a LoRA on the attention (``target_modules``)
and on both fused expert tensors (``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``), the router and
every base weight frozen, ``init_lora_weights=False`` so every adapter (``lora_B`` too) is random from the start and
each expert's delta is non-zero at the first forward. They train through ``hf_zero.initialize`` on 4 gloo ranks with
``"expert_parallel": {"autoep_size": 2}`` at ZeRO-2 and ZeRO-3, 3 steps of 2 accumulated micro-batches clipped at 0.1.
The oracle is one process with torch's AdamW on the same PEFT model whose loss is the mean of the four ranks'
micro-batch losses (``tests/test_expert_parallel.py``'s schedule): losses, the first pre-clip norm and every
adapter weight within 1e-5 (fp32).

Each EP rank must hold only its experts' factors, in PEFT's layout for its 4 experts: ``lora_A`` ``(r*E, in)`` read
as ``(E, r, in)`` keeps its experts' rows, ``lora_B`` ``(out, r*E)`` read as ``(out, r, E)`` its experts' strided
columns; the test cuts the oracle's whole adapters the same way and compares. A rank that merged another expert's
factors, or kept a block of ``lora_B``'s columns instead of its strided ones, is off at the first loss.

``engine.save_pretrained`` writes PEFT's own adapter layout, with whole (every expert's) adapter tensors, which
``PeftModel.from_pretrained`` loads on a fresh base model to the oracle's weights. Resume checkpoints: saved after
step 2 and resumed at the same layout (the last loss and the final adapters bit for bit) and at EP 4 (1e-6). A LoRA
on a 2-D per-expert tensor (gpt-oss's ``gate_up_proj_bias``, whose factors PEFT shares between every expert) is
refused in one sentence.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed import spawn
from tests.models import train_one_process
from tests.test_expert_parallel import EPS, GAS, LR, STEPS, WORLD, _config, _data, _micro, tiny_moe

TOL = 1e-5
CLIP = 0.1  # below every case's first pre-clip norm, so clipping acts
RANK = 2  # LoRA rank
EXPERTS = 8
# (model, ZeRO stage, autoep_size); the resume checkpoints are taken of RESUMED
CASES = [("mixtral", 2, 2), ("mixtral", 3, 2), ("qwen3_moe", 3, 2), ("qwen3_moe", 2, 4)]
RESUMED = ("mixtral", 3, 2)
SAVED = {("mixtral", 2, 2), ("qwen3_moe", 3, 2)}
EMPTY = ("mixtral", 2, 2)  # then a routing that leaves a rank without pairs


def lora_model(kind: str) -> torch.nn.Module:
    """``kind``'s tiny MoE with a LoRA on its attention and on both fused expert tensors (every factor random)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_moe(kind), LoraConfig(
        r=RANK, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]))


def _steps(kind: str) -> list[list[dict]]:
    ids = _data()
    return [[{"input_ids": _micro(ids, t, r, g), "labels": _micro(ids, t, r, g)} for r in range(WORLD)
             for g in range(GAS)] for t in range(STEPS)]


def _oracle(kind: str) -> dict:
    """One process: each step's loss the mean of the 4 ranks' x 2 micro-batches' losses; the first pre-clip norm."""
    first = lora_model(kind)
    steps = _steps(kind)
    for b in steps[0]:
        (first(**b).loss / len(steps[0])).backward()
    norm = float(torch.nn.utils.clip_grad_norm_([p for p in first.parameters() if p.requires_grad], float("inf")))
    losses, weights = train_one_process(lora_model(kind), steps, lr=LR, eps=EPS, clip=CLIP)
    return {"losses": losses, "norm": norm, "weights": {n: w for n, w in weights.items() if "lora_" in n}}


def own_block(name: str, whole: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    """EP rank ``ep_rank``'s experts' factors of the whole adapter ``whole`` of one expert tensor, in PEFT's layout
    for ``EXPERTS / ep`` experts (the module docstring); ``whole`` itself for any other adapter."""
    if ".experts." not in name:
        return whole
    local = EXPERTS // ep
    lo = ep_rank * local
    if ".lora_A." in name:  # (r*E, in) as (E, r, in): the experts' rows
        return whole.view(EXPERTS, RANK, -1)[lo : lo + local].reshape(local * RANK, -1)
    return whole.view(whole.shape[0], RANK, EXPERTS)[:, :, lo : lo + local].reshape(whole.shape[0], -1)


def _engine(kind: str, stage: int, ep: int):  # noqa: ANN202
    import hf_zero

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = {**_config(stage, ep, True, False), "gradient_clipping": CLIP}
        return hf_zero.initialize(model=lora_model(kind), config=config,
                                  optimizer=lambda g: torch.optim.AdamW(g, lr=LR, eps=EPS))[0]


def _train(engine, rank: int, steps: range, norms: list | None = None) -> list[float]:  # noqa: ANN001
    """Steps ``steps``: each step's loss averaged over every rank's micro-batches (and into ``norms`` the pre-clip
    gradient norms)."""
    import torch.distributed as dist

    ids, out = _data(), []
    for t in steps:
        total = torch.zeros((), dtype=torch.float64)
        for g in range(GAS):
            batch = _micro(ids, t, rank, g)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        dist.all_reduce(total)
        out.append(total.item() / (WORLD * GAS))
        if norms is not None:
            norms.append(float(engine.get_global_grad_norm()))
    return out


def _held(engine, part: str = "lora_") -> dict[str, torch.Tensor]:  # noqa: ANN001
    """This rank's tensors whose names hold ``part`` as it holds them (of the experts' adapters, its experts' only)."""
    import hf_zero

    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if part in n}


def _against(held: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rank: int, ep: int) -> float:
    assert held.keys() == want.keys(), sorted(set(held) ^ set(want))[:3]
    diff = 0.0
    for n, w in want.items():
        mine = own_block(n, w, rank % ep, ep)
        assert held[n].shape == mine.shape, (n, tuple(held[n].shape), tuple(mine.shape))
        diff = max(diff, (held[n] - mine).abs().max().item())
    return diff


def _case(rank: int, case: tuple, oracle: dict, root: str) -> dict:
    import torch.distributed as dist

    kind, stage, ep = case
    engine = _engine(kind, stage, ep)
    router = _held(engine, ".mlp.gate.weight")
    frozen = [n for n, p in engine.module.named_parameters() if p.requires_grad and "lora_" not in n]
    save_at = STEPS - 1 if case == RESUMED else STEPS
    norms: list[float] = []
    losses = _train(engine, rank, range(save_at), norms)
    folder = f"{root}/{'-'.join(map(str, case))}"
    if case == RESUMED:
        engine.save_checkpoint(f"{folder}/resume")
        losses += _train(engine, rank, range(save_at, STEPS))
    out = {"loss": max(abs(a - b) for a, b in zip(losses, oracle["losses"])), "frozen_trainable": frozen,
           "adapters": _against(_held(engine), oracle["weights"], rank, ep),
           "router_moved": any(not torch.equal(p, router[n]) for n, p in _held(engine, ".mlp.gate.weight").items()), "norm0": norms[0], "norm": abs(norms[0] - oracle["norm"])}
    if case in SAVED:
        engine.save_pretrained(f"{folder}/adapters")
        dist.barrier()
        out["saved"] = _loaded(kind, f"{folder}/adapters", oracle["weights"]) if rank == 0 else None
    final = _held(engine)
    engine.destroy()
    if case == RESUMED:
        out["resume"] = _resume(rank, case, f"{folder}/resume", losses[-1], final, oracle["weights"])
    if case == EMPTY:
        out["empty"] = _rank_without_pairs(engine.module)
    return out


def _rank_without_pairs(model: torch.nn.Module) -> bool:
    """One MoE layer's LoRA-wrapped experts (the engine gone, the split kept) on a routing that sends every pair to
    experts 0-3, so EP rank 1 of each group receives nothing: its adapters' factors still get a (zero) gradient, as
    its experts would, so ZeRO's buckets fill alike on every rank."""
    experts = model.get_submodule("base_model.model.model.layers.0.mlp.experts")
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 32, generator=gen), torch.rand(3, 2, generator=gen)
    lora = [p for n, p in experts.named_parameters() if "lora_" in n]
    for p in lora:
        p.grad = None
    experts(x, torch.tensor([[0, 1], [2, 3], [1, 2]]), w).sum().backward()
    return len(lora) == 4 and all(p.grad is not None for p in lora)


def _loaded(kind: str, folder: str, want: dict[str, torch.Tensor]) -> dict:
    """PeftModel.from_pretrained of the saved folder on a fresh base: its adapters against the oracle's whole ones;
    the file's names and shapes against what PEFT's own save_pretrained writes."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model = PeftModel.from_pretrained(tiny_moe(kind), folder)
    got = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    ref_dir = f"{folder}-peft"
    lora_model(kind).save_pretrained(ref_dir)
    theirs = {k: tuple(v.shape) for k, v in load_file(f"{ref_dir}/adapter_model.safetensors").items()}
    ours = {k: tuple(v.shape) for k, v in load_file(f"{folder}/adapter_model.safetensors").items()}
    return {"diff": max((got[n] - w).abs().max().item() for n, w in want.items()), "same_names": got.keys() == want.keys(),
            "layout": ours == theirs, "experts_whole": any(".experts." in k and EXPERTS * RANK in s for k, s in ours.items())}


def _resume(rank: int, case: tuple, folder: str, last: float, final: dict[str, torch.Tensor],
            want: dict[str, torch.Tensor]) -> dict:
    """The checkpoint of step 2 resumed for the last step at the same layout (the uninterrupted run's last loss and
    adapters bit for bit) and at EP 4 (each rank's adapters re-cut from the EP 2 blocks: the oracle's, 1e-5)."""
    kind, stage, ep = case
    out = {}
    for label, e in (("same", ep), ("ep4", 4)):
        engine = _engine(kind, stage, e)
        engine.load_checkpoint(folder)
        loss = _train(engine, rank, range(STEPS - 1, STEPS))[0]
        held = _held(engine)
        engine.destroy()
        diff = (max((held[n] - final[n]).abs().max().item() for n in final) if e == ep
                else _against(held, want, rank, e))
        out[label] = {"loss": abs(loss - last), "adapters": diff}
    return out


def _refused(rank: int) -> str:
    from peft import LoraConfig, get_peft_model

    import hf_zero

    model = get_peft_model(tiny_moe("gpt_oss"), LoraConfig(r=RANK, target_parameters=["experts.gate_up_proj_bias"]))
    try:
        hf_zero.initialize(model=model, config=_config(2, 2, True, False),
                           optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
        return "accepted"
    except Exception as e:  # noqa: BLE001 - the sentence is the result
        return f"{type(e).__name__}: {e}"


def _world4(rank: int, world: int, oracles: dict, root: str) -> dict:
    out = {"/".join(map(str, c)): _case(rank, c, oracles[c[0]], root) for c in CASES}
    out["refused"] = _refused(rank)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracles = {k: _oracle(k) for k in dict.fromkeys(c[0] for c in CASES)}
    return spawn(_world4, WORLD, oracles, str(tmp_path_factory.mktemp("eplora")))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_equals_one_process(world4: list[dict], case: tuple) -> None:
    print(case, "largest differences from one process:",
          {k: max(res["/".join(map(str, case))][k] for res in world4) for k in ("loss", "norm", "adapters")})
    for rank, res in enumerate(world4):
        r = res["/".join(map(str, case))]
        assert r["loss"] < TOL and r["adapters"] < TOL, (rank, r)  # each rank's own experts' factors, and the rest
        assert r["norm"] < TOL * max(1.0, r["norm0"]), (rank, r)
        assert r["frozen_trainable"] == [] and not r["router_moved"], (rank, r)  # only the adapters train
        assert r["norm0"] > CLIP  # clipping acted on the first step


@pytest.mark.parametrize("case", sorted(SAVED), ids=lambda c: "-".join(map(str, c)))
def test_save_pretrained_writes_peft_layout(world4: list[dict], case: tuple) -> None:
    saved = world4[0]["/".join(map(str, case))]["saved"]
    assert saved["layout"] and saved["experts_whole"] and saved["same_names"], saved  # PEFT's names, every expert
    assert saved["diff"] < TOL, saved  # PeftModel.from_pretrained gives the oracle's adapters


def test_resume_checkpoint(world4: list[dict]) -> None:
    for rank, res in enumerate(world4):
        r = res["/".join(map(str, RESUMED))]["resume"]
        assert r["same"] == {"loss": 0.0, "adapters": 0.0}, (rank, r)
        assert r["ep4"]["loss"] < 1e-6 and r["ep4"]["adapters"] < TOL, (rank, r)


def test_rank_without_pairs_gives_its_adapters_a_gradient(world4: list[dict]) -> None:
    assert [res["/".join(map(str, EMPTY))]["empty"] for res in world4] == [True] * WORLD


def test_lora_shared_by_every_expert_is_refused(world4: list[dict]) -> None:
    for res in world4:
        said = res["refused"]
        assert said.startswith("UsageError: expert_parallel: the LoRA of 'base_model.model.model.layers.0.mlp.experts' "
                               "on 'gate_up_proj_bias'"), said
        assert "target_parameters" in said and said.count(". ") == 0, said
