"""Float8 training's other doors, on 2 gloo ranks at ZeRO-3: a model converted with torchao before ``initialize``
(no ``fp8`` section), and ``torch.compile`` of blocks whose float8 linears take the float8-gathered weight.

Oracles: the ``fp8`` section's own run of the same model and data (tests/test_fp8.py checks that one against a
single process). A pre-converted tensorwise model must take the same path, so its losses and weights are equal to
the section's bit for bit, with the float8 all-gather's groups built and used. A compiled run computes the same
float8 casts and matmuls through AOTAutograd's graph, so it matches eager to the fp32 tolerance of tests/test_fp8.py
(1e-5 relative); ``aot_eager`` as in tests/test_compile.py, since inductor's C++ build takes ~40 s a graph on 2 cores
(inductor itself was run by hand, see the commit that added this file).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import spawn
from tests.test_fp8 import EPS, LR, MICRO, STEPS, TOL, _cfg, _data, _model, _take, _whole

pytest.importorskip("torchao.float8")


def _run(rank: int, world: int, cfg: dict, model: torch.nn.Module | None = None) -> dict:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import hf_zero
    from hf_zero.zero.float8_gather import Float8ShardedParamGroup

    torch._dynamo.reset()
    counters.clear()
    engine = hf_zero.initialize(model=model if model is not None else _model(), config=cfg,
                                optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, eps=EPS))[0]
    data, losses = _data(MICRO * world), []
    for t in range(STEPS):
        loss = engine(**_take(data, t, rank * MICRO)).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    f8 = [g for g in engine.zero_optimizer.stage3_groups if isinstance(g, Float8ShardedParamGroup)]
    out = {"losses": losses, "weights": _whole(engine), "layers": len(engine.float8_layers), "groups": len(f8),
           "gathers": sum(g.float8_gathers for g in f8), "graphs": counters["stats"]["unique_graphs"],
           "breaks": sum(counters["graph_break"].values()), "compiled": engine.is_compiled}
    engine.destroy()
    return out


def _converted(recipe: str, **kw: bool) -> torch.nn.Module:
    """The model as a user converts it with torchao before initialize (hf_zero's default filter keeps the head out)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from hf_zero.precision.float8 import float8_filter

    model = _model()
    config = Float8LinearConfig.from_recipe_name(recipe)
    if kw:
        import dataclasses

        config = dataclasses.replace(config, **kw)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(model))
    return model


def _compare(a: dict, b: dict) -> dict:
    return {"loss_err": max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)),
            "w_err": max(float((w - b["weights"][n]).norm() / b["weights"][n].norm()) for n, w in a["weights"].items()),
            "equal": a["losses"] == b["losses"] and all(torch.equal(w, b["weights"][n]) for n, w in a["weights"].items())}


def _strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "weights"}


def _all(rank: int, world: int) -> dict:
    from hf_zero.errors import UsageError

    out: dict = {}
    section = _run(rank, world, _cfg(3, {"enabled": True}))
    pre = _run(rank, world, _cfg(3, None), _converted("tensorwise"))
    out["preconverted"] = {"vs_section": _compare(pre, section), "run": _strip(pre), "section": _strip(section)}
    row = _run(rank, world, _cfg(3, None), _converted("rowwise"))
    row_section = _run(rank, world, _cfg(3, {"enabled": True, "recipe": "rowwise"}))
    out["rowwise"] = {"vs_section": _compare(row, row_section), "run": _strip(row)}
    for name, model, fp8 in (("fsdp_wrapper", _converted("tensorwise", enable_fsdp_float8_all_gather=True), None),
                              ("section_and_converted", _converted("tensorwise"), {"enabled": True})):
        try:
            _run(rank, world, _cfg(3, fp8), model)
            out[name] = "accepted"
        except UsageError as e:
            out[name] = str(e)
    compiled_cfg = _cfg(3, {"enabled": True})
    compiled_cfg["compile"] = {"enabled": True, "backend": "aot_eager"}
    compiled = _run(rank, world, compiled_cfg)
    out["compiled"] = {"vs_eager": _compare(compiled, section), "run": _strip(compiled)}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_all, 2)


def test_preconverted_model_trains_as_the_fp8_section(results: list[dict]) -> None:
    for r in results:
        pre = r["preconverted"]
        # the same path as the section: float8 groups built and gathered, bit-equal losses and weights
        assert pre["vs_section"]["equal"], pre
        assert pre["run"]["layers"] == 14 and pre["run"]["groups"] == 2, pre
        assert pre["run"]["gathers"] == pre["section"]["gathers"] >= 4 * STEPS, pre
        # rowwise: trains in float8 with 16-bit gathers, as the section's rowwise run does
        row = r["rowwise"]
        assert row["vs_section"]["equal"] and row["run"]["layers"] == 14 and row["run"]["groups"] == 0, row


def test_preconverted_model_refusals(results: list[dict]) -> None:
    for r in results:
        assert r["fsdp_wrapper"].startswith("model.layers.0.self_attn.q_proj: its weight is torchao's FSDP2 float8 "
                                            "all-gather wrapper (14 such layers); convert with "
                                            "Float8LinearConfig(enable_fsdp_float8_all_gather=False)"), r["fsdp_wrapper"]
        assert r["section_and_converted"].startswith("fp8.enabled: model.layers.0.self_attn.q_proj (14 layers in all) "
                                                     "is already torchao's Float8Linear; either turn fp8 off"), r["section_and_converted"]


def test_compiled_blocks_take_the_float8_gathered_weight(results: list[dict]) -> None:
    for r in results:
        c = r["compiled"]
        assert c["vs_eager"]["loss_err"] < TOL and c["vs_eager"]["w_err"] < TOL, c
        # the float8 all-gather ran under the compiled blocks as often as in eager: forward and backward per unit
        assert c["run"]["compiled"] and c["run"]["groups"] == 2 and c["run"]["gathers"] >= 4 * STEPS, c
        # one graph for the two blocks of one shape, no break at the per-instance forward that reads the gathered weight
        assert c["run"]["graphs"] == 1 and c["run"]["breaks"] == 0, c
