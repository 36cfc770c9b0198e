"""``"offload_optimizer": {"device": "cpu"}`` at ZeRO stages 1-3 (hf_zero/zero/offload.py), on CPU ranks over gloo.

On a CPU the "host" and the "device" are the same memory, but the code path is the offload one and it is
checked to be: each trainable group's fp32 master is a tensor of its own (not a view of the parameters),
the reduced gradient is copied into the master's ``.grad`` before the optimizer steps, and the weights
come back through ``publish_master``. The oracle is the same run without offload, which the parity
suites check against one process, stepping the same optimizer kernel (see ``_same_kernel``): then the two
runs are equal bit for bit, fp16 included. Also: a checkpoint of an offloaded run resumes in a run without
offload at another stage and back; fp16 overflow skips; and the configs the parser refuses.
"""

from __future__ import annotations

import math
import re
import tempfile

import pytest
import torch

from tests.distributed import spawn

STEPS = 4
VOCAB = 64


def _model():  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _config(stage: int, offload: bool, gas: int, clip: float, fp16: bool = False) -> dict:
    zo: dict = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 40}
    if offload:
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "zero_optimization": zo, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 2}
    return cfg


def _batch(step: int, micro: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _weights(engine) -> dict:  # noqa: ANN001
    from hf_zero.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().float().clone().reshape(-1).tolist() for n, p in engine.module.named_parameters()}


def _train(engine, steps: range, gas: int, rank: int) -> list[float]:  # noqa: ANN001
    losses = []
    for t in steps:
        for k in range(gas):
            loss = engine(**_batch(t, k, rank)).loss
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return losses


def _check_offloaded(engine) -> dict:  # noqa: ANN001
    """The groups are the offload ones and their masters are separate tensors on the host."""
    from hf_zero.zero.offload import OffloadedFlatGroup, OffloadedShardedParamGroup

    groups = [g for g in engine.zero_optimizer.groups if g.trainable]
    kinds = {type(g).__name__ for g in groups}
    separate = all(g.master.device.type == "cpu" and all(
        g.master.untyped_storage().data_ptr() != s.param.untyped_storage().data_ptr() for s in g.slots) for g in groups)
    stepped = all(g._host_grad is not None for g in groups)  # before_step copied a gradient to the host
    fused = all(pg.get("fused") is True for pg in engine.zero_optimizer.optimizer.param_groups)
    return {"kinds": sorted(kinds), "separate": separate, "stepped": stepped, "fused": fused,
            "offload_types": all(isinstance(g, OffloadedFlatGroup | OffloadedShardedParamGroup) for g in groups)}


def _same_kernel(engine) -> bool:  # noqa: ANN001
    """Step the run without offload with the kernel offload steps with (torch's fused CPU Adam), by offload's own switch.

    Why: the device run's default is torch's per-tensor Adam, whose fp32 result differs from the fused kernel's in
    the last bit, and how often depends on the CPU (its vector width and FMA use). Under fp16 such a bit can move a
    master across an fp16 rounding boundary; that is one fp16 ulp (2^-11 to 2^-10 relative) in a weight, which the
    next forward turns into different gradients, and Adam's normalised update (up to ~lr = 1e-2 per element and
    step, whatever the gradient's size) carries it through the remaining steps: no bound smaller than ~2 * lr *
    steps per element follows from the arithmetic, and measured figures were 2.6e-5 on one CPU, 1.28e-4 on an AMD
    EPYC and 3.7e-4 on another (relative, weights), against a bound of 1e-4. With one kernel on both sides the
    comparison no longer depends on the CPU: both runs do the same forward and backward, the same reductions in the
    same order, and the fused kernel on the same master shards (its per-element result does not depend on its thread
    split: the chunks are whole 64-byte lines), so anything but equality is a difference of offload's data path.
    Returns whether the run would have used another kernel, so the test knows the switch did something.
    """
    from hf_zero.zero.offload import use_host_kernels

    optimizer = engine.zero_optimizer.optimizer
    was_fused = all(pg.get("fused") for pg in optimizer.param_groups)
    use_host_kernels(optimizer)
    return not was_fused


def _grid(rank: int, world: int, cases: list, tmp: str) -> list:
    import hf_zero

    out = []
    for stage, gas, clip, fp16 in cases:
        row = {}
        for offload in (False, True):
            engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, offload, gas, clip, fp16))
            if not offload:
                row["switched"] = _same_kernel(engine)
            losses = _train(engine, range(STEPS), gas, rank)
            row["off" if offload else "on"] = {"losses": losses, "weights": _weights(engine), "skipped": engine.skipped_steps}
            if offload:
                row["check"] = _check_offloaded(engine)
        out.append(row)
    out.append(_resume_across(rank, world, tmp))
    return out


def _resume_across(rank: int, world: int, tmp: str) -> dict:
    """Offloaded stage 2 -> checkpoint -> stage 3 without offload -> checkpoint -> offloaded stage 1: the uninterrupted run."""
    import hf_zero

    gas = 2
    ref, *_ = hf_zero.initialize(model=_model(), config=_config(2, False, gas, 0.5))
    ref_losses = _train(ref, range(6), gas, rank)
    a, *_ = hf_zero.initialize(model=_model(), config=_config(2, True, gas, 0.5))
    losses = _train(a, range(2), gas, rank)
    a.save_checkpoint(tmp, tag="a")
    b, *_ = hf_zero.initialize(model=_model(), config=_config(3, False, gas, 0.5))
    b.load_checkpoint(tmp, tag="a")
    losses += _train(b, range(2, 4), gas, rank)
    b.save_checkpoint(tmp, tag="b")
    c, *_ = hf_zero.initialize(model=_model(), config=_config(1, True, gas, 0.5))
    c.load_checkpoint(tmp, tag="b")
    losses += _train(c, range(4, 6), gas, rank)
    return {"losses": losses, "ref": ref_losses, "weights": _weights(c), "ref_weights": _weights(ref)}


def _rel(a: list, b: list) -> float:
    ta, tb = torch.tensor(a), torch.tensor(b)
    return float((ta - tb).norm() / tb.norm().clamp_min(1e-12))


CASES = [[1, 2, 0.0, False], [2, 2, 0.5, False], [3, 2, 0.5, False], [2, 1, 0.0, True], [3, 1, 0.0, True]]


def _device_grads_on_one_rank(rank: int, world: int) -> dict:
    """Stages 1-2 offloaded on one rank: the gradient bytes left on the device after each backward and each step."""
    import hf_zero

    out = {}
    for stage in (1, 2):
        for gas in (1, 2):
            engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, True, gas, 0.5))
            groups = engine.zero_optimizer.flat_groups
            seen = []
            for t in range(2):
                for k in range(gas):
                    engine.backward(engine(**_batch(t, k, rank)).loss)
                    after_backward = sum(g.grad_flat.numel() for g in groups if g.grad_flat is not None)
                    engine.step()
                    after_step = sum(g.grad_flat.numel() for g in groups if g.grad_flat is not None)
                    after_step += sum(p.grad.numel() for p in engine.module.parameters() if p.grad is not None)
                    seen.append((after_backward, after_step))
            out[f"{stage}-{gas}"] = {"seen": seen, "numel": sum(p.numel() for p in engine.module.parameters())}
    return out


def test_offload_on_one_rank_keeps_no_full_gradient_buffer() -> None:
    """On one rank the offloaded stages 1-2 kept a flat 16-bit gradient buffer for the whole run (2 bytes per parameter
    on the GPU that DeepSpeed's ZeRO-2 offload does not hold); it goes once its gradients are reduced, as on more ranks."""
    r = spawn(_device_grads_on_one_rank, 1)[0]
    for case, got in r.items():
        stage, gas = (int(x) for x in case.split("-"))
        for i, (after_backward, after_step) in enumerate(got["seen"]):
            if stage == 2 or (i + 1) % gas == 0:  # stage 1 accumulates full gradients until the step's last backward
                assert after_backward == after_step == 0, (case, got)
            else:
                assert after_backward == got["numel"], (case, got)


@pytest.mark.parametrize("world", [2, 3])
def test_offloaded_optimizer_trains_like_the_device_one_and_resumes_across_settings(world: int) -> None:
    cases = CASES if world == 2 else CASES[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_grid, world, cases, tmp)
    for per_rank in results:
        for case, row in zip(cases, per_rank):
            on, off = row["on"], row["off"]
            assert row["check"]["offload_types"] and row["check"]["separate"] and row["check"]["stepped"], (case, row["check"])
            assert row["check"]["fused"] and row["switched"], (case, row["check"], row["switched"])
            assert off["skipped"] == on["skipped"], case
            if case[3]:
                assert on["skipped"] >= 1, (case, on["skipped"])  # the fp16 cases do overflow and skip
            # Equal bit for bit, fp16 included, on any CPU: both runs step the same kernel (_same_kernel says why).
            assert off["losses"] == on["losses"], (case, off["losses"], on["losses"])
            for name in on["weights"]:
                assert off["weights"][name] == on["weights"][name], (case, name, _rel(off["weights"][name], on["weights"][name]))
        res = per_rank[len(cases)]
        assert _rel(res["losses"], res["ref"]) < 1e-6, res
        for name in res["ref_weights"]:
            assert _rel(res["weights"][name], res["ref_weights"][name]) < 1e-5, name


@pytest.mark.parametrize(("section", "words"), [
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, '"device": "nvme" needs a folder'),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload needs ZeRO stage 1, 2 or 3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3, "super_offload": True}},
     "ratio: got 0.3 with super_offload"),
    ({"stage": 2, "overlap_param_gather": True, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     "ratio: got 0.5 with zero_optimization.overlap_param_gather"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, '"nvme" without offload_optimizer is not supported yet'),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "super_offload": True}},
     "the speculative host step keeps the masters in host memory"),
])
def test_offload_configs_hf_zero_cannot_run_are_refused_in_one_sentence(section: dict, words: str) -> None:
    from hf_zero.config import ConfigError, ZeroConfig

    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        ZeroConfig.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": section})
    assert "\n" not in str(err.value)



def _short_of_host_memory(rank: int, world: int) -> dict:
    """Every rank is told the machine has 1 KiB available: each stops with the same sentence, before any group exists."""
    import hf_zero
    from hf_zero.zero import offload

    built: list[int] = []
    original = offload.OffloadedFlatGroup.__init__

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        built.append(1)
        return original(self, *args, **kwargs)

    offload.OffloadedFlatGroup.__init__ = counting
    offload.available_host_bytes = lambda: 2**10
    try:
        hf_zero.initialize(model=_model(), config=_config(2, True, 1, 0.0))
    except MemoryError as e:
        return {"error": f"{type(e).__name__}: {e}", "groups_built": len(built)}
    return {"error": None, "groups_built": len(built)}


def test_offload_that_does_not_fit_the_host_stops_every_rank_before_allocating() -> None:
    results = spawn(_short_of_host_memory, 2)
    for r in results:
        assert r["groups_built"] == 0 and r["error"] is not None, r
        # both ranks' shards of the fp32 masters and gradient copies (8 bytes) and Adam's moments (8 bytes)
        shard = sum((p.numel() + 1) // 2 for p in _model().parameters())
        assert r["error"].startswith(f"HostMemoryError: offload needs {2 * shard * 16 / 2**10:.1f} KiB of host "
                                     "memory on "), r["error"]
        assert "but 1.0 KiB is available (MemAvailable, of which 5% and 2 GiB per rank stay free" in r["error"]
        assert "\n" not in r["error"]
    assert results[0]["error"] == results[1]["error"]


def _streamed_gradients(rank: int, world: int) -> dict:
    """Host memory one byte short of a gradient copy per group: the step streams the gradients from the device through
    two shared buffers instead, to the same numbers; far shorter, every rank stops with one sentence."""
    import logging

    import hf_zero
    from hf_zero.planning.estimate import offload_host_bytes
    from hf_zero.zero import offload

    real = offload.available_host_bytes
    shard = sum((p.numel() + world - 1) // world for p in _model().parameters())
    needed = world * offload_host_bytes(shard, 8)  # every rank of this machine: fp32 master, gradient copy, moments
    # MemAvailable at which the plan with a gradient copy misses by one byte (the plan keeps a reserve free)
    short = math.floor((needed - 1 + world * offload.HOST_RESERVE_PER_RANK) / (1 - offload.HOST_RESERVE_FRACTION))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hf_zero").addHandler(handler)
    out: dict = {}
    for stage in (2, 3):
        runs = {}
        for mode, available in (("copy", real), ("streamed", lambda: short)):
            offload.available_host_bytes = available
            engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, True, 2, 0.5))
            losses = _train(engine, range(STEPS), 2, rank)
            groups = [g for g in engine.zero_optimizer.groups if g.trainable]
            runs[mode] = {"losses": losses, "weights": _weights(engine), "streamed": engine.zero_optimizer.stream_grads,
                          "host_grads": sum(g._host_grad is not None for g in groups), "groups": len(groups),
                          "buffers": len(engine.zero_optimizer.runner.grad_buffers)}
        out[str(stage)] = runs
    offload.available_host_bytes = lambda: short - needed // 2
    try:
        hf_zero.initialize(model=_model(), config=_config(3, True, 2, 0.5))
        out["short"] = None
    except MemoryError as e:
        out["short"] = f"{type(e).__name__}: {e}"
    offload.available_host_bytes = real
    out["said"] = [m for m in said if "streams it to the host" in m]
    return out


def test_offload_streams_the_gradients_when_the_host_cannot_hold_a_copy() -> None:
    """An 8B full fine-tune on one H200 needs 96 GiB of masters and Adam moments in host memory, and a fp32 gradient copy
    would add 32 GiB: past the machine's 125 GiB. Without it the gradients wait on the GPU and stream through two
    buffers; the numbers are those of the copy per group, bit for bit."""
    results = spawn(_streamed_gradients, 2)
    for rank, r in enumerate(results):
        for stage in (2, 3):
            copy, streamed = r[str(stage)]["copy"], r[str(stage)]["streamed"]
            assert not copy["streamed"] and copy["host_grads"] == copy["groups"] and copy["buffers"] == 0, (stage, copy)
            assert streamed["streamed"] and streamed["host_grads"] == 0 and streamed["buffers"] == 2, (stage, streamed)
            assert streamed["losses"] == copy["losses"], (stage, streamed["losses"], copy["losses"])
            assert streamed["weights"] == copy["weights"], stage
        assert r["short"] is not None and r["short"].startswith("HostMemoryError: offload needs "), r["short"]
        assert "with the gradients streamed from the GPU, but" in r["short"] and "\n" not in r["short"], r["short"]
        assert len(r["said"]) == (2 if rank == 0 else 0), r["said"]  # once per engine, by rank 0
    assert results[0]["short"] == results[1]["short"]


# ------------------------------------------------------------------ parameter offload (stage 3's offload_param)


def _param_config(kind: str | None, gas: int, clip: float) -> dict:
    cfg = _config(3, kind is not None and "opt" in kind, gas, clip)
    if kind is not None and "param" in kind:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def _param_model(freeze: bool):  # noqa: ANN202
    model = _model()
    if freeze:  # frozen groups too: the embedding and a whole MLP, as a partly frozen fine-tune has them
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].mlp.requires_grad_(False)
    return model


def _param_grid(rank: int, world: int, cases: list, tmp: str) -> list:
    import hf_zero
    from hf_zero.zero.offload import OffloadedFrozenGroup, OffloadedShardedParamGroup

    out = []
    for kind, gas, clip, freeze in cases:
        row: dict = {}
        for offload in (None, kind):
            engine, *_ = hf_zero.initialize(model=_param_model(freeze), config=_param_config(offload, gas, clip))
            losses = _train(engine, range(STEPS), gas, rank)
            row["off" if offload else "on"] = {"losses": losses, "weights": _weights(engine)}
            if offload:
                sharded = engine.zero_optimizer.stage3_groups
                frozen = [g for g in sharded if not g.trainable]
                on_host = [g for g in sharded if getattr(g, "shard_on_host", False)]
                row["check"] = {
                    "frozen_offloaded": bool(frozen) == freeze and all(isinstance(g, OffloadedFrozenGroup) for g in frozen),
                    # with the optimizer offloaded too, every sharded group's 16-bit shard is in host memory
                    "all_on_host": len(on_host) == len(sharded) if "opt" in kind else len(on_host) == len(frozen),
                    "host_tensors": all(g.param_shard.device.type == "cpu" for g in on_host),
                    "not_counted_on_device": all(g.held_tensors()["params"][0] is None for g in on_host),
                    "kinds": sorted({type(g).__name__ for g in sharded}),
                    "opt_offloaded": all(isinstance(g, OffloadedShardedParamGroup) for g in sharded if g.trainable),
                }
                engine.save_checkpoint(tmp, tag=f"{kind}{freeze}")
                # the offloaded checkpoint resumes in a run without offload: the same weights
                plain, *_ = hf_zero.initialize(model=_param_model(freeze), config=_param_config(None, gas, clip))
                plain.load_checkpoint(tmp, tag=f"{kind}{freeze}")
                row["resumed"] = _weights(plain)
        out.append(row)
    return out


PARAM_CASES = [["opt+param", 2, 0.5, False], ["opt+param", 1, 0.0, True], ["param", 2, 0.5, True]]


@pytest.mark.parametrize("world", [1, 2])
def test_offload_param_trains_like_the_device_shards_and_resumes_without_it(world: int) -> None:
    """``offload_param`` cpu at stage 3, with and without ``offload_optimizer``, frozen groups among them: the 16-bit
    shards the all-gathers read live in host memory, and losses and weights equal the run that keeps them on the
    device (which the parity suites check against one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_param_grid, world, PARAM_CASES, tmp)
    for per_rank in results:
        for case, row in zip(PARAM_CASES, per_rank):
            check = row["check"]
            assert check["frozen_offloaded"] and check["all_on_host"] and check["host_tensors"], (case, check)
            assert check["not_counted_on_device"] and check["opt_offloaded"] == ("opt" in case[0]), (case, check)
            assert _rel(row["off"]["losses"], row["on"]["losses"]) < 1e-6, (case, row["off"]["losses"], row["on"]["losses"])
            for name in row["on"]["weights"]:
                assert _rel(row["off"]["weights"][name], row["on"]["weights"][name]) < 1e-6, (case, name)
                assert row["resumed"][name] == row["off"]["weights"][name], (case, name)


def test_offload_param_below_stage_3_is_named_as_ignored_as_deepspeed_ignores_it() -> None:
    from hf_zero.config import ZeroConfig

    with pytest.warns(UserWarning, match=r"zero_optimization.offload_param \(DeepSpeed reads it at stage 3 only\)"):
        ZeroConfig.load({"train_micro_batch_size_per_gpu": 1,
                         "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})


def _breakdown(rank: int, world: int) -> dict:
    import logging

    import hf_zero

    cfg = _config(2, True, 1, 0.5)
    cfg.update(wall_clock_breakdown=True, steps_per_print=2)
    engine, *_ = hf_zero.initialize(model=_model(), config=cfg)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hf_zero").addHandler(handler)
    _train(engine, range(3), 1, rank)
    means = engine.timers.means()
    plain, *_ = hf_zero.initialize(model=_model(), config=_config(2, True, 1, 0.5))
    _train(plain, range(1), 1, rank)
    return {"means": means, "lines": [x for x in lines if "time per call" in x], "off": plain.timers.means()}


def test_wall_clock_breakdown_times_the_offloaded_step_in_its_parts() -> None:
    """DeepSpeed's ``wall_clock_breakdown``: forward, backward and step, and the offloaded step's three parts
    (waiting for the gradient copies, the CPU optimizer, the copy back), logged every steps_per_print steps."""
    results = spawn(_breakdown, 2)
    for r in results:
        means = r["means"]
        assert list(means) == ["forward", "backward", "step", "step.wait_grads", "step.cpu_optimizer", "step.to_device"]
        assert all(v >= 0 for v in means.values()) and means["step.cpu_optimizer"] > 0
        assert means["step.wait_grads"] + means["step.cpu_optimizer"] + means["step.to_device"] <= means["step"] * 1.05
        assert r["off"] == {}  # off by default: nothing timed
    assert len(results[0]["lines"]) == 1 and results[1]["lines"] == []  # step 2 of 3, rank 0
    assert results[0]["lines"][0].startswith("step=2, time per call: forward ")


def _plans_with_speculation(rank: int, world: int) -> dict:
    """plan_host_memory with super_offload on, at MemAvailable figures around what its second buffers need."""
    import logging

    from hf_zero.planning.estimate import offload_host_bytes
    from hf_zero.zero import offload

    n, largest, k = 10**9, 10**8, 8
    policy = offload.OffloadPolicy(optimizer=True, params=True, speculate=True)
    sizes = offload.ShardSizes(n, largest_group=largest)
    plain = offload_host_bytes(n, k, param_bytes=2)
    spec = offload_host_bytes(n, k, param_bytes=2, speculate=True)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hf_zero").addHandler(handler)
    real = offload.available_host_bytes
    out: dict = {"plain": plain, "spec": spec, "plans": {}}
    try:
        streamed = plain - 4 * n + 2 * 4 * largest
        for name, need in (("fits", spec), ("fits_without", plain), ("streamed", streamed)):  # just holds it
            offload.available_host_bytes = lambda need=need: math.ceil(
                (need + world * offload.HOST_RESERVE_PER_RANK) / (1 - offload.HOST_RESERVE_FRACTION))
            out["plans"][name] = offload.plan_host_memory(policy, sizes, state_bytes=k, param_bytes=2, group=None).value
        # an engine built where only the plan without the second buffers fits trains without speculation
        import hf_zero

        cfg = _config(2, True, 1, 0.0)
        cfg["zero_optimization"]["offload_optimizer"]["super_offload"] = True
        shard = sum(p.numel() for p in _model().parameters())
        without = offload_host_bytes(shard, k, copy_bytes=0)  # fp32: no 16-bit copy
        for name, need in (("engine_fits", offload_host_bytes(shard, k, speculate=True)),
                           ("engine_without", without)):
            offload.available_host_bytes = lambda need=need: math.ceil(
                (need + world * offload.HOST_RESERVE_PER_RANK) / (1 - offload.HOST_RESERVE_FRACTION)) + 64
            engine, *_ = hf_zero.initialize(model=_model(), config=cfg)
            runner = engine.zero_optimizer.runner
            out[name] = {"speculation": getattr(runner, "speculation", None) is not None,
                         "losses": _train(engine, range(2), 1, rank)}
            engine.destroy()
    finally:
        offload.available_host_bytes = real
        logging.getLogger("hf_zero").removeHandler(handler)
    out["said"] = said
    return out


def test_the_host_plan_counts_super_offloads_second_buffers() -> None:
    """super_offload keeps a second master, optimizer state and 16-bit host shard per element (its steps during backward
    write there: hf_zero/zero/speculative_step.py): 4 + 8 + 2 bytes with Adam and parameter offload, planned before
    anything is allocated; where only the plan without them fits, the step runs without speculation, and where not even
    that fits the gradients stream (no host copies in backward, so no speculation either); rank 0 says so each time."""
    r = spawn(_plans_with_speculation, 1)[0]
    assert r["spec"] - r["plain"] == 10**9 * (4 + 8 + 2), r
    assert r["plans"] == {"fits": "fits", "fits_without": "no_speculation", "streamed": "stream_grads"}, r["plans"]
    assert r["engine_fits"]["speculation"] and not r["engine_without"]["speculation"], r
    assert r["engine_fits"]["losses"] == r["engine_without"]["losses"], r  # the same numbers either way
    assert len(r["said"]) == 3, r["said"]
    assert "cannot hold super_offload's second master, optimizer state and 16-bit copy (13.0 GiB per rank)" in r["said"][0]
    assert "super_offload's steps during backward need the host copies: they are off" in r["said"][1]
