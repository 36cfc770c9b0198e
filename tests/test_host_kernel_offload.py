"""The offloaded step through the one-pass host kernel equals it through torch's kernel, bit for bit.

``hf_zero/zero/host_step.py`` steps Adam/AdamW host masters with ``hf_zero/optim/host_adam.py`` where it builds: one pass
that also writes stage 3's 16-bit host shard (``offload_param``: no cast pass at the publish; a speculative step into a
second shard that takes the first's place when the step stands) or stages 1-2's 16-bit
copy that is sent to the device (2 bytes an element over PCIe, not the master's 4), and steps ``super_offload``'s
speculative steps out of place (kept by swapping buffers, undone by not: no undo copy). The oracle is the same run with
``HF_ZERO_HOST_ADAM=0`` (torch's fused kernel, the cast on the device, a copy before each speculative step), on gloo ranks with a
tiny bf16 Llama: losses, gathered weights, masters and optimizer state must be equal (``torch.equal``) at stage 2 with
``super_offload`` (clipping that bites on some steps: speculation kept and undone), at stage 3 with optimizer and
parameter offload, and the same with ``overlap_param_gather`` and ``super_offload``. Each run with the kernel must
have used it for every host step, and written the host shards and the 16-bit copies (the publish's cast skipped), so
a quiet fallback fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import spawn

STEPS = 4
VOCAB = 64
# (name, stage, offload_param, super_offload, overlap_param_gather, gradient_clipping, accumulation steps). Norms on two
# ranks: stage 2's about 1.99, 2.34, 2.92, 1.58, stage 1's with accumulation 1.36, 1.59, 1.47, 1.20, so the clips bite
# on the middle two steps only; on one rank they bite on every step (the bf16 copies read scaled)
CASES = [("z2-super", 2, False, True, False, 2.1, 1), ("z3-param", 3, True, False, False, 1.0, 1),
         ("z3-param-super-overlap", 3, True, True, True, 0.0, 1),
         # accumulation: stage 1's bucket sums the micro-steps in bf16 (its copy may cross in bf16), stage 2 adds each
         # reduce to the last in fp32 (its copy stays fp32)
         ("z1-accum-super", 1, False, True, False, 1.45, 2), ("z2-accum", 2, False, False, False, 1.0, 2)]


def bf16_copies_expected(stage: int, gas: int, world: int) -> bool:
    """Where a reduced gradient holds only bf16 values: one rank, and not stage 2's fp32 sum of micro-steps."""
    return world == 1 and not (stage == 2 and gas > 1)


def _run(rank: int, world: int, kernel: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.optim import host_adam
    from hf_zero.zero import GatheredParameters
    from hf_zero.zero.offload import OffloadedFlatGroup, OffloadedShardedParamGroup

    assert host_adam.available() == kernel, host_adam.unavailable_reason()
    calls = {"kernel": 0, "written": 0, "uploads": 0, "spare": 0}
    real_step, real_written = host_adam.adam_step, OffloadedShardedParamGroup.host_shard_written
    real_upload = OffloadedFlatGroup.host_shard_written
    real_spare = {c: c.speculative_out16_written for c in (OffloadedFlatGroup, OffloadedShardedParamGroup)}

    def spare(self):  # noqa: ANN001, ANN202
        calls["spare"] += 1
        return real_spare[type(self)](self)

    def uploaded(self):  # noqa: ANN001, ANN202
        calls["uploads"] += 1
        return real_upload(self)

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["kernel"] += 1
        return real_step(*a, **k)

    def written(self):  # noqa: ANN001, ANN202
        calls["written"] += 1
        return real_written(self)

    host_adam.adam_step, OffloadedShardedParamGroup.host_shard_written = counted, written
    OffloadedFlatGroup.host_shard_written = uploaded
    OffloadedFlatGroup.speculative_out16_written = OffloadedShardedParamGroup.speculative_out16_written = spare
    out: dict = {}
    for name, stage, params, super_offload, overlap, clip, gas in CASES:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
        zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 40,
                "offload_optimizer": {"device": "cpu", "super_offload": super_offload},
                "overlap_param_gather": overlap}
        if params:
            zero["offload_param"] = {"device": "cpu"}
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
               "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.01}},
               "zero_optimization": zero, "steps_per_print": 10**6}
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        zo = engine.zero_optimizer
        before = dict(calls)
        losses = []
        for step in range(STEPS):
            for micro in range(gas):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                ids = torch.randint(0, VOCAB, (2, 8), generator=g)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        engine.wait_params()
        state: dict[str, torch.Tensor] = {}
        with GatheredParameters(list(model.parameters())):
            for n, p in model.named_parameters():
                state[f"w.{n}"] = p.detach().float().clone()
        for i, g in enumerate(g for g in zo.groups if g.master is not None):
            state[f"master.{i}"] = g.master.clone()
            for k, v in zo.optimizer.state.get(g.master, {}).items():
                state[f"state.{i}.{k}"] = v.clone()
        spec = getattr(zo.runner, "speculation", None)
        bf16_copies = sum(torch.bfloat16 in getattr(g, "_host_grads", {}) for g in zo.groups)
        out[name] = {"losses": losses, "state": {k: v.view(-1).tolist() for k, v in state.items()},
                     "kernel": calls["kernel"] - before["kernel"], "written": calls["written"] - before["written"],
                     "uploads": calls["uploads"] - before["uploads"], "spare": calls["spare"] - before["spare"],
                     "host_groups": sum(1 for g in zo.groups if g.master is not None), "bf16_copies": bf16_copies,
                     "widened": getattr(zo.runner, "_widened", None) is not None,
                     "counts": dict(spec.counts) if spec is not None else {}}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    from hf_zero.optim import host_adam

    if not host_adam.available():
        pytest.skip(f"the host kernel does not build here: {host_adam.unavailable_reason()}")
    mp = pytest.MonkeyPatch()
    out = {}
    try:
        for world in (2, 1):  # on one rank a reduced gradient may hold only bf16 values: it crosses in bf16
            out[f"on{world}"] = spawn(_run, world, True)[0]
        mp.setenv("HF_ZERO_HOST_ADAM", "0")
        for world in (2, 1):
            out[f"off{world}"] = spawn(_run, world, False)[0]
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("world", [2, 1])
def test_the_kernel_gives_torchs_bits(runs: dict, world: int) -> None:
    for name, rec in runs[f"on{world}"].items():
        ref = runs[f"off{world}"][name]
        assert rec["losses"] == ref["losses"], name
        assert rec["state"].keys() == ref["state"].keys(), name
        differ = [k for k in ref["state"] if rec["state"][k] != ref["state"][k]]
        assert differ == [], (name, differ[:5])


@pytest.mark.parametrize("world", [2, 1])
def test_the_kernel_took_every_host_step(runs: dict, world: int) -> None:
    for name, rec in runs[f"on{world}"].items():
        _, stage, params, super_offload, _, clip, gas = next(c for c in CASES if c[0] == name)
        counts = rec["counts"]
        # every group's step (speculative ones included, and those stepped again after an undo) went through it
        assert rec["kernel"] >= STEPS * rec["host_groups"], (name, rec["kernel"], rec["host_groups"])
        assert runs[f"off{world}"][name]["kernel"] == 0 and runs[f"off{world}"][name]["bf16_copies"] == 0, name
        # one rank: the gradient copies crossed in bf16, but stage 2's fp32 sum of micro-steps (two ranks: fp32)
        assert (rec["bf16_copies"] > 0) == bf16_copies_expected(stage, gas, world), (name, world, rec["bf16_copies"])
        # a clipped step read its bf16 copies widened in the runner's one reused buffer (every step clips on one rank)
        assert rec["widened"] == (bf16_copies_expected(stage, gas, world) and clip > 0), (name, world)
        if params:  # the host shards written in the kernel's pass, the publish's cast skipped
            assert rec["written"] > 0 or rec["spare"] > 0, name
        # every speculative step that stood wrote its 16-bit copy in its pass (stage 3: a second host shard that took
        # the first's place; stages 1-2 and stage 3's small parameters: the copy sent to the device)
        assert rec["spare"] == (counts["kept"] if super_offload else 0), (name, rec["spare"], counts)
        if stage < 3:  # every step of every group, speculative ones that stood included, sent its 16-bit copy
            assert rec["uploads"] == STEPS * rec["host_groups"], (name, rec["uploads"], rec["host_groups"])
            assert runs[f"off{world}"][name]["uploads"] == 0, name
        if super_offload:
            assert counts["stepped"] > 0, (name, counts)
            if clip and world == 2:  # (the clip was set from the two-rank norms)
                assert counts["undone"] > 0 and counts["kept"] > 0, (name, counts)  # both fates of a speculation


def test_only_torchs_own_adam_step_takes_the_kernel() -> None:
    """torch's Adam and AdamW and DeepSpeed's FusedAdam (which keeps their step) go through the kernel; a subclass with a
    step of its own keeps it, and so do AMSGrad and a grad of another dtype."""
    from hf_zero.optim import host_adam
    from hf_zero.optim.optimizers import FusedAdam
    from hf_zero.zero.host_step import fused_adam_group
    from hf_zero.zero.offload import use_host_kernels

    if not host_adam.available():
        pytest.skip(f"the host kernel does not build here: {host_adam.unavailable_reason()}")

    class Own(torch.optim.AdamW):
        def step(self, closure=None):  # noqa: ANN001, ANN202
            return super().step(closure)

    def takes(make, grad_dtype=torch.float32, **kw) -> bool:  # noqa: ANN001
        master = torch.zeros(40)
        opt = make([master], lr=1e-3, **kw)
        use_host_kernels(opt)
        return fused_adam_group(opt, master, torch.zeros(40, dtype=grad_dtype)) is not None

    assert takes(torch.optim.AdamW) and takes(torch.optim.Adam) and takes(FusedAdam)
    assert takes(torch.optim.AdamW, torch.bfloat16)
    assert not takes(Own)
    assert not takes(torch.optim.AdamW, amsgrad=True)
    assert not takes(torch.optim.AdamW, torch.float16)
