"""Resume checkpoints with expert parallelism: saved per EP rank with each block's global expert range, loaded at
the same layout (bit for bit), at another EP degree (EP 2 -> EP 4 and back, 4 ranks) and at another world size
(4 ranks EP 2 -> 2 ranks EP 2, and -> 2 ranks without EP), and consolidated offline into the model's fused tensors.

The oracle is the uninterrupted run: 4 gloo ranks, EP 2, a tiny Mixtral (8 experts, top-2, aux loss on) trained
``STEPS`` steps of accumulated micro-batches, clipped, saving after step ``SAVE_AT``. Every resumed run continues
from that checkpoint over the same micro-batches (2 ranks take twice the accumulation, so a step still averages the
same 8 micro-batch losses) and must give the uninterrupted run's later losses and final whole weights: exactly at the
same layout (with the optimizer state equal as loaded), within 1e-6 elsewhere (fp32; only summation orders differ).
A load that put one EP rank's experts where another's belong, or dropped the Adam moments of a block, is off by far
more than that after one step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed import spawn
from tests.test_expert_parallel import VOCAB, tiny_moe

SEQ, MICRO, LR, EPS, CLIP = 8, 2, 5e-3, 1e-8, 0.3
STEPS, SAVE_AT, MICROS = 4, 2, 8  # MICROS: micro-batches per step over all ranks
TOL = 1e-6
# ZeRO stage, and "f": the experts frozen (stored whole per EP rank by the first of its expert-data-parallel ranks)
STAGES = ("0", "2", "3", "2f")


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, MICROS * MICRO, SEQ), generator=torch.Generator().manual_seed(1))


def _config(stage: int, ep: int, world: int) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICROS // world,
                 "gradient_clipping": CLIP, "steps_per_print": 10_000,
                 "zero_optimization": {"stage": stage, "reduce_bucket_size": 700,
                                       "stage3_param_persistence_threshold": 0}}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def _engine(variant: str, ep: int, world: int):  # noqa: ANN202
    import hf_zero

    model = tiny_moe("mixtral")
    if variant.endswith("f"):
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_zero.initialize(model=model, config=_config(int(variant[0]), ep, world),
                                  optimizer=lambda g: torch.optim.AdamW(g, lr=LR, eps=EPS))[0]


def _train(engine, rank: int, world: int, steps: range) -> list[float]:  # noqa: ANN001
    """Steps ``steps`` (0-based) over this rank's micro-batches; each step's loss averaged over every micro-batch."""
    import torch.distributed as dist

    ids, gas = _data(), MICROS // world
    out = []
    for t in steps:
        total = torch.zeros((), dtype=torch.float64)
        for g in range(gas):
            lo = (rank * gas + g) * MICRO
            batch = ids[t, lo : lo + MICRO]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        dist.all_reduce(total)
        out.append(total.item() / MICROS)
    return out


def _whole(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every weight whole (an EP rank's experts gathered from its EP group into the fused tensor)."""
    import hf_zero
    from hf_zero.expert.slices import gather_whole, slice_of

    out = {}
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            s = slice_of(p)
            out[n] = (gather_whole(p, s) if s is not None else p.detach()).float().clone()
    return out


def _opt_state(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Torch's optimizer state of this rank's masters, by master position and state key."""
    opt = engine.train_state().optimizer.optimizer  # torch's (at stage 0 engine.optimizer is torch's itself)
    masters = [m for pg in opt.param_groups for m in pg["params"]]
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(masters) for k, v in opt.state.get(m, {}).items()
            if torch.is_tensor(v)}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:3]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _resume(rank: int, world: int, stage: str, ep: int, folder: str, steps: range) -> tuple:
    engine = _engine(stage, ep, world)
    engine.load_checkpoint(folder)
    assert engine.global_steps == steps.start, engine.global_steps
    return engine, _train(engine, rank, world, steps)


def _world4(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    for stage in STAGES:
        ck = f"{root}/s{stage}"
        # the uninterrupted run, saving after SAVE_AT steps
        engine = _engine(stage, 2, world)
        losses = _train(engine, rank, world, range(SAVE_AT))
        engine.save_checkpoint(f"{ck}/ep2")
        at_save, state_at_save = _whole(engine), _opt_state(engine)
        losses += _train(engine, rank, world, range(SAVE_AT, STEPS))
        final = _whole(engine)
        engine.destroy()
        r: dict = {"losses": losses, "final": {k: v.tolist() for k, v in final.items()},
                   "at_save": {k: v.tolist() for k, v in at_save.items()}}
        # the same layout: weights and optimizer state as saved, then the same losses and weights bit for bit
        engine = _engine(stage, 2, world)
        engine.load_checkpoint(f"{ck}/ep2")
        loaded = _opt_state(engine)
        r["same_state"] = sorted(k for k in loaded.keys() | state_at_save.keys()
                                 if k not in loaded or k not in state_at_save
                                 or not torch.equal(loaded[k].float(), state_at_save[k].float()))
        r["same_weights_loaded"] = _diff(_whole(engine), at_save)
        r["same_losses"] = _train(engine, rank, world, range(SAVE_AT, STEPS))
        r["same_final"] = _diff(_whole(engine), final)
        engine.destroy()
        # EP 2 -> EP 4, saving after one more step; then EP 4 -> EP 2 for the last
        engine, r["ep4_losses"] = _resume(rank, world, stage, 4, f"{ck}/ep2", range(SAVE_AT, SAVE_AT + 1))
        engine.save_checkpoint(f"{ck}/ep4")
        engine.destroy()
        engine, back = _resume(rank, world, stage, 2, f"{ck}/ep4", range(SAVE_AT + 1, STEPS))
        r["ep4_losses"] += back
        r["ep4_final"] = _diff(_whole(engine), final)
        engine.destroy()
        out[stage] = r
    return out


def _world2(rank: int, world: int, root: str, reference: dict) -> dict:
    out: dict = {}
    for stage in STAGES:
        final = {k: torch.tensor(v) for k, v in reference[stage]["final"].items()}
        r = {}
        for label, ep in (("ep2", 2), ("no_ep", 1)):
            engine, losses = _resume(rank, world, stage, ep, f"{root}/s{stage}/ep2", range(SAVE_AT, STEPS))
            r[label] = {"losses": losses, "final": _diff(_whole(engine), final)}
            engine.destroy()
        out[stage] = r
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict], list[dict]]:
    root = str(tmp_path_factory.mktemp("epck"))
    four = spawn(_world4, 4, root)
    two = spawn(_world2, 2, root, four[0])
    return root, four, two


@pytest.mark.parametrize("stage", STAGES)
def test_same_layout_bit_for_bit(runs: tuple, stage: str) -> None:
    _, four, _ = runs
    for rank, res in enumerate(four):
        r = res[stage]
        assert r["same_state"] == [], rank  # every Adam moment of every block, and the step counts, as saved
        assert r["same_weights_loaded"] == 0.0, (rank, r["same_weights_loaded"])
        assert r["same_losses"] == r["losses"][SAVE_AT:], (rank, r["same_losses"], r["losses"])
        assert r["same_final"] == 0.0, (rank, r["same_final"])


@pytest.mark.parametrize("stage", STAGES)
def test_other_ep_degree_and_back(runs: tuple, stage: str) -> None:
    _, four, _ = runs
    for rank, res in enumerate(four):
        r = res[stage]
        assert max(abs(a - b) for a, b in zip(r["ep4_losses"], r["losses"][SAVE_AT:])) < TOL, (rank, r["ep4_losses"])
        assert len(r["ep4_losses"]) == STEPS - SAVE_AT
        assert r["ep4_final"] < TOL, (rank, r["ep4_final"])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("label", ["ep2", "no_ep"])
def test_other_world_size(runs: tuple, stage: int, label: str) -> None:
    _, four, two = runs
    want = four[0][stage]["losses"][SAVE_AT:]
    for rank, res in enumerate(two):
        r = res[stage][label]
        assert max(abs(a - b) for a, b in zip(r["losses"], want)) < TOL, (rank, r["losses"], want)
        assert r["final"] < TOL, (rank, r["final"])


@pytest.mark.parametrize("stage", STAGES)
def test_consolidate_writes_fused_experts(runs: tuple, stage: str) -> None:
    """``zero_to_fp32`` of an EP checkpoint: the model's own names and fused expert tensors, every expert."""
    from hf_zero.checkpoint.consolidated import read_state_dict
    from hf_zero.checkpoint.format import read_meta, resolve_tag

    root, four, _ = runs
    got = read_state_dict(f"{root}/s{stage}/ep2")
    want = {k: torch.tensor(v) for k, v in four[0][stage]["at_save"].items()}
    assert set(got) >= set(want)
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8
    assert _diff({k: got[k] for k in want}, want) == 0.0
    table = read_meta(resolve_tag(f"{root}/s{stage}/ep2", None))["params"]
    assert table["model.layers.1.mlp.experts.down_proj@ep1of2"]["ep"]["experts"] == [4, 8]
