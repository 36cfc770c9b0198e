"""Pipeline resume checkpoints (CPU, gloo): exact resume, resharding, consolidation, refusals.

The oracle for exact resume is the same pipeline trained without interruption: 3 steps, save,
a fresh engine loads, 3 more steps must give the losses, weights and learning rates of 6
uninterrupted steps bit for bit (fp32, 1F1B). Across layouts (another data-parallel degree,
another number of stages, a plain ``ZeroEngine`` of the same transformers model and back) the
arithmetic is grouped differently, so those agree to 1e-5. The global batch is 8 sequences in
every layout. One spawn per world size runs everything of that size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.distributed import spawn
from tests.test_pipe import MODELS, _rel

STEPS, K, MB, SEQ, GB = 6, 3, 2, 6, 8
TOL = 1e-5


def _data() -> torch.Tensor:
    return torch.randint(0, 32, (STEPS, GB, SEQ), generator=torch.Generator().manual_seed(5))


def _config(model: str, micro: int, zero: int, pipe: bool, bf16: bool = False) -> tuple[dict, dict]:
    """The engine config and the extra initialize() arguments: Llama with the config's AdamW and
    WarmupLR, GPT-2 with a torch SGD and LambdaLR (whose per-group lists must follow the groups)."""
    cfg: dict = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": micro, "gradient_clipping": 0.5,
                 "zero_optimization": {"stage": zero, "reduce_bucket_size": 200}, "steps_per_print": 10**6}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if pipe:
        cfg["pipeline"] = {"schedule": "1f1b"}
    if model == "gpt2":
        return cfg, {"optimizer": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
                     "lr_scheduler": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}}
    return cfg, {}


class _Run:
    """A pipeline (``stages`` > 0) or plain engine over the global batch: ``step(t)`` trains on batch t."""

    def __init__(self, model: str, stages: int, zero: int = 0, bf16: bool = False) -> None:
        import torch.distributed as dist

        import hf_zero
        from hf_zero.pipe import split_causal_lm

        world = dist.get_world_size()
        self.stages = stages
        self.dp = world // stages if stages else world
        self.micro = GB // (MB * self.dp)
        cfg, extra = _config(model, self.micro, zero, bool(stages), bf16)
        module = split_causal_lm(MODELS[model](), stages) if stages else MODELS[model]()
        self.engine, _, _, _ = hf_zero.initialize(model=module, config=cfg, **extra)
        self.d = module.dp_rank if stages else dist.get_rank()
        self.ids = _data()

    def step(self, t: int) -> float:
        import torch.distributed as dist

        rows = [self.ids[t, (self.d * self.micro + i) * MB:(self.d * self.micro + i + 1) * MB] for i in range(self.micro)]
        if self.stages:
            return float(self.engine.train_batch(iter([(r, r) for r in rows])))
        total = torch.zeros(())
        for r in rows:
            loss = self.engine(input_ids=r, labels=r).loss
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach() / self.micro
        dist.all_reduce(total)
        return float(total) / self.dp

    def train(self, start: int, stop: int) -> list[float]:
        return [self.step(t) for t in range(start, stop)]

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.engine.module.named_parameters()}


def _exact(model: str, stages: int, zero: int, root: Path, bf16: bool = False) -> dict:
    """6 steps uninterrupted; 3, save, fresh engine, load, 3 more: equal bit for bit."""
    ref = _Run(model, stages, zero, bf16)
    losses = ref.train(0, STEPS)
    first = _Run(model, stages, zero, bf16)
    first.train(0, K)
    first.engine.save_checkpoint(str(root), client_state={"model": model, "step": K})
    again = _Run(model, stages, zero, bf16)
    path, client = again.engine.load_checkpoint(str(root))
    out = {"client": client, "path": Path(path).name, "losses": again.train(K, STEPS), "ref": losses[K:],
           "weights_equal": all(torch.equal(p, ref.weights()[n]) for n, p in again.weights().items()),
           "lr": again.engine.get_lr() == ref.engine.get_lr(), "all_ref": losses}
    tied = dict(again.engine.module.named_parameters()).get("transformer.wte.weight")
    if tied is not None:
        out["wte"] = tied.reshape(-1)[:64].tolist()
    return out


def _refused(run: _Run, load_dir: str) -> str:
    """The sentence load_checkpoint raises (else what it returned); the weights must be untouched."""
    before = run.weights()
    try:
        msg = f"returned {run.engine.load_checkpoint(load_dir)!r}"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    assert all(torch.equal(p, before[n]) for n, p in run.weights().items()), msg
    return msg


def _world2(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_zero.launch.cli import main as cli

    out: dict = {}
    base = Path(root)
    for model in ("llama", "gpt2"):
        res = _exact(model, 2, 0, base / model)
        ref_losses = res["all_ref"]
        # the checkpoint's weights, consolidated offline, load with from_pretrained and equal the stages'
        at_k = _Run(model, 2)
        at_k.engine.load_checkpoint(str(base / model))
        if rank == 0:
            assert cli(["consolidate", str(base / model), str(base / f"{model}-hf")]) == 0
        dist.barrier()
        hf = dict(AutoModelForCausalLM.from_pretrained(str(base / f"{model}-hf")).named_parameters())
        res["consolidated_equal"] = all(torch.equal(p, hf[n]) for n, p in at_k.weights().items())
        # load_module_only: the weights and nothing else
        only = _Run(model, 2)
        only.engine.load_checkpoint(str(base / model), load_module_only=True)
        res["module_only"] = [all(torch.equal(p, at_k.weights()[n]) for n, p in only.weights().items()),
                              only.engine.global_steps, len(only.engine.zero_optimizer.optimizer.state)]
        # pipeline checkpoint -> plain engine (ZeRO-1 over both ranks) of the same model
        flat = _Run(model, 0, 1)
        flat.engine.load_checkpoint(str(base / model))
        res["to_flat"] = [abs(a - b) / abs(b) for a, b in zip(flat.train(K, STEPS), ref_losses[K:])]
        ref_w = _Run(model, 2)
        ref_w.train(0, STEPS)
        mine = ref_w.weights()
        res["to_flat_w"] = max(_rel(p, mine[n]) for n, p in flat.weights().items() if n in mine)
        if model == "llama":  # and into ZeRO-3, whose shards are cut from the same names
            flat3 = _Run(model, 0, 3)
            flat3.engine.load_checkpoint(str(base / model))
            res["to_flat"] += [abs(a - b) / abs(b) for a, b in zip(flat3.train(K, STEPS), ref_losses[K:])]
        # plain engine checkpoint -> pipeline
        flat = _Run(model, 0, 1)
        flat.train(0, K)
        flat.engine.save_checkpoint(str(base / f"{model}-flat"))
        back = _Run(model, 2)
        back.engine.load_checkpoint(str(base / f"{model}-flat"))
        res["from_flat"] = [abs(a - b) / abs(b) for a, b in zip(back.train(K, STEPS), ref_losses[K:])]
        res["from_flat_w"] = max(_rel(p, mine[n]) for n, p in back.weights().items())
        out[model] = res

    # refusals: one sentence on every rank, nothing loaded
    llama = _Run("llama", 2)
    if rank == 0:  # a checkpoint whose lm_head (on stage 1 only) has another shape
        shutil.copytree(base / "llama", base / "bad-shape")
        meta_path = base / "bad-shape" / "global_step3" / "checkpoint.json"
        meta = json.loads(meta_path.read_text())
        meta["params"]["lm_head.weight"]["shape"] = [33, 16]
        meta_path.write_text(json.dumps(meta))
    dist.barrier()
    out["errors"] = [
        _refused(llama, str(base / "gpt2")),  # another model
        _refused(llama, str(base / "bad-shape")),  # found by stage 1 only
        _refused(_Run("llama2", 2), str(base / "llama")),  # layers no stage of this model holds
        _refused(llama, str(base / "nothing")),
    ]
    return out


def _world4(rank: int, world: int, root: str) -> dict:
    base = Path(root)
    out = {model: _exact(model, 2, 1, base / f"{model}-2x2") for model in ("llama", "gpt2")}
    # ZeRO-2 inside the pipeline (each stage's gradients reduce-scattered every micro-batch), and
    # bf16 compute with fp32 masters: the same exact resume
    out["llama-zero2"] = _exact("llama", 2, 2, base / "llama-2x2-zero2")
    out["gpt2-zero2-bf16"] = _exact("gpt2", 2, 2, base / "gpt2-2x2-zero2-bf16", bf16=True)
    # another data-parallel degree: the 2 stages x 1 checkpoint into 2 stages x 2 (ZeRO-1)
    wider = _Run("llama", 2, 1)
    wider.engine.load_checkpoint(str(base / "llama"))
    out["dp_1_to_2"] = wider.train(K, STEPS)
    # another number of stages: the 2 x 2 checkpoint into 4 stages x 1
    deeper = _Run("llama", 4)
    deeper.engine.load_checkpoint(str(base / "llama-2x2"))
    out["stages_2_to_4"] = deeper.train(K, STEPS)
    return out


def _check_exact(res: dict) -> None:
    assert res["client"] == {"model": res["client"]["model"], "step": K} and res["path"] == f"global_step{K}", res
    assert res["losses"] == res["ref"], res  # bit for bit
    assert res["weights_equal"] and res["lr"], res


def test_pipeline_resume_reshard_consolidate_and_refusals(tmp_path: Path) -> None:
    two = spawn(_world2, 2, str(tmp_path))
    for model in ("llama", "gpt2"):
        for r in two:
            res = r[model]
            _check_exact(res)
            assert res["consolidated_equal"], model
            assert res["module_only"] == [True, 0, 0], (model, res["module_only"])
            assert max(res["to_flat"]) < TOL and res["to_flat_w"] < TOL, (model, res["to_flat"], res["to_flat_w"])
            assert max(res["from_flat"]) < TOL and res["from_flat_w"] < TOL, (model, res["from_flat"], res["from_flat_w"])
    # the tied embedding / LM head is stored once and loaded into both stages, equal after more steps
    assert two[0]["gpt2"]["wte"] == two[1]["gpt2"]["wte"]
    meta = json.loads((tmp_path / "gpt2" / "global_step3" / "checkpoint.json").read_text())
    assert meta["pipeline"]["num_stages"] == 2 and "transformer.wte.weight" in meta["params"]
    assert len(meta["params"]) == len(dict(MODELS["gpt2"]().named_parameters()))
    ranks = [json.loads((tmp_path / "gpt2" / "global_step3" / f"rank0000{r}.json").read_text()) for r in (0, 1)]
    assert "master|transformer.wte.weight" in ranks[0]["ranges"] and ranks[0]["stage"] == 0
    assert not any("transformer.wte.weight" in k for k in ranks[1]["ranges"]) and ranks[1]["stage"] == 1
    errors = [r["errors"] for r in two]
    assert errors[0] == errors[1], errors  # the same sentence on every rank, even when one stage found it
    another, shape, layers, nothing = errors[0]
    assert another.startswith("CheckpointError:") and "different model" in another, another
    assert "'lm_head.weight' has shape [33, 16] there and [32, 16] here" in shape, shape
    assert "different model" in layers and "model.layers.2" in layers, layers
    assert nothing == "returned (None, None)", nothing  # no checkpoint there yet: DeepSpeed's warning and (None, None)

    ref = two[0]["llama"]["all_ref"][K:]
    four = spawn(_world4, 4, str(tmp_path))
    for r in four:
        for name in ("llama", "gpt2", "llama-zero2", "gpt2-zero2-bf16"):
            _check_exact(r[name])
    for name, stage, dtype in (("llama-2x2-zero2", 2, "float32"), ("gpt2-2x2-zero2-bf16", 2, "bfloat16")):
        meta = json.loads((tmp_path / name / "global_step3" / "checkpoint.json").read_text())
        assert (meta["zero_stage"], meta["compute_dtype"], meta["pipeline"]["data_parallel"]) == (stage, dtype, 2), meta
        assert max(abs(a - b) / abs(b) for a, b in zip(r["dp_1_to_2"], ref)) < TOL, (r["dp_1_to_2"], ref)
    ref22 = four[0]["llama"]["all_ref"][K:]
    for r in four:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["stages_2_to_4"], ref22)) < TOL, (r["stages_2_to_4"], ref22)
