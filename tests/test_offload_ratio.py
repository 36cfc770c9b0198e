"""``offload_optimizer.ratio`` < 1 (ZeRO-Offload++'s Twin-Flow): part of the optimizer state stays and steps on the device.

DeepSpeed 0.19.8 (stage 3) puts sub-group ``i`` of ``n`` on the device when ``i < int((1 - ratio) * n)``, the rest in
host memory; hf_zero does the same with its shard groups in parameter order (hf_zero/zero/offload.py
``device_group_count``) at stages 1-3, the device groups stepped first by the host runner (hf_zero/zero/runner.py
``HostRunner._step_device``). Each master is stepped once, with its own state, by the same optimizer kernel
(torch's fused Adam, which the offloaded run turns on; the run without offload is switched to it as
tests/test_offload.py's ``_same_kernel`` explains), so ratio 0.3 and 0.5 must equal ratio 1.0 and no offload bit for
bit: weights, masters, optimizer state and losses, on 2 CPU ranks over gloo, clipping and an fp16 run with skipped
steps among the cases. The split is checked too: how many groups stay on the device, that they are the first ones
(the input embedding's), and that the bytes of masters plus state on each side follow the ratio.
"""

from __future__ import annotations

import torch

from tests.distributed import spawn
from tests.test_offload_overlap import _batch  # the same batches (vocabulary 64)

STEPS = 4
VOCAB = 64
RATIOS = (None, 1.0, 0.5, 0.3)  # None: no offload


def _model():  # noqa: ANN202 - a test helper
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _config(stage: int, gas: int, clip: float, fp16: bool, ratio: float | None) -> dict:
    zo: dict = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 40}
    if ratio is not None:
        zo["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
                 "zero_optimization": zo, "steps_per_print": 1000,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if fp16:  # the first steps overflow and are skipped
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2}
    return cfg


def _state(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a test helper
    """The gathered weights, and this rank's masters and optimizer state keyed by the group's first parameter."""
    from hf_zero.zero import GatheredParameters

    out = {}
    with GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            out[f"w.{n}"] = p.detach().clone()
    zo = engine.zero_optimizer
    for g in (g for g in zo.groups if g.master is not None):
        key = g.slots[0].name
        out[f"master.{key}"] = g.master.detach().clone()
        for k, v in zo.optimizer.state.get(g.master, {}).items():
            out[f"state.{key}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    return out


def _run(stage: int, gas: int, clip: float, fp16: bool, ratio: float | None, rank: int) -> dict:
    import hf_zero
    from hf_zero.zero.offload import device_group_count, is_host_master

    engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, gas, clip, fp16, ratio))
    zo = engine.zero_optimizer
    if ratio is None:
        from hf_zero.zero.offload import use_host_kernels

        use_host_kernels(zo.optimizer)  # the kernel the offloaded runs step with (tests/test_offload.py _same_kernel)
    losses = []
    for t in range(STEPS):
        for k in range(gas):
            loss = engine(**_batch(t, k, rank)).loss
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    trainable = [g for g in zo.groups if g.master is not None]
    on_device = [g for g in trainable if not is_host_master(g)]
    embed = "model.embed_tokens.weight"
    return {"state": _state(engine), "losses": losses, "skipped": engine.skipped_steps,
            "groups": len(trainable), "on_device": len(on_device),
            "expected_on_device": device_group_count(len(trainable), ratio) if ratio is not None else len(trainable),
            "embed_on_device": any(s.name == embed for g in on_device for s in g.slots),
            "split": zo.optimizer_state_bytes(),
            "largest": max(g.master.numel() for g in trainable) * 4 * 3}  # master + Adam's two moments, fp32


def _grid(rank: int, world: int, cases: list) -> list:
    out = []
    for case in cases:
        runs = {r: _run(*case, r, rank) for r in RATIOS}
        ref = runs[None]
        rows = []
        for r in RATIOS[1:]:
            got = runs[r]
            rows.append({k: v for k, v in got.items() if k != "state"})
            rows[-1]["ratio"] = r
            rows[-1]["differ"] = sorted(k for k in ref["state"] if not torch.equal(ref["state"][k], got["state"][k]))
            rows[-1]["same_keys"] = ref["state"].keys() == got["state"].keys()
        out.append({"case": case, "ref_losses": ref["losses"], "ref_skipped": ref["skipped"], "rows": rows})
    return out


# (stage, gradient accumulation steps, gradient_clipping, fp16)
CASES = [(1, 1, 1.0, False), (2, 2, 0.0, False), (3, 1, 1.0, False), (3, 2, 0.0, True)]


def test_partial_offload_equals_full_offload_and_no_offload_bit_for_bit() -> None:
    for rank_rows in spawn(_grid, 2, CASES):
        for row in rank_rows:
            case = row["case"]
            for got in row["rows"]:
                ratio = got["ratio"]
                where = (case, ratio)
                assert got["same_keys"], where
                assert got["differ"] == [], (where, got["differ"][:5])
                assert got["losses"] == row["ref_losses"] and got["skipped"] == row["ref_skipped"], where
                if case[3]:
                    assert got["skipped"] >= 1, where  # the fp16 case does skip a step
                # DeepSpeed's split: the first int((1 - ratio) * n) groups in parameter order stay on the device
                n, k = got["groups"], got["on_device"]
                assert n >= 4 and k == got["expected_on_device"] == int((1 - ratio) * n), (where, n, k)
                assert (k > 0) == got["embed_on_device"], where  # the first group (the input embedding's) goes first
                host, device = got["split"]["host"], got["split"]["device"]
                assert (device == 0) == (ratio == 1.0) and host > 0, (where, got["split"])
                # the bytes follow the ratio to within one group (the split is by groups, as DeepSpeed's sub-groups)
                assert abs(host / (host + device) - ratio) <= got["largest"] / (host + device) + 1 / n, (where, got["split"])


# ------------------------------------------------------------------ zero_optimization.sub_group_size


def _run_sub_groups(stage: int, gas: int, clip: float, fp16: bool, speculate: bool, size: int | None,
                    rank: int) -> dict:
    import hf_zero
    from hf_zero.zero import host_step

    cfg = _config(stage, gas, clip, fp16, 1.0)
    cfg["zero_optimization"]["offload_optimizer"]["super_offload"] = speculate
    if size is not None:
        cfg["zero_optimization"]["sub_group_size"] = size
    calls: list[int] = []
    original = host_step.step_master

    def counting(optimizer, master, grad, ranges, **kw):  # noqa: ANN001, ANN003, ANN202 - counts each group's ranges
        calls.append(len(ranges))
        return original(optimizer, master, grad, ranges, **kw)

    host_step.step_master = counting
    try:
        engine, *_ = hf_zero.initialize(model=_model(), config=cfg)
        losses = []
        for t in range(STEPS):
            for k in range(gas):
                loss = engine(**_batch(t, k, rank)).loss
                engine.backward(loss)
                engine.step()
            losses.append(float(loss.detach()))
    finally:
        host_step.step_master = original
    return {"state": _state(engine), "losses": losses, "most_ranges": max(calls, default=0),
            "stepped": len(calls)}


def _grid_sub_groups(rank: int, world: int, cases: list) -> list:
    out = []
    for case in cases:
        whole = _run_sub_groups(*case, None, rank)
        for size in (0, 300):
            got = _run_sub_groups(*case, size, rank)
            out.append({"case": [*case, size], "losses": [whole["losses"], got["losses"]],
                        "differ": sorted(k for k in whole["state"] if not torch.equal(whole["state"][k], got["state"][k])),
                        "same_keys": whole["state"].keys() == got["state"].keys(),
                        "ranges": [whole["most_ranges"], got["most_ranges"]], "stepped": got["stepped"]})
    return out


# (stage, gradient accumulation steps, gradient_clipping, fp16, super_offload)
SUB_GROUP_CASES = [(1, 1, 1.0, False, False), (2, 2, 0.0, True, False), (3, 1, 1.0, False, True)]


def test_sub_group_size_steps_each_group_in_pieces_equal_to_one_call_bit_for_bit() -> None:
    """sub_group_size 0 (one parameter a sub-group, axolotl's value) and 300 elements step the host groups in several
    calls each (counted), and the weights, masters and optimizer state equal the default's one call per group."""
    for rank_rows in spawn(_grid_sub_groups, 2, SUB_GROUP_CASES):
        for row in rank_rows:
            case = row["case"]
            assert row["same_keys"] and row["differ"] == [], (case, row["differ"][:5])
            assert row["losses"][0] == row["losses"][1], case
            assert row["ranges"][0] == 1 and row["ranges"][1] > 1 and row["stepped"] > 0, (case, row["ranges"])


def test_sub_group_ranges_take_whole_parameters_until_the_size_is_reached() -> None:
    """DeepSpeed's rule on one rank's partitions: parameters join a sub-group until it holds ``sub_group_size`` or more."""
    import torch.distributed as dist

    from hf_zero.zero.flat import FlatGroup
    from hf_zero.zero.group import Placement
    from hf_zero.zero.host_step import sub_group_ranges

    sizes = [(7, 15), (40,), (3,), (30, 2), (5,)]  # 105, 40, 3, 60, 5 elements: 213
    named = [(f"p{i}", torch.nn.Parameter(torch.randn(*s))) for i, s in enumerate(sizes)]
    # an earlier test of the same pytest process may have left a one-process group up (hf_zero's own one-process
    # default); use it then, else make one and take it down after
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        place = Placement.over(None, torch.device("cpu"), torch.bfloat16, torch.float32, torch.float32)
        group = FlatGroup(named, place, partitioned=True, free_grads_after_reduce=True)
        assert group.master is not None and group.master.numel() == 213
        assert sub_group_ranges(group, 0) == [(0, 105), (105, 145), (145, 148), (148, 208), (208, 213)]
        assert sub_group_ranges(group, 100) == [(0, 105), (105, 208), (208, 213)]
        assert sub_group_ranges(group, 110) == [(0, 145), (145, 213)]
        assert sub_group_ranges(group, 213) == [(0, 213)]
        assert sub_group_ranges(group, 10**9) == [(0, 213)]
    finally:
        if owned:
            dist.destroy_process_group()
