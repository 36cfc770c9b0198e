"""``zero_optimization.overlap_param_gather``: the step's parameter all-gather waited for in the next forward.

On 2 gloo processes a tiny Llama trains at stages 1 and 2 (fp32 and bf16, with and without
accumulation, an untied and a tied LM head) three ways: the eager publish, the deferred one
(gloo's ``async_op`` handles), and the deferred one with *lazy* handles, whose all-gather runs
only when the handle is waited for. The lazy run is the worst case a GPU can produce: any reader
that skips its wait sees the other rank's half of the weights from before the step. Every reader
is exercised right after a step (the next forward, a block's and the model's ``state_dict()``,
``GatheredParameters``, ``save_16bit_model``, ``load_checkpoint``; and the Trainer's train, evaluate,
load-best and save) and must give bit-identical values to the eager run;
a control run with the forward hooks taken off must differ, which shows the comparison catches
a missing wait. The deferred run also shows who waited: every group is still in flight when
``step()`` returns and the forward's pre-hooks, not a full wait, take them.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.distributed import spawn

STEPS = 4
# (zero stage, bf16, gradient accumulation steps, tied LM head)
CASES = [(2, False, 1, False), (2, True, 2, True), (1, True, 1, False), (1, False, 2, True)]


def _lazy_all_gather() -> None:
    """Make every ``async_op`` all-gather of ``hf_zero/zero/collectives.py`` run only when its handle is waited for."""
    from hf_zero.zero import collectives as C

    real = C._all_gather

    class Lazy:
        def __init__(self, out: torch.Tensor, shard: torch.Tensor, group: object) -> None:
            self.args = (out, shard, group)

        def wait(self) -> bool:
            out, shard, group = self.args
            real(out, shard, group=group)
            return True

    def gather(out: torch.Tensor, shard: torch.Tensor, group: object = None, async_op: bool = False) -> object:
        if async_op:
            return Lazy(out, shard, group)
        return real(out, shard, group=group)

    C._all_gather = gather


def _flat(t: torch.Tensor) -> list[float]:
    return t.detach().float().reshape(-1).tolist()


def _run(rank: int, world: int, mode: str, tmp: str) -> dict:
    """``mode``: eager, overlap, lazy or lazy-no-hooks, optionally with ``+offload`` (the optimizer in host memory, its
    CPU step deferred as well) or ``+streamed`` (offloaded, the gradients streamed from the device at the step)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.zero import offload as zero_offload

    mode, _, offload = mode.partition("+")
    real_check = zero_offload.check_host_memory
    if offload == "streamed":  # host memory "too short" for a gradient copy per group (restored on the way out)
        zero_offload.check_host_memory = lambda needed, group, streamed=None: True
    if mode in ("lazy", "lazy-no-hooks"):
        _lazy_all_gather()
    out: dict = {}
    for stage, bf16, gas, tied in CASES:
        key = f"s{stage}-bf16{int(bf16)}-gas{gas}-tied{int(tied)}"
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                             tie_word_embeddings=tied))
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}, "bf16": {"enabled": bf16},
               # small buckets: groups that hold parts of two blocks, or a block and the embedding or the head
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                     "overlap_param_gather": mode != "eager"},
               "steps_per_print": 10**6}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            # the lr moves every step: a deferred group must step with its own step's lr, not the next one's
            cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 5e-3, "warmup_max_lr": 2e-2,
                                                               "warmup_num_steps": 20, "warmup_type": "linear"}}
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        zo = engine.zero_optimizer
        overlap = zo.overlap
        assert (overlap is None) == (mode == "eager")
        assert zo.stream_grads == (offload == "streamed")
        stepped: list[int] = []  # the torch optimizer's step() calls (offloaded: one per group)

        def counted(*a: object, real: object = zo.optimizer.step, stepped: list = stepped, **k: object) -> object:
            stepped.append(1)
            return real(*a, **k)

        zo.optimizer.step = counted
        if mode == "lazy-no-hooks":
            for h in overlap.forward_hooks:
                h.remove()
        seen_pending: list[str] = []

        def check(m: torch.nn.Module, args: object, zo: object = zo, seen_pending: list = seen_pending) -> None:
            # registered after the engine's hooks: a module about to run must find its own weights gathered
            for p in m.parameters(recurse=False):
                g = zo.group_of(p)
                if g is not None and g.publish_pending:
                    seen_pending.append(type(m).__name__)

        checks = [m.register_forward_pre_hook(check) for m in model.modules()] if mode == "overlap" else []
        ids = torch.randint(0, 64, (STEPS * gas * world * 2, 8), generator=torch.Generator().manual_seed(3))
        ids = ids.reshape(STEPS * gas, world, 2, 8)[:, rank]  # (tests/gpu/gpu_check.py runs this on any number of GPUs)
        rec: dict = {"losses": [], "in_flight_after_step": [], "forward_waits": [], "groups": len(zo.flat_groups)}
        ckpt = os.path.join(tmp, f"{mode}-{key}-ckpt")
        for step in range(STEPS):
            for micro in range(gas):
                batch = ids[step * gas + micro]
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                rec["losses"].append(loss.item())
            if overlap is not None:
                rec["in_flight_after_step"].append(sum(g.publish_pending for g in zo.flat_groups))
                before = dict(overlap.waits)
            rec.setdefault("optimizer_steps_at_return", []).append(len(stepped))
            # each reader right after a step, before any forward
            if step == 0:
                with torch.no_grad():
                    rec["next_forward"] = engine(input_ids=ids[0], labels=ids[0]).loss.item()
                if overlap is not None:
                    rec["forward_waits"].append({k: overlap.waits[k] - before[k] for k in before})
                rec["optimizer_steps_after_forward"] = len(stepped)
                if mode == "lazy-no-hooks":
                    break  # the control: only the forward that skipped its waits
            if step == 1:  # a block's own state_dict first (its pre-hook waits too), then the model's
                rec["block_state_dict"] = {n: _flat(t) for n, t in model.model.layers[1].state_dict().items()}
                rec["state_dict"] = {n: _flat(t) for n, t in model.state_dict().items() if "rotary" not in n}
                engine.save_checkpoint(ckpt, tag="t")
            if step == 2:
                with hf_zero.zero.GatheredParameters(list(model.parameters())):
                    rec["gathered"] = {n: _flat(p) for n, p in model.named_parameters()}
                engine.load_checkpoint(ckpt, tag="t")  # back to step 1's weights, over a publish in flight
        if mode != "lazy-no-hooks":
            single = os.path.join(tmp, f"{mode}-{key}-single")
            engine.save_16bit_model(single)
            rec["saved"] = {n: _flat(t) for n, t in load_file(os.path.join(single, "model.safetensors")).items()}
        engine.wait_params()
        rec["pending_seen_by_modules"] = seen_pending
        for h in checks:
            h.remove()
        out[key] = rec
    zero_offload.check_host_memory = real_check
    return out


MODES = ("eager", "overlap", "lazy", "lazy-no-hooks")
OFFLOAD = ("+offload", "+streamed")


@pytest.fixture(scope="module")
def runs() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        modes = [*MODES, *(m + o for o in OFFLOAD for m in MODES if m != "lazy-no-hooks"), "lazy-no-hooks+offload"]
        return {mode: spawn(_run, 2, mode, tmp)[0] for mode in modes}


@pytest.mark.parametrize("offload", ["", *OFFLOAD])
def test_every_reader_after_a_step_sees_the_eager_values(runs: dict, offload: str) -> None:
    # offloaded: the optimizer's CPU step of each group runs where the next forward first reads it, with the lr of
    # the step that deferred it; every reader sees what the eager offloaded step gives (streamed gradients: the
    # same losses as a gradient copy per group as well)
    eager = runs["eager" + offload]
    for mode in ("overlap", "lazy"):
        for key, rec in runs[mode + offload].items():
            ref = eager[key]
            for what in ("losses", "next_forward", "block_state_dict", "state_dict", "gathered", "saved"):
                assert rec[what] == ref[what], f"{mode}{offload} {key}: {what} differs from the eager publish"
    if offload == "+streamed":
        for key, rec in eager.items():
            assert rec["losses"] == runs["eager+offload"][key]["losses"], key


@pytest.mark.parametrize("offload", ["", "+offload"])
def test_the_comparison_catches_a_missing_wait(runs: dict, offload: str) -> None:
    eager, blind = runs["eager" + offload], runs["lazy-no-hooks" + offload]
    for key, rec in blind.items():
        # the forward after a step read the other rank's half from before the step (offloaded: most groups of
        # this rank's half were not even stepped yet)
        assert rec["losses"] == eager[key]["losses"][: len(rec["losses"])], key
        assert rec["next_forward"] != eager[key]["next_forward"], key


@pytest.mark.parametrize("offload", ["", *OFFLOAD])
def test_the_forward_hooks_do_the_waiting(runs: dict, offload: str) -> None:
    for key, rec in runs["overlap" + offload].items():
        n = rec["groups"]
        assert n >= 6, (key, n)
        # every group is still in flight when step() returns ...
        assert rec["in_flight_after_step"] == [n] * STEPS, key
        # ... and the forward's pre-hooks take every one of them, before any module reads its weights
        assert rec["forward_waits"] == [{"forward": n, "other": 0}], key
        assert rec["pending_seen_by_modules"] == [], key
        if offload:
            # the CPU optimizer ran for one group inside step() (the forward's first; a scheduler sees a step
            # taken) and for every other group inside the next forward, one group per optimizer.step() call
            assert rec["optimizer_steps_at_return"] == [k * n + 1 for k in range(STEPS)], key
            assert rec["optimizer_steps_after_forward"] == n, key
    if offload:
        for key, rec in runs["eager" + offload].items():  # the eager offloaded step: every group inside step()
            assert rec["optimizer_steps_at_return"] == [(k + 1) * rec["groups"] for k in range(STEPS)], key


def _trainer(rank: int, world: int, cases: list, lazy: bool) -> list:
    from tests import test_trainer

    if lazy:
        _lazy_all_gather()
    return test_trainer._run(rank, world, cases)


@pytest.mark.parametrize("offload", [False, True])
def test_trainer_train_evaluate_load_best_and_save_match_the_eager_publish(tmp_path: object, offload: bool) -> None:
    # tests/test_trainer.py's run: 6 steps of 2 micro-batches, evaluation and a checkpoint every 3 steps, the best
    # checkpoint loaded at the end, predict, save_model; here at stage 2 with lazy gathers against the eager publish
    # (offloaded: the CPU step deferred too, under the Trainer's linear-decay scheduler, zero_grad and checkpoints)
    def case(name: str, overlap: bool) -> dict:
        section = {"stage": 2, "reduce_bucket_size": 3000, "overlap_param_gather": overlap,
                   **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        zero = {"zero_optimization": section,
                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
        return {"dir": os.path.join(str(tmp_path), name), "zero": zero, "best": True, "save_model": True}

    eager = spawn(_trainer, 2, [case("eager", False)], False)[0][0]
    lazy = spawn(_trainer, 2, [case("lazy", True)], True)[0][0]
    assert sorted(eager["losses"]) == ["1", "2", "3", "4", "5", "6"], eager["losses"]
    assert lazy["losses"] == eager["losses"]
    assert lazy["weights"] == eager["weights"]
    assert os.path.basename(lazy["best"]) == os.path.basename(eager["best"])
    from safetensors.torch import load_file

    a = load_file(os.path.join(lazy["saved"], "model.safetensors"))
    b = load_file(os.path.join(eager["saved"], "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
