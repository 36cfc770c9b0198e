"""A stage-3 parameter read between gathers raises one sentence naming it, on every rank, instead of ending the process.

Before ``hf_zero/zero/released.py`` an element-wise op on such a parameter (``p.sum()``, ``p.norm()``,
``p.detach().clone()``) read through a null pointer on the CPU and the rank died with SIGSEGV; ``print(p)`` raised
PyTorch's storage error. The model is transformers' GPT-2 (tied embedding and LM head) from a config, trained one
step at ZeRO-3 on 2 gloo ranks; then each read is tried, metadata and no-op conversions are checked to still work, a
view taken between gathers is checked to read the right values once gathered, and training goes on to the same loss
as an engine nobody probed.
"""

from __future__ import annotations

from tests.distributed import spawn


def _engine():  # noqa: ANN202
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zero

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return hf_zero.initialize(model=model, config=cfg)[0]


def _steps(engine, rank: int, n: int, start: int = 0) -> list[float]:  # noqa: ANN001
    """Steps ``start`` to ``start + n`` of the rank's batches."""
    import torch

    losses = []
    for i in range(start, start + n):
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1000 * rank + i))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _reads(rank: int, world: int, path: str) -> dict:
    import torch

    from hf_zero.errors import ReleasedParameterError
    from hf_zero.zero import GatheredParameters
    from hf_zero.zero.released import ShardedParameter

    engine = _engine()
    model = engine.module
    first = _steps(engine, rank, 1)
    w = model.transformer.h[0].mlp.c_fc.weight
    out: dict = {"class": type(w).__name__, "is_parameter": isinstance(w, torch.nn.Parameter),
                 "shape": list(w.shape), "numel": w.numel(), "dtype": str(w.dtype), "ds_shape": list(w.ds_shape),
                 "storage": w.untyped_storage().nbytes()}
    view = w.data  # taken between gathers: refused now, read once the parameter is whole again
    reads = {
        "sum": lambda: w.sum(),
        "norm": lambda: w.norm(),
        "clone": lambda: w.detach().clone(),
        "repr": lambda: repr(w),
        "data_norm": lambda: view.norm(),
        "linear": lambda: torch.nn.functional.linear(torch.ones(1, 32), w.t()),
        "transpose_property": lambda: w.T,  # a view PyTorch cannot make of empty storage: our sentence, not its
        "cast": lambda: w.to(torch.float16),  # a conversion that is not a no-op reads the values
        "save_state_dict": lambda: torch.save(model.state_dict(), path),
    }
    errors = {}
    for name, read in reads.items():
        try:
            read()
            errors[name] = None
        except ReleasedParameterError as e:
            errors[name] = str(e)
    out["errors"] = errors
    model.to(w.device)  # what Accelerate and scripts call: a no-op conversion reads nothing
    model.float()
    out["after_noop_class"] = type(w).__name__
    seen = []
    hook = model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda m, a: seen.append(type(m.weight)))
    with GatheredParameters([w]):
        out["gathered_class"] = type(w).__name__
        out["gathered_sum"] = float(w.sum())
        out["view_sum"] = float(view.sum())
    out["released_again"] = type(w) is ShardedParameter
    out["losses"] = first + _steps(engine, rank, 2, start=1)
    hook.remove()
    out["forward_classes"] = sorted({c.__name__ for c in seen})  # nothing but plain Parameters on the hot path
    reference = _engine()
    out["reference_losses"] = _steps(reference, rank, 3)
    return out


def problems(r: dict) -> list[str]:
    """What is wrong in one rank's result of :func:`_reads` (also run with NCCL by ``tests/gpu/gpu_check.py``)."""
    out = []
    if not (r["class"] == "ShardedParameter" and r["is_parameter"]):
        out.append(f"released class {r['class']}")
    if not (r["shape"] == r["ds_shape"] == [32, 128] and r["numel"] == 32 * 128 and r["storage"] == 0):
        out.append(f"metadata {r['shape']} {r['ds_shape']} {r['numel']} {r['storage']}")
    for name, error in r["errors"].items():
        named = "'transformer.wte.weight'" if name == "save_state_dict" else "'transformer.h.0.mlp.c_fc.weight'"
        if error is None or not (error.startswith("ZeRO stage 3") and named in error and "GatheredParameters" in error):
            out.append(f"{name}: {error}")
    if "a view of parameter" not in (r["errors"]["data_norm"] or ""):
        out.append("the .data view is not named as a view")
    if r["after_noop_class"] != "ShardedParameter" or r["gathered_class"] != "Parameter" or not r["released_again"]:
        out.append(f"classes {r['after_noop_class']} {r['gathered_class']} {r['released_again']}")
    if r["view_sum"] != r["gathered_sum"]:
        out.append(f"view {r['view_sum']} != gathered {r['gathered_sum']}")
    if r["forward_classes"] != ["Parameter"]:
        out.append(f"forward saw {r['forward_classes']}")
    if r["losses"] != r["reference_losses"]:
        out.append(f"losses {r['losses']} != {r['reference_losses']}")
    return out


def test_reads_between_gathers_raise_a_sentence_on_every_rank_and_training_goes_on(tmp_path) -> None:  # noqa: ANN001
    results = spawn(_reads, 2, str(tmp_path / "sd.pt"))
    assert len(results) == 2
    for r in results:
        assert not problems(r), problems(r)
    assert results[0]["losses"] != results[1]["losses"]  # each rank's own batches: the loss is the rank's
