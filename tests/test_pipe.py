"""Pipeline parity: a split model trains exactly as the unsplit one (CPU, gloo).

The oracle is one process training the whole transformers model on the concatenated global
batch with the same optimizer; the pipeline (2 or 4 stages, times data parallel 1 or 2, 1F1B or
GPipe, 4 or 8 micro-batches, ZeRO 0-2) must give the same losses and weights (fp32, rel. 1e-5),
weight by weight under the model's own parameter names. One spawn per world size runs a grid.
"""

from __future__ import annotations

import torch

from tests.distributed import spawn

STEPS = 3
MB = 2  # sequences per micro-batch
SEQ = 6
LR = 1e-2


def _llama(layers: int = 4, tie: bool = False):  # noqa: ANN202 - a transformers model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def _gpt2():  # noqa: ANN202
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_embd=16, n_layer=3, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


MODELS = {"llama": _llama, "llama2": lambda: _llama(layers=2), "gpt2": _gpt2}


def _data(global_batch: int, vocab: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (STEPS, global_batch, SEQ), generator=g)


def _optimizer(name: str):  # noqa: ANN202 - a callable building a torch optimizer
    # GPT-2's key bias has a gradient of exactly zero up to rounding (softmax ignores a shift of
    # every key), and Adam would turn that rounding noise into full-size steps: SGD keeps it noise.
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=LR)


def _oracle(model_name: str, global_batch: int, clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = MODELS[model_name]()
    opt = _optimizer("sgd" if model_name == "gpt2" else "adamw")(model.parameters())
    ids = _data(global_batch)
    losses = []
    for t in range(STEPS):
        loss = model(input_ids=ids[t], labels=ids[t]).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm().clamp_min(1e-12))


def _train(rank: int, world: int, case: dict, save_dir: str | None = None) -> dict:
    import hf_zero
    from hf_zero.pipe import split_causal_lm

    stages, m = case["stages"], case["micro"]
    dp = world // stages
    pipe = split_causal_lm(MODELS[case["model"]](), stages, activation_checkpoint_interval=case.get("ckpt", 0))
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": m,
        "gradient_clipping": case.get("clip", 0.0),
        "zero_optimization": {"stage": case.get("zero", 0), "reduce_bucket_size": 200,
                              **({"offload_optimizer": {"device": "cpu"}} if case.get("offload") else {})},
        "pipeline": {"schedule": case.get("schedule", "1f1b")},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = hf_zero.initialize(model=pipe, optimizer=_optimizer("sgd" if case["model"] == "gpt2" else "adamw"),
                                         config=cfg)
    gb = MB * m * dp
    ids = _data(gb)
    d = pipe.dp_rank
    losses = []
    for t in range(STEPS):
        micro = [(ids[t, (d * m + i) * MB:(d * m + i + 1) * MB],) * 2 for i in range(m)]
        losses.append(float(engine.train_batch(iter(micro))))
    ref_losses, ref_w = _oracle(case["model"], gb, case.get("clip", 0.0))
    out = {"case": case, "stage": pipe.stage_id,
           "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
           "w_err": max(_rel(p.detach(), ref_w[n]) for n, p in engine.module.named_parameters()),
           "names": sorted(n for n, _ in engine.module.named_parameters())}
    if case.get("offload"):  # the masters really live apart from the parameters, in the offload groups
        from hf_zero.zero.offload import OffloadedFlatGroup

        groups = engine.zero_optimizer.groups
        assert groups and all(isinstance(g, OffloadedFlatGroup) and g._host_grad is not None for g in groups), groups
    if case.get("eval"):
        ev = float(engine.eval_batch(iter([(ids[0, :MB],) * 2] * m)))
        ref = MODELS[case["model"]]()
        ref.load_state_dict(ref_w, strict=False)
        with torch.no_grad():
            out["eval_err"] = abs(ev - ref(input_ids=ids[0, :MB], labels=ids[0, :MB]).loss.item())
    if save_dir is not None:
        engine.save_pretrained(save_dir)
        if rank == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(save_dir)
            out["save_err"] = max(_rel(p.detach(), ref_w[n]) for n, p in loaded.named_parameters())
            out["save_names"] = len(dict(loaded.named_parameters()))
    return out


def _grid(rank: int, world: int, cases: list[dict], save_dir: str | None) -> list[dict]:
    results = [_train(rank, world, c) for c in cases]
    if save_dir is not None:
        results.append(_train(rank, world, {"model": "llama", "stages": 2, "micro": 4}, save_dir))
        results.append({"errors": _errors(rank, world)})
    return results


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for r in per_rank:
            assert r["loss_err"] < 1e-5, r
            assert r["w_err"] < 1e-5, r
            if "eval_err" in r:
                assert r["eval_err"] < 1e-5, r


def test_two_stages_1f1b_gpipe_zero_tied_checkpointing_save_and_errors(tmp_path) -> None:  # noqa: ANN001
    """World 2: Llama in 2 stages (1F1B with clipping and eval_batch, GPipe with 8 micro-batches,
    per-layer activation checkpointing), GPT-2 with its tied embedding/head, the consolidated
    save loaded with from_pretrained, and the error sentences."""
    cases = [
        {"model": "llama", "stages": 2, "micro": 4, "schedule": "1f1b", "clip": 0.05, "eval": True},
        {"model": "llama", "stages": 2, "micro": 8, "schedule": "gpipe"},
        {"model": "llama", "stages": 2, "micro": 4, "schedule": "1f1b", "ckpt": 1},
        {"model": "gpt2", "stages": 2, "micro": 4, "schedule": "1f1b", "clip": 0.05},
        {"model": "llama", "stages": 2, "micro": 4, "schedule": "1f1b", "zero": 1, "offload": True, "clip": 0.05},
    ]
    results = spawn(_grid, 2, cases, str(tmp_path / "consolidated"))
    errors = [per_rank.pop()["errors"] for per_rank in results]
    _check(results)
    gpt2 = [per_rank[3] for per_rank in results]
    # the tied embedding lives on both stages, under its model name, and stays equal to the oracle's
    assert all("transformer.wte.weight" in r["names"] for r in gpt2)
    for msgs in errors:
        _check_errors(msgs)
    save = results[0][-1]
    assert save["save_err"] < 1e-6 and save["save_names"] == len(dict(_llama().named_parameters())), save
    assert "model.layers.0.self_attn.q_proj.weight" in results[0][0]["names"]
    assert "lm_head.weight" in results[1][0]["names"]


def test_four_ranks_four_stages_and_two_by_two_with_zero() -> None:
    """World 4: 4 stages x 1 replica, and 2 stages x 2 replicas with ZeRO 0, 1 and 2 (GPT-2 tied under ZeRO-2, also
    with the optimizer offloaded)."""
    cases = [
        {"model": "llama", "stages": 4, "micro": 4, "schedule": "1f1b"},
        {"model": "llama", "stages": 4, "micro": 8, "schedule": "gpipe", "clip": 0.05},
        {"model": "llama", "stages": 2, "micro": 4, "schedule": "1f1b", "zero": 1, "clip": 0.05},
        {"model": "llama", "stages": 2, "micro": 8, "schedule": "gpipe", "zero": 0},
        {"model": "gpt2", "stages": 2, "micro": 4, "schedule": "1f1b", "zero": 2},
        {"model": "gpt2", "stages": 2, "micro": 4, "schedule": "1f1b", "zero": 2, "offload": True, "clip": 0.05},
    ]
    _check(spawn(_grid, 4, cases, None))


# ---------------------------------------------------------------- 8 ranks: a plain PipelineModule


class _Dense(torch.nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(i, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _tied_out(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight  # the first layer's weight again, transposed


def _mlp_specs() -> list:
    from hf_zero.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec("w", torch.nn.Linear, 8, 8, bias=False), LayerSpec(_Dense, 8, 15), LayerSpec(_Dense, 15, 7),
            LayerSpec(_Dense, 7, 8), TiedLayerSpec("w", torch.nn.Linear, 8, 8, bias=False, forward_fn=_tied_out)]


def _mlp_oracle(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[torch.Tensor]]:
    """The layers built in one process with the pipeline's per-layer seeds, trained on the whole batch."""
    from functools import partial

    mods, fns = {}, []
    for idx, spec in enumerate(_mlp_specs()):
        key = getattr(spec, "key", idx)
        if key not in mods:
            torch.manual_seed(1234 + idx)
            mods[key] = spec.build()
        fns.append(partial(spec.forward_fn, mods[key]) if spec.forward_fn else mods[key])
    params = [p for m in mods.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for t in range(STEPS):
        h = x[t]
        for f in fns:
            h = f(h)
        loss = torch.nn.functional.mse_loss(h, y[t])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [mods["w"].weight.detach()] + [p.detach() for k in (1, 2, 3) for p in mods[k].parameters()]


def _mlp(rank: int, world: int, stages: int, micro: int, zero: int) -> dict:
    import hf_zero
    from hf_zero.pipe import PipelineModule

    pipe = PipelineModule(_mlp_specs(), num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                          partition_method="uniform", seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": micro, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": zero}, "steps_per_print": 1000}
    engine, _, _, _ = hf_zero.initialize(model=pipe, optimizer=lambda g: torch.optim.AdamW(g, lr=LR), config=cfg)
    dp, d = world // stages, pipe.dp_rank
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(STEPS, MB * micro * dp, 8, generator=g), torch.randn(STEPS, MB * micro * dp, 8, generator=g)
    losses = []
    for t in range(STEPS):
        rows = [slice((d * micro + i) * MB, (d * micro + i + 1) * MB) for i in range(micro)]
        losses.append(float(engine.train_batch(iter([(x[t, r], y[t, r]) for r in rows]))))
    ref_losses, ref_w = _mlp_oracle(x, y)
    mine = {"tied_modules.w.weight": ref_w[0]}
    for k, idx in enumerate((1, 2, 3)):
        mine[f"{idx}.fc.weight"], mine[f"{idx}.fc.bias"] = ref_w[1 + 2 * k], ref_w[2 + 2 * k]
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "w_err": max(_rel(p.detach(), mine[n]) for n, p in engine.module.named_parameters()),
            "names": sorted(n for n, _ in engine.module.named_parameters())}


def test_eight_ranks_four_stages_times_two_replicas_zero1_tied() -> None:
    """World 8 = 4 stages x 2 replicas, ZeRO-1, a weight tied between the first and last stage.

    A plain ``PipelineModule`` (no transformers import) keeps eight processes affordable on two cores.
    """
    results = spawn(_mlp, 8, 4, 4, 1)
    for r in results:
        assert r["loss_err"] < 1e-5 and r["w_err"] < 1e-5, r
    assert results[0]["names"] == ["1.fc.bias", "1.fc.weight", "tied_modules.w.weight"]
    assert results[7]["names"] == ["tied_modules.w.weight"]


# ---------------------------------------------------------------- errors


def _errors(rank: int, world: int) -> list[str]:
    import hf_zero
    from hf_zero.pipe import LayerSpec, PipelineModule, split_causal_lm

    out = []

    def catch(fn) -> None:  # noqa: ANN001
        try:
            fn()
            out.append("no error")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")

    specs = [LayerSpec(torch.nn.Linear, 4, 4) for _ in range(3)]
    catch(lambda: PipelineModule(specs, num_stages=3))
    catch(lambda: PipelineModule(specs, num_stages=4))
    catch(lambda: PipelineModule(specs, num_stages=2, partition_method="fancy"))
    catch(lambda: hf_zero.initialize(model=split_causal_lm(_llama(layers=2), 2), config={
        "train_batch_size": 4, "zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    engine, _, _, _ = hf_zero.initialize(model=split_causal_lm(_llama(layers=2), 2), config={
        "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    catch(lambda: engine.train_batch())
    catch(lambda: engine.save_16bit_model("never-written"))
    return out


def _check_errors(msgs: list[str]) -> None:
    """Bad num_stages (twice), partition_method, ZeRO-3 with a pipeline, train_batch without data, save_16bit_model:
    one sentence each."""
    assert "does not divide the world size 2" in msgs[0], msgs
    assert "has more stages than layers (3)" in msgs[1], msgs
    assert "partition_method='fancy'" in msgs[2] and "unknown" in msgs[2], msgs
    assert msgs[3].startswith("ConfigError: zero_optimization.stage: got 3") and "pipeline" in msgs[3], msgs
    assert msgs[4].startswith("UsageError: train_batch() got no data"), msgs
    assert msgs[5] == ("UsageError: save_16bit_model() is not supported for a pipeline engine; call "
                       "engine.save_pretrained(save_dir), which writes every stage's weights into one from_pretrained folder"), msgs


def _own_loss(rank: int, world: int) -> dict:
    """Each model split into 2 stages against its own forward, with a padding mask (and Mistral's
    sliding window): the positions, masks and rotary tables the stages build (once per micro-batch,
    shared by their blocks) must be the ones the model builds."""
    from transformers import MistralConfig, MistralForCausalLM

    import hf_zero
    from hf_zero.pipe import split_causal_lm

    def mistral():  # noqa: ANN202
        torch.manual_seed(0)
        return MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                                num_attention_heads=2, num_key_value_heads=1, sliding_window=3,
                                                max_position_embeddings=32))

    out = {}
    for name, build in (("llama", _llama), ("mistral", mistral), ("gpt2", _gpt2)):
        model = build().eval()
        ids = torch.randint(0, 32, (2 * MB, 8), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding on one row, right padding on another
        mask[MB, -2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        with torch.no_grad():
            own = [float(model(input_ids=ids[i:i + MB], attention_mask=mask[i:i + MB], labels=labels[i:i + MB]).loss)
                   for i in (0, MB)]
        engine, _, _, _ = hf_zero.initialize(model=split_causal_lm(model, 2), config={
            "train_micro_batch_size_per_gpu": MB, "gradient_clipping": 0.0, "gradient_accumulation_steps": 2})
        batches = [{"input_ids": ids[i:i + MB], "attention_mask": mask[i:i + MB], "labels": labels[i:i + MB]}
                   for i in (0, MB)]
        got = float(engine.eval_batch(iter(batches)))
        out[name] = (got, sum(own) / 2)
    return out


def test_split_models_give_their_own_loss_with_padding_and_sliding_window() -> None:
    for name, (got, own) in spawn(_own_loss, 2)[0].items():
        assert abs(got - own) <= 1e-5 * abs(own), (name, got, own)
