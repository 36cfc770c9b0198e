"""Stage 3 with ``overlap_param_gather`` and the optimizer offloaded: each unit's host step where its next gather is.

hf_zero/zero/unit_steps.py defers every stage-3 group's CPU optimizer step from ``engine.step()`` to the first gather
of the unit that follows it (in forward order, each gather stepping the groups before it that are not stepped yet).
The oracle is the same run without ``overlap_param_gather`` (the whole host step inside ``step()``), on 2 gloo ranks,
with a tiny Llama at stage 3 (its norms kept whole: buckets stepped at once), optimizer offload alone and with
parameter offload, an lr that moves every step (a deferred group steps with its own step's lr), clipping and
accumulation. Every reader right after a step must see the eager values bit for bit: the next forward (no grad), a
a block's ``state_dict()`` under ``GatheredParameters``, the whole model's gathered, DeepSpeed's ``safe_get_full_fp32_param``,
``save_16bit_model``, ``save_checkpoint`` / ``load_checkpoint``, the next training step. The deferred run must also
show that the gathers took the steps: after ``step()`` the units' groups are still to step, after the next forward
none is, and ``wait_all`` took none of them. A control with the gather's step taken out must differ.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.distributed import spawn

STEPS = 3
VOCAB = 64
# (optimizer offload only, or with offload_param; gradient accumulation steps; clipping)
CASES = [(False, 1, 1.0), (True, 2, 0.0), (True, 1, 0.5)]


def _flat(t: torch.Tensor) -> list[float]:
    return t.detach().float().reshape(-1).tolist()


def _run(rank: int, world: int, mode: str, tmp: str) -> dict:
    """``mode``: eager, overlap, or blind (overlap with the gathers' step taken out: the control)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.utils import safe_get_full_fp32_param
    from hf_zero.zero import unit_steps

    if mode == "blind":

        def gather(self, stream):  # noqa: ANN001, ANN202 - the deferred step left for wait_all, the gather reads stale
            self._published = None
            return super(unit_steps.DeferredUnitStep, self).gather(stream)

        unit_steps.DeferredUnitStep.gather = gather
    out: dict = {}
    for params, gas, clip in CASES:
        key = f"param{int(params)}-gas{gas}-clip{clip}"
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
        zero = {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 40,
                "offload_optimizer": {"device": "cpu"}, "overlap_param_gather": mode != "eager"}
        if params:
            zero["offload_param"] = {"device": "cpu"}
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.01}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 5e-3, "warmup_max_lr": 2e-2,
                                                            "warmup_num_steps": 20, "warmup_type": "linear"}},
               "zero_optimization": zero, "steps_per_print": 10**6}
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        zo = engine.zero_optimizer
        overlap = zo.overlap
        rec: dict = {"losses": [], "runner": type(zo.runner).__name__, "pending_after_step": [], "units": 0}
        if overlap is not None:
            rec["units"] = len(overlap.groups)
        ids = torch.randint(0, VOCAB, (STEPS * gas * world * 2, 8), generator=torch.Generator().manual_seed(3))
        ids = ids.reshape(STEPS * gas, world, 2, 8)[:, rank]
        ckpt = os.path.join(tmp, f"{mode}-{key}-ckpt")
        for step in range(STEPS):
            for micro in range(gas):
                batch = ids[step * gas + micro]
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                rec["losses"].append(loss.item())
            if overlap is not None:
                rec["pending_after_step"].append(sum(g.publish_pending for g in overlap.groups))
                before = overlap.waits["other"]
            if step == 0:  # the next forward, without grad, right after the step
                with torch.no_grad():
                    rec["next_forward"] = engine(input_ids=ids[0], labels=ids[0]).loss.item()
                if overlap is not None:
                    rec["pending_after_forward"] = sum(g.publish_pending for g in overlap.groups)
                    rec["wait_all_steps"] = overlap.waits["other"] - before
            if step == 1:  # the accessor first (a master read without a gather), then a block's state_dict gathered
                rec["fp32"] = _flat(safe_get_full_fp32_param(model.model.layers[2].mlp.up_proj.weight))
                block = model.model.layers[1]
                with hf_zero.zero.GatheredParameters(list(block.parameters())):
                    rec["block_state_dict"] = {n: _flat(t) for n, t in block.state_dict().items()}
                engine.save_checkpoint(ckpt, tag="t")
            if step == 2 and mode != "blind":
                with hf_zero.zero.GatheredParameters(list(model.parameters())):
                    rec["gathered"] = {n: _flat(p) for n, p in model.named_parameters()}
                engine.load_checkpoint(ckpt, tag="t")  # back to step 1's weights, over deferred steps
                batch = ids[0]
                rec["after_load"] = engine(input_ids=batch, labels=batch).loss.item()
        if mode != "blind":
            single = os.path.join(tmp, f"{mode}-{key}-single")
            engine.save_16bit_model(single)
            rec["saved"] = {n: _flat(t) for n, t in load_file(os.path.join(single, "model.safetensors")).items()}
        out[key] = rec
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return {mode: spawn(_run, 2, mode, tmp)[0] for mode in ("eager", "overlap", "blind")}


def test_every_reader_after_a_step_sees_the_eager_values(runs: dict) -> None:
    eager, overlap = runs["eager"], runs["overlap"]
    for key, rec in overlap.items():
        assert eager[key]["runner"] == "HostRunner" and rec["runner"] == "DeferredHostRunner", key
        for what in ("losses", "next_forward", "block_state_dict", "fp32", "gathered", "after_load",
                     "saved"):
            assert rec[what] == eager[key][what], f"{key}: {what} differs from the eager offloaded step"


def test_the_gathers_take_the_steps(runs: dict) -> None:
    for key, rec in runs["overlap"].items():
        n = rec["units"]
        assert n >= 4, (key, n)  # the embedding, three blocks (the head is tied... or the root unit's)
        # every unit's step is still to run when step() returns (a pending group is one not stepped) ...
        assert rec["pending_after_step"] == [n] * STEPS, key
        # ... and the next forward's gathers take them all, wait_all none
        assert rec["pending_after_forward"] == 0 and rec["wait_all_steps"] == 0, key


def test_the_comparison_catches_a_gather_that_skips_the_step(runs: dict) -> None:
    for key, rec in runs["blind"].items():
        ref = runs["eager"][key]
        assert rec["losses"][: len(ref["losses"]) // STEPS] == ref["losses"][: len(ref["losses"]) // STEPS], key
        assert rec["next_forward"] != ref["next_forward"], key  # read the weights from before the step


def _err(a: list[float], b: list[float]) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((x - y).norm() / y.norm().clamp_min(1e-12))


def gpu_suite(rank: int, world: int) -> list[dict]:
    """``tests/gpu/gpu_check.py``'s rows: the same runs on GPUs, where a deferred step's copy to the device shard rides the
    optimizer's stream and the gather's stream waits for its event (without ``offload_param``), or the host cast runs
    just before the gather's copy (with it). Errors against the eager offloaded step; a row whose gathers did not take
    the steps fails."""
    import torch.distributed as dist

    tmp = os.path.join(tempfile.gettempdir(), "hf_zero_gpu_unit_steps")
    if rank == 0:
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    eager, overlap = _run(rank, world, "eager", tmp), _run(rank, world, "overlap", tmp)
    rows = []
    for key, rec in overlap.items():
        ref = eager[key]
        took = rec["pending_after_step"] == [rec["units"]] * STEPS and rec["pending_after_forward"] == 0
        loss = max(_err(rec[w] if isinstance(rec[w], list) else [rec[w]], ref[w] if isinstance(ref[w], list) else [ref[w]])
                   for w in ("losses", "next_forward", "after_load"))
        weights = max([_err(rec["fp32"], ref["fp32"])] + [_err(rec[w][n], ref[w][n]) for w in ("gathered", "saved")
                                                         for n in ref[w]])
        rows.append({"case": f"stage 3 deferred unit steps, {key}", "loss_err": loss if took else float("inf"),
                     "w_err": weights})
    return rows


def _trainer_run(rank: int, world: int, cases: list) -> list:
    """tests/test_trainer.py's run, each case's record with the deferred steps the units' gathers took."""
    from hf_zero.zero import unit_steps
    from tests import test_trainer

    taken = [0]
    real = unit_steps.DeferredUnitStep.run_deferred_step

    def counted(self):  # noqa: ANN001, ANN202
        taken[0] += self._deferred is not None
        return real(self)

    unit_steps.DeferredUnitStep.run_deferred_step = counted
    out = []
    for case in cases:
        before = taken[0]
        out.append({**test_trainer._run(rank, world, [case])[0], "deferred_steps": taken[0] - before})
    return out


def test_trainer_life_matches_the_eager_offloaded_step(tmp_path: object) -> None:
    """hf_zero's Trainer over the whole life (train with evaluation and a checkpoint every 3 steps, the best checkpoint
    loaded at the end, predict, save_model), tests/test_trainer.py's run on 2 ranks at stage 3 with the optimizer and the
    parameters offloaded: with overlap_param_gather and super_offload (each unit's host step taken by its next gather,
    the speculative steps during backward) it logs the losses and ends with the weights, best checkpoint and saved
    model of the same run without them."""
    from safetensors.torch import load_file

    def case(name: str, deferred: bool) -> dict:
        section = {"stage": 3, "stage3_param_persistence_threshold": 40, "overlap_param_gather": deferred,
                   "offload_optimizer": {"device": "cpu", "super_offload": deferred}, "offload_param": {"device": "cpu"}}
        zero = {"zero_optimization": section, "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
        return {"dir": os.path.join(str(tmp_path), name), "zero": zero, "best": True, "save_model": True}

    eager, deferred = spawn(_trainer_run, 2, [case("eager", False), case("deferred", True)])[0]
    assert eager["deferred_steps"] == 0 and deferred["deferred_steps"] > 0, (eager["deferred_steps"], deferred["deferred_steps"])
    assert sorted(eager["losses"]) == ["1", "2", "3", "4", "5", "6"], eager["losses"]
    assert deferred["losses"] == eager["losses"]
    assert deferred["weights"] == eager["weights"]
    assert os.path.basename(deferred["best"]) == os.path.basename(eager["best"])
    assert deferred["predict_shape"] == eager["predict_shape"]
    a = load_file(os.path.join(deferred["saved"], "model.safetensors"))
    b = load_file(os.path.join(eager["saved"], "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def _streamed(rank: int, world: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.zero import offload

    offload.check_host_memory = lambda needed, group, streamed=None: True  # host memory "short" of the gradient copies
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "overlap_param_gather": True, "offload_optimizer": {"device": "cpu"}},
           "steps_per_print": 10**6}
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    zo = engine.zero_optimizer
    return {"streamed": zo.stream_grads, "overlap": zo.overlap is not None, "runner": type(zo.runner).__name__}


def test_streamed_gradients_take_the_step_whole() -> None:
    """Host memory short of a gradient copy per group: the fp32 gradient shards wait on the GPU until their step, so
    the stage-3 deferral, which would keep them all there into the next forward, is not built."""
    for rec in spawn(_streamed, 2):
        assert rec == {"streamed": True, "overlap": False, "runner": "HostRunner"}, rec
