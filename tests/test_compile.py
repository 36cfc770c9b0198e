"""``torch.compile`` of the blocks (``engine.compile()`` / the config's ``compile`` section) at stages 0-3,
alone and under ``checkpoint_blocks``, on 2 processes: losses and weights equal the eager engine's.

CI has no GPU and inductor's C++ build takes ~40 s per graph on 2 cores, so these runs use the
``aot_eager`` backend: dynamo's capture and AOTAutograd's joint graph run for real (the parts that
meet the ZeRO hooks), without inductor's code generation. tests/gpu/gpu_check.py runs inductor.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import spawn

# (stage, checkpoint_blocks, how the compiled run asks for it: engine.compile() or the config's section)
CASES = [(0, False, "method"), (2, False, "config"), (3, False, "method"), (3, True, "config")]


def _train(rank: int, world: int, how: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    out = {}
    for stage, ckpt, asked in CASES:
        how_here = asked if how == "compiled" else how
        torch._dynamo.reset()  # each case compiles afresh, so its graph count is its own
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40},
               "activation_checkpointing": {"checkpoint_blocks": ckpt}}
        if how_here == "config":
            cfg["compile"] = {"enabled": True, "backend": "aot_eager"}
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        if how_here == "method":
            engine.compile(backend="aot_eager")
        elif how_here == "inductor":  # tests/gpu/gpu_check.py
            engine.compile()
        # 4 rows a rank at any world size (tests/gpu/gpu_check.py runs it at 1 to N ranks)
        ids = torch.randint(0, 64, (4 * world, 12), generator=torch.Generator().manual_seed(3))[rank * 4:(rank + 1) * 4]
        losses = []
        for step in range(3):
            batch = ids[2 * (step % 2): 2 * (step % 2) + 2]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = {}
        with hf_zero.zero.GatheredParameters(list(model.parameters())):
            for n, p in model.named_parameters():
                weights[n] = p.detach().float().reshape(-1).tolist()
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        counters.clear()
        out[f"{stage}-{ckpt}"] = {"losses": losses, "weights": weights, "compiled": engine.is_compiled, "graphs": graphs}
    return out


def test_compiled_blocks_train_like_eager() -> None:
    eager = spawn(_train, 2, "eager")[0]
    compiled = spawn(_train, 2, "compiled")[0]
    for case in eager:
        e, c = eager[case], compiled[case]
        assert c["compiled"] and not e["compiled"], case
        # the 3 blocks share one graph (no per-layer recompiles: the training KV cache is off), and
        # nothing else was captured: the ZeRO hooks stay outside
        assert c["graphs"] == 1 and e["graphs"] == 0, (case, c["graphs"], e["graphs"])
        for a, b in zip(c["losses"], e["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (case, c["losses"], e["losses"])
        for n, w in e["weights"].items():
            a, b = torch.tensor(c["weights"][n]), torch.tensor(w)
            assert float((a - b).norm()) <= 1e-5 * float(b.norm()), (case, n)


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "compile.enabled: got 'yes'"),
    ({"enabled": True, "backend": "tvm-nope"}, "compile.backend: got 'tvm-nope', expected one of"),
    ({"enabled": True, "kwargs": {"mode": "fastest"}}, "compile.kwargs.mode: got 'fastest', expected one of default"),
    ({"enabled": True, "kwargs": {"fullgraph": 1}}, "compile.kwargs.fullgraph: got 1"),
    ({"enabled": True, "kwargs": {"backend": "eager"}}, "compile.kwargs.backend: not an argument of torch.compile here"),
    ({"enabled": True, "kwargs": {"mode": "max-autotune", "options": {}}}, "takes mode or options, not both"),
    ({"deepcompile": True}, "DeepSpeed's DeepCompile is not supported"),
    ({"enabled": True, "kwargs": [1]}, "compile.kwargs: got [1], expected an object"),
])
def test_bad_compile_sections_are_one_sentence(section: dict, message: str) -> None:
    from hf_zero.config import ConfigError, ZeroConfig

    with pytest.raises(ConfigError) as info:
        ZeroConfig.load({"train_micro_batch_size_per_gpu": 1, "compile": section})
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_compile_section_is_parsed() -> None:
    from hf_zero.config import ZeroConfig

    cfg = ZeroConfig.load({"train_micro_batch_size_per_gpu": 1,
                           "compile": {"enabled": True, "backend": "aot_eager", "kwargs": {"dynamic": False}}})
    assert (cfg.compile.enabled, cfg.compile.backend, cfg.compile.kwargs) == (True, "aot_eager", {"dynamic": False})
    assert not ZeroConfig.load({"train_micro_batch_size_per_gpu": 1}).compile.enabled
