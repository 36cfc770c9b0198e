"""``hf-zero estimate``'s offload rows against the bytes hf_zero allocates, and beside DeepSpeed's estimator.

Measured, not assumed: a small Llama is trained with ``"offload_optimizer": {"device": "cpu"}`` on 2 gloo
CPU ranks at stages 1-3, in bf16 and fp32, with 2 micro-steps a step. In the second step, after the first
micro-step's backward (every host buffer exists by then, and stages 2-3 hold the whole fp32 gradient
shard on the device), each rank adds up

- device: the tensors each shard group's ``held_tensors()`` names (parameters, gradients);
- host: each offloaded group's fp32 master and its host gradient copy, stages 1-2's 16-bit copy of the master that
  is sent to the device (in bf16; the one-pass kernel writes it), and the optimizer state of the masters (Adam's
  two moments; its one-element step counters are left out, as ``memory_bytes`` does);

and, in the backward that ends the step, the size of each group's reduced-gradient shard at the moment
its copy to the host leaves (stage 1 reduces only then). On a CPU "host" and "device" are the same
memory, so the split follows what the offload groups keep where (hf_zero/zero/offload.py).

DeepSpeed 0.19.8's ``estimate_zero2_model_states_mem_needs`` (its figure for stages 1 and 2) and
``estimate_zero3_model_states_mem_needs`` (with ``cpu_offload_params=False``) run in the oracle venv;
their rows are printed beside ours. Its host figure is per node, so it is divided by the GPUs of a node
to compare per rank. Where the two differ (the set is asserted, so a change on either side shows):

- stages 1-2, device: DeepSpeed counts the 16-bit parameters only (2Ψ); hf_zero also holds the fp32
  reduced-gradient shard (4Ψ/N) on the device until its copy leaves, measured below;
- stages 1-2, host: DeepSpeed's figure is not divided by the world size (Ψ·max(4N, 16) bytes a node,
  times a 1.5 buffer factor); hf_zero pins (4+4+8+2)Ψ/N a rank in bf16 (master, gradient copy, moments, the
  16-bit copy sent to the device);
- stage 3, device: DeepSpeed counts the 16-bit shard plus 4 bytes of the largest layer (its gathered
  buffer) and no gradient; hf_zero's figure is the 16-bit shard plus the fp32 gradient shard, and leaves
  gathered units out as it does for every temporary buffer;
- stage 3, host: the same 16Ψ/N, DeepSpeed's times its 1.5 buffer factor.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.distributed import spawn

WORLD = 2
VOCAB = 63
# stage 3 also with offload_param (the 16-bit shards in host memory too)
CASES = [[s, d, False] for s in (1, 2, 3) for d in ("bf16", "fp32")] + [[3, d, True] for d in ("bf16", "fp32")]


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # odd sizes (width 33, vocab 63, 15 positions), so the shards of 2 ranks are padded; the embedding is tied to the head
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=33, n_head=3, n_layer=2, n_positions=15,
                                      bos_token_id=0, eos_token_id=0))


def _config(stage: int, dtype: str, params: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "bf16": {"enabled": dtype == "bf16"},
    }
    if params:  # stage 3's parameter offload as well: the 16-bit shards in host memory
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def _batch(step: int, micro: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _nbytes(tensors: list, seen: set[int]) -> int:
    """Bytes of the unique storages among ``tensors`` not counted yet (None skipped)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _measure(rank: int, world: int, cases: list) -> list:
    import hf_zero
    from hf_zero.zero.offload import _HostMaster

    out = []
    for stage, dtype, params in cases:
        model = _model()
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        engine, *_ = hf_zero.initialize(model=model, config=_config(stage, dtype, params))
        zo = engine.zero_optimizer
        groups = [g for g in zo.groups if g.trainable]
        assert all(isinstance(g, _HostMaster) for g in groups)
        shards: dict[int, int] = {}  # each group's device gradient shard as its (last) copy to the host leaves

        def spy(g, original, shards):  # noqa: ANN001, ANN202
            def copy_after_reduce(stream, *args):  # noqa: ANN001, ANN002, ANN202
                if g.copy_after_reduce and g._device_grad is not None:
                    shards[id(g)] = g._device_grad.untyped_storage().nbytes()
                return original(stream, *args)
            return copy_after_reduce

        for g in groups:
            g._copy_after_reduce = spy(g, g._copy_after_reduce, shards)
        for micro in range(2):  # step 1: creates the optimizer state and the host gradient buffers
            engine.backward(engine(**_batch(0, micro, rank)).loss)
            engine.step()
        engine.backward(engine(**_batch(1, 0, rank)).loss)  # step 2, first micro-step
        seen: set[int] = set()
        held = [g.held_tensors() for g in zo.groups]
        device_params = _nbytes([t for h in held for t in h["params"]], seen)
        device_grads = _nbytes([t for h in held for t in h["grads"]], seen)
        host = _nbytes([g.master for g in groups] + [g._host_grad for g in groups], seen)
        host += _nbytes([g.param_shard for g in groups if getattr(g, "shard_on_host", False)], seen)
        uploads = [g._upload for g in groups if getattr(g, "_upload", None) is not None]  # stages 1-2's 16-bit copies
        host += _nbytes(uploads, seen)
        host += _nbytes([v for st in zo.optimizer.state.values() for v in st.values()
                         if torch.is_tensor(v) and v.numel() > 1], seen)
        boundary = sum(shards.values())
        per_param_shards = sum(math.ceil(p.numel() / world) for p in model.parameters() if p.requires_grad)
        out.append({"stage": stage, "dtype": dtype, "offload_param": params, "psi": psi, "groups": len(groups), "params": len(list(model.parameters())),
                    "device_params": device_params, "device_grads": device_grads, "host": host,
                    "boundary_shards": boundary, "shard_copies": len(shards), "per_param_shards": per_param_shards,
                    "uploads": len(uploads)})
    return out


def _largest_layer(model: torch.nn.Module) -> int:
    """The most parameters one module owns directly (what DeepSpeed's zero-3 estimate calls the largest layer)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def _deepspeed_rows(psi: int, largest: int, num_gpus: int, num_nodes: int) -> dict:
    """DeepSpeed's (host bytes per node, device bytes per GPU) with optimizer offload, stage 1-2 and stage 3."""
    from tests import dsenv

    code = f"""
        import json
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        z2 = estimate_zero2_model_states_mem_needs({psi}, num_gpus_per_node={num_gpus}, num_nodes={num_nodes},
                                                   cpu_offload=True)
        z3 = estimate_zero3_model_states_mem_needs({psi}, {largest}, num_gpus_per_node={num_gpus}, num_nodes={num_nodes},
                                                   cpu_offload=True, cpu_offload_params=False)
        print(json.dumps({{"12": z2, "3": z3}}))
    """
    out = json.loads(dsenv.run_python(code, timeout=300).stdout.strip().splitlines()[-1])
    return {"12": out["12"], "3": out["3"]}


def _within(got: int, want: int, slack: int) -> bool:
    """Equal up to the shards' padding (``slack`` bytes) and never more than 2% apart."""
    return abs(got - want) <= slack and abs(got - want) <= 0.02 * max(want, 1)


@pytest.fixture(scope="module")
def measured() -> list:
    return spawn(_measure, WORLD, CASES)


def test_offload_rows_equal_the_bytes_the_engine_holds(measured: list) -> None:
    from hf_zero.optim import host_adam
    from hf_zero.planning.estimate import estimate_offload_memory, offload_host_bytes

    for per_rank in measured:
        for r in per_rank:
            est = estimate_offload_memory(r["psi"], WORLD, r["stage"], r["dtype"], "adamw", params=r["offload_param"])
            width = 2 if r["dtype"] == "bf16" else 4
            copy = width if r["stage"] < 3 and width == 2 else 0  # stages 1-2's 16-bit copy sent to the device
            # made where the one-pass kernel steps the masters (it writes the copy); the estimate plans it regardless
            assert (r["uploads"] == r["groups"]) == bool(copy and host_adam.available()), r
            if copy and not host_adam.available():
                r = {**r, "host": r["host"] + copy * r["per_param_shards"]}
            # padding: at most N-1 elements per flat buffer (each group's shard, 4 bytes per element and per fp32
            # tensor kept per element); check_host_memory rounds up per parameter, hence the parameter count
            slack = (r["groups"] + r["params"]) * (WORLD - 1) * 16
            where = (r, est)
            assert _within(r["device_params"], est.device_params_bytes, slack), where
            assert _within(r["host"], est.host_bytes, slack), where
            # the engine's own host plan (the figure check_host_memory compares with MemAvailable) is the printed one
            plan = offload_host_bytes(r["per_param_shards"], 8, param_bytes=width if r["offload_param"] else 0,
                                      copy_bytes=copy)
            assert _within(plan, est.host_bytes, slack), where
            # every group's fp32 reduced shard is on the device before its copy leaves: their sizes add up to 4Ψ/N
            assert r["shard_copies"] == r["groups"], where
            assert _within(r["boundary_shards"], est.device_grads_bytes, slack), where
            if r["stage"] >= 2:  # stages 2-3 accumulate the micro-steps there: the whole shard at once
                assert _within(r["device_grads"], est.device_grads_bytes, slack), where
            else:  # stage 1 reduces at the boundary only: between micro-steps it holds the full gradients
                assert _within(r["device_grads"], width * r["psi"], slack), where


def _compare(psi: int, world: int, num_gpus: int, ds: dict) -> tuple[list[str], set[tuple[str, str]]]:
    """Our rows and DeepSpeed's side by side (bytes per rank); the (stages, figure) pairs that differ by more than 1%."""
    from hf_zero.planning.estimate import estimate_offload_memory

    lines = [f"{'stage':>5}  {'ours device':>14}  {'DS device':>14}  {'ours host/rank':>14}  {'DS host/rank':>14}"]
    differ: set[tuple[str, str]] = set()
    for key, stage, label in (("12", 2, "1-2"), ("3", 3, "3")):
        ours = estimate_offload_memory(psi, world, stage, "bf16", "adam")
        ds_host_per_rank, ds_device = ds[key][0] / num_gpus, ds[key][1]
        lines.append(f"{label:>5}  {ours.device_bytes:>14,}  {ds_device:>14,}  {ours.host_bytes:>14,}  "
                     f"{round(ds_host_per_rank):>14,}")
        for figure, a, b in (("device", ours.device_bytes, ds_device), ("host", ours.host_bytes, ds_host_per_rank)):
            if abs(a - b) > 0.01 * max(a, b):
                differ.add((label, figure))
    return lines, differ


def test_offload_rows_beside_deepspeeds_estimator(measured: list, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_zero.planning.estimate import estimate_offload_memory

    psi_small = measured[0][0]["psi"]  # the model whose bytes were measured above
    for psi, largest, gpus, nodes in [(psi_small, _largest_layer(_model()), WORLD, 1), (7_000_000_000, 131_072_000, 8, 2)]:
        ds = _deepspeed_rows(psi, largest, gpus, nodes)
        lines, differ = _compare(psi, gpus * nodes, gpus, ds)
        with capsys.disabled():
            print(f"\nΨ = {psi:,}, largest layer {largest:,}, {gpus} GPUs x {nodes} nodes, offload_optimizer cpu, bf16 Adam")
            print("\n".join(lines))
        # the differences the module docstring explains, and no others
        assert differ == {("1-2", "device"), ("1-2", "host"), ("3", "device"), ("3", "host")}, (differ, lines)
        ours2 = estimate_offload_memory(psi, gpus * nodes, 2, "bf16", "adam")
        ours3 = estimate_offload_memory(psi, gpus * nodes, 3, "bf16", "adam")
        # DeepSpeed's stage 1-2 device figure is ours without the fp32 gradient shard ...
        assert ds["12"][1] == ours2.device_params_bytes == ours2.device_bytes - ours2.device_grads_bytes, (ds, ours2)
        # ... and its stage-3 host figure is ours (up to our rounding of Ψ/N up) times its 1.5 buffer factor
        assert abs(ds["3"][0] / gpus - 1.5 * ours3.host_bytes) <= 1.5 * 16 * gpus * nodes, (ds, ours3)
