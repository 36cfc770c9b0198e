"""NVMe offload (ZeRO-Infinity, ``"device": "nvme"``; hf_zero/zero/nvme.py) on CPU ranks over gloo.

The oracle is the same run with ``"device": "cpu"``: both step the same fused CPU Adam on the same host masters
group by group, so NVMe may differ only in where the masters, the optimizer state and stage 3's 16-bit shards wait
between steps (files under ``nvme_path``), and the runs must agree bit for bit: losses and weights after several
steps with gradient accumulation and clipping, at stages 2 and 3 (stage 3 with both offload sections on NVMe, with a
``max_in_cpu`` that keeps some shards in memory and sends the rest to disk), and across a resume (save after K steps,
load in a fresh NVMe engine, in a "cpu" engine, and at another world size). Between steps the masters really are
gone from host memory (``numel() == 0``) and their files are there. The failures: a missing and a read-only
``nvme_path`` and a full disk (an injected ENOSPC from the writer on one rank) each stop every rank with one sentence
naming the path, without a hang, and leave the last checkpoint intact; a rank killed (SIGKILL) while the swap
writes stops the other with the peer-failure sentence, and the rerun resumes from the last checkpoint, naming the
killed run's leftover folder without reading it. hf_zero's Trainer trains and resumes with transformers' ZeRO-3 NVMe
config shape; DeepSpeed's accessors, GatheredParameters edits and ``save_16bit_model`` see the swapped state; and
``benchmarks/bench.py``'s hf2nvme / hf3nvme configs run; and NVMe equals "cpu" inside a pipeline, under AutoTP
and with hybrid sharding.

:func:`gpu_suite` runs the NVMe-vs-cpu comparison under NCCL on GPUs (``tests/gpu/gpu_check.py`` registers it).
"""

from __future__ import annotations

import glob
import os
import tempfile

import pytest
import torch

from tests.distributed import spawn

VOCAB = 64


def _model():  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _config(stage: int, device: str, nvme_path: str | None, gas: int = 2, clip: float = 0.5, params: bool = False,
            max_in_cpu: int = 0, dtype: str | None = None, optimizer_device: str | None = None) -> dict:
    zo: dict = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 40}
    off: dict = {"device": optimizer_device or device, "pin_memory": True}
    if off["device"] == "nvme":
        off.update(nvme_path=nvme_path, buffer_count=3)
    zo["offload_optimizer"] = off
    if params:
        par: dict = {"device": device, "pin_memory": True}
        if device == "nvme":
            par.update(nvme_path=nvme_path, buffer_count=2, max_in_cpu=max_in_cpu)
        zo["offload_param"] = par
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "zero_optimization": zo, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "aio": {"block_size": 8192, "queue_depth": 4, "thread_count": 2, "single_submit": False}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _batch(step: int, micro: int, rank: int, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def _weights(engine) -> torch.Tensor:  # noqa: ANN001
    from hf_zero.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return torch.cat([p.detach().float().cpu().reshape(-1) for p in params])


def _train(engine, steps: range, gas: int, rank: int) -> list[float]:  # noqa: ANN001
    losses = []
    for t in steps:
        for k in range(gas):
            loss = engine(**_batch(t, k, rank, str(engine.device))).loss
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return losses


def _swapped_out(engine) -> dict:  # noqa: ANN001
    """Between steps: every trainable group's master and its Adam moments hold no memory, and their files exist."""
    zo = engine.zero_optimizer
    runner = zo.runner
    masters = [g.master for g in zo.groups if g.master is not None]
    state = [v for m in masters for v in zo.optimizer.state.get(m, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    if runner.swap is None:  # offload_optimizer on "cpu", offload_param on NVMe: the masters stay in host memory
        out = {"runner": type(runner).__name__, "masters": len(masters), "files": 0, "moments": len(state),
               "in_memory": all(m.numel() > 0 for m in masters)}
    else:
        files = glob.glob(os.path.join(runner.swap.folder.path, "group*.bin"))
        out = {"runner": type(runner).__name__, "masters": len(masters), "files": len(files),
               "empty": all(m.numel() == 0 for m in masters) and all(v.numel() == 0 for v in state), "moments": len(state)}
    if runner.params is not None:
        out["param_files"] = len(glob.glob(os.path.join(runner.params.folder.path, "shard*.bin")))
        out["params_on_disk"] = len(runner.params.on_disk)
        out["kept_in_cpu"] = runner.params.kept
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# stage, gas, clip, offload_param, max_in_cpu, offload_optimizer's device on the NVMe side
CASES = [(2, 2, 0.5, False, 0, "nvme"), (3, 2, 0.5, True, 0, "nvme"), (3, 1, 0.0, True, 2000, "nvme"),
         (1, 2, 0.0, False, 0, "nvme"), (3, 2, 0.5, True, 0, "cpu")]


def _grid(rank: int, world: int, root: str) -> dict:
    import hf_zero

    out: dict = {"cases": []}
    for stage, gas, clip, params, max_in_cpu, opt in CASES:
        row: dict = {"case": [stage, gas, clip, params, max_in_cpu, opt]}
        runs = {}
        for device in ("cpu", "nvme"):
            engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, device, root, gas, clip, params, max_in_cpu,
                                                                            optimizer_device=opt if device == "nvme" else None))
            losses = _train(engine, range(3), gas, rank)
            if device == "nvme":
                row["swapped"] = _swapped_out(engine)
            runs[device] = (losses, _weights(engine))
            engine.destroy()
        row["loss_equal"] = runs["cpu"][0] == runs["nvme"][0]
        row["w_equal"] = bool(torch.equal(runs["cpu"][1], runs["nvme"][1]))
        row["w_moved"] = _rel(runs["cpu"][1], _weights_of_fresh()) > 1e-3
        out["cases"].append(row)
    out["left"] = sorted(os.listdir(root))  # engine.destroy() removed every run's folder
    return out


def _weights_of_fresh() -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in _model().parameters()])


@pytest.mark.parametrize("world", [2])
def test_nvme_offload_trains_bit_for_bit_like_cpu_offload(world: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        r = spawn(_grid, world, root)[0]
    for row in r["cases"]:
        assert row["loss_equal"] and row["w_equal"] and row["w_moved"], row
        sw = row["swapped"]
        stage, _, _, params, max_in_cpu, opt = row["case"]
        if opt == "nvme":
            assert sw["runner"] == "NvmeRunner" and sw["empty"] and sw["files"] == sw["masters"] > 0, row
        else:
            assert sw["runner"] == "NvmeRunner" and sw["in_memory"] and sw["files"] == 0, row
        assert sw["moments"] == 2 * sw["masters"], row  # Adam's two moments (swapped out with each master on NVMe)
        if params:
            assert sw["params_on_disk"] == sw["param_files"] > 0, row
            # max_in_cpu: the first shards (that many elements at most) stay in memory, the rest go to disk
            assert (0 < sw["kept_in_cpu"] <= max_in_cpu) if max_in_cpu else sw["kept_in_cpu"] == 0, row
    assert r["left"] == []


def _resume(rank: int, world: int, root: str, ckpt: str, phase: str) -> dict:
    """Phase "save": NVMe stage 3 (both sections) and stage 2 runs save after 2 steps, and an uninterrupted cpu
    run goes on to 4. Phase "load": the checkpoints load into fresh NVMe, "cpu" engines and at this world size."""
    import hf_zero

    gas, out = 2, {}
    for stage, params in ((3, True), (2, False)):
        tag = f"s{stage}"
        if phase == "save":
            e, *_ = hf_zero.initialize(model=_model(), config=_config(stage, "nvme", root, gas, 0.5, params))
            _train(e, range(2), gas, rank)
            e.save_checkpoint(ckpt, tag=tag)
            e.destroy()
            ref, *_ = hf_zero.initialize(model=_model(), config=_config(stage, "cpu", root, gas, 0.5, params))
            _train(ref, range(2), gas, rank)
            if world == 2:
                out[tag] = {"losses": _train(ref, range(2, 4), gas, rank), "weights": _weights(ref).tolist()}
            ref.destroy()
            continue
        for device in ("nvme", "cpu"):
            e, *_ = hf_zero.initialize(model=_model(), config=_config(stage, device, root, gas, 0.5, params))
            e.load_checkpoint(ckpt, tag=tag)
            losses = _train(e, range(2, 4), gas, rank)
            out[f"{tag}-{device}"] = {"losses": losses, "weights": _weights(e).tolist()}
            e.destroy()
    return out


def test_nvme_checkpoint_resumes_in_nvme_and_cpu_engines_and_at_another_world_size() -> None:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as ckpt:
        saved = spawn(_resume, 2, root, ckpt, "save")[0]
        same = spawn(_resume, 2, root, ckpt, "load")[0]
        other = spawn(_resume, 3, root, ckpt, "load")[0]
    for tag in ("s3", "s2"):
        ref = saved[tag]
        for device in ("nvme", "cpu"):
            got = same[f"{tag}-{device}"]
            assert got["losses"] == ref["losses"] and got["weights"] == ref["weights"], (tag, device)
            # at world size 3 the batches differ (one more rank): it must load and train, finite and moving
            w3 = torch.tensor(other[f"{tag}-{device}"]["weights"])
            assert torch.isfinite(w3).all() and all(map(lambda x: x == x, other[f"{tag}-{device}"]["losses"]))
        # nvme and cpu engines at world size 3 read the same checkpoint the same way
        assert other[f"{tag}-nvme"] == other[f"{tag}-cpu"], tag


def _failures(rank: int, world: int, root: str, ckpt: str) -> dict:
    import errno

    import hf_zero
    from hf_zero.errors import NvmeError
    from hf_zero.zero import nvme_io as nvme

    out: dict = {}
    missing = os.path.join(root, "no-such-disk")
    try:
        hf_zero.initialize(model=_model(), config=_config(2, "nvme", missing))
    except NvmeError as e:
        out["missing"] = str(e)
    readonly = os.path.join(root, "readonly")
    os.makedirs(readonly, exist_ok=True)
    os.chmod(readonly, 0o500)
    real = nvme._pwrite
    if os.geteuid() == 0:  # root writes into a 0o500 folder: fail the first write as a read-only mount does
        def read_only(fd: int, view: memoryview, offset: int) -> int:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        nvme._pwrite = read_only
    try:
        hf_zero.initialize(model=_model(), config=_config(2, "nvme", readonly))
    except NvmeError as e:
        out["readonly"] = str(e)
    nvme._pwrite = real
    os.chmod(readonly, 0o700)
    # a full disk on rank 1, from the third step's writes on: every rank stops at that step with one sentence
    e, *_ = hf_zero.initialize(model=_model(), config=_config(3, "nvme", root, 1, 0.5, True))
    _train(e, range(2), 1, rank)
    e.save_checkpoint(ckpt, tag="good")
    if rank == 1:
        def full(fd: int, view: memoryview, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        nvme._pwrite = full
    try:
        _train(e, range(2, 3), 1, rank)
    except NvmeError as err:
        out["full"] = str(err)
    nvme._pwrite = real
    try:  # the swap's files may be stale now: no checkpoint is written from them
        e.save_checkpoint(ckpt, tag="after")
    except NvmeError as err:
        out["save_after"] = str(err)
    out["ckpts"] = sorted(d for d in os.listdir(ckpt) if not d.startswith("."))
    e.destroy()
    good, *_ = hf_zero.initialize(model=_model(), config=_config(3, "cpu", root, 1, 0.5, True))
    good.load_checkpoint(ckpt, tag="good")
    out["good_loads"] = bool(torch.isfinite(_weights(good)).all())
    return out


def test_missing_readonly_and_full_nvme_path_stop_every_rank_in_one_sentence() -> None:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as ckpt:
        results = spawn(_failures, 2, root, ckpt)
    for rank, r in enumerate(results):
        assert "no-such-disk does not exist" in r.get("missing", "") and "nvme_path" in r["missing"], (rank, r)
        assert "readonly is not writable" in r.get("readonly", "") and "nvme_path" in r["readonly"], (rank, r)
        assert "is full" in r.get("full", "") and root in r["full"] and "free space" in r["full"], (rank, r)
        assert "." not in r["full"].rstrip(".")[-1:] and r["full"].count("; ") >= 1
        assert "is full" in r.get("save_after", ""), (rank, r)
        assert "good" in r["ckpts"] and "after" not in r["ckpts"] and r["good_loads"], (rank, r)
    assert results[0]["full"].startswith("rank 1: ") and not results[1]["full"].startswith("rank")


@pytest.mark.parametrize("change, words", [
    ({"offload_optimizer": {"device": "nvme"}}, "offload_optimizer.nvme_path: \"device\": \"nvme\" needs a folder"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}, "offload_param.device: \"nvme\" without offload_optimizer"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}, "overlap_param_gather": True}, "overlap_param_gather is not supported yet"),
    ({"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "offload needs ZeRO stage 1, 2 or 3"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0.5}}, 'use "device": "cpu" for a partial offload'),
])
def test_nvme_configs_hf_zero_cannot_run_are_refused_in_one_sentence(change: dict, words: str) -> None:
    from hf_zero.config import ConfigError, ZeroConfig

    zo = {"stage": 2, **change}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ZeroConfig.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zo})


def test_transformers_zero3_nvme_example_parses_with_aio_and_names_what_it_ignores() -> None:
    import warnings

    from hf_zero.config import ZeroConfig

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4,
                              "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9}},
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False, "overlap_events": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        z = ZeroConfig.load(cfg)
    said = " ".join(str(w.message) for w in caught)
    assert z.zero_optimization.offload_param.device == "nvme" and z.zero_optimization.offload_param.max_in_cpu == 10**9
    assert (z.aio.block_size, z.aio.queue_depth, z.aio.intra_op_parallelism) == (262144, 32, 1)
    assert "offload_param.buffer_size" in said and "fast_init" not in said  # fast_init false asks for nothing
    with pytest.raises(Exception, match="GPUDirect Storage is not supported"):
        ZeroConfig.load({**cfg, "aio": {"use_gds": True}})


def _outside_the_step(rank: int, world: int, root: str, out_dir: str) -> dict:
    """What reads or edits the masters between steps, on NVMe and on "cpu": DeepSpeed's accessors (fp32 master, Adam
    state, whole and local, get and set), ``single_partition_of_fp32_groups``, a ``GatheredParameters`` edit that
    writes back to the master, then a step, and ``save_16bit_model``'s file."""
    from safetensors.torch import load_file

    import hf_zero
    from hf_zero.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_local_optimizer_state,
    )
    from hf_zero.zero import GatheredParameters

    res = {}
    for stage, params in ((2, False), (3, True)):
        got = {}
        for device in ("cpu", "nvme"):
            e, *_ = hf_zero.initialize(model=_model(), config=_config(stage, device, root, 1, 0.5, params))
            _train(e, range(2), 1, rank)
            named = dict(e.module.named_parameters())
            w = named["model.layers.0.mlp.up_proj.weight"]
            row = {"fp32": safe_get_full_fp32_param(w).tolist(),
                   "exp_avg_sq": safe_get_full_optimizer_state(w, "exp_avg_sq").tolist(),
                   "local": safe_get_local_fp32_param(w).tolist()}
            safe_set_full_fp32_param(w, torch.full(tuple(w.ds_shape) if hasattr(w, "ds_shape") else w.shape, 0.25))
            local = safe_get_local_fp32_param(w)
            safe_set_local_optimizer_state(w, torch.zeros_like(local), "exp_avg")
            row["set"] = safe_get_full_fp32_param(w).tolist()
            row["exp_avg"] = safe_get_full_optimizer_state(w, "exp_avg").tolist()
            row["groups"] = [t.tolist() for t in e.zero_optimizer.single_partition_of_fp32_groups] if stage == 2 else []
            emb = named["model.embed_tokens.weight"]
            with GatheredParameters([emb], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        emb[:3].fill_(0.5)
            row["losses"] = _train(e, range(2, 4), 1, rank)
            row["weights"] = _weights(e).tolist()
            path = os.path.join(out_dir, f"{device}{stage}")
            e.save_16bit_model(path)
            if rank == 0:
                sd = load_file(os.path.join(path, "model.safetensors"))
                row["file"] = {k: v.float().sum().item() for k, v in sorted(sd.items())}
            e.destroy()
            got[device] = row
        res[stage] = {k: got["cpu"][k] == got["nvme"][k] for k in got["cpu"]}
        res[f"{stage}-moved"] = got["nvme"]["set"] != got["nvme"]["fp32"]
    return res


def test_accessors_gathered_edits_and_16bit_save_see_the_swapped_state() -> None:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        r = spawn(_outside_the_step, 2, root, out)[0]
    for stage in ("2", "3"):
        assert all(r[stage].values()), (stage, r[stage])
        assert r[f"{stage}-moved"]


def _trainer(rank: int, world: int, root: str, out: str) -> dict:
    """hf_zero's Trainer with transformers' ZeRO-3 NVMe config shape (both sections on NVMe, the aio section): an
    uninterrupted run on "cpu" and on NVMe, and an NVMe run resumed from its step-3 checkpoint."""
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset

    import hf_zero

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (64, 8), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    res = {}
    for name, device, resume in (("cpu", "cpu", None), ("nvme", "nvme", None), ("resumed", "nvme", "checkpoint-3")):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        zo = _config(3, device, root, params=True)["zero_optimization"]
        cfg = {"zero_optimization": zo, "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1},
               "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
        folder = os.path.join(out, "nvme" if name == "resumed" else name)
        args = hf_zero.TrainingArguments(
            output_dir=folder, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
            learning_rate=5e-3, max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, seed=0,
            save_strategy="steps", save_steps=3, disable_tqdm=True, zero_config=cfg)
        trainer = hf_zero.Trainer(model=_model(), args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=os.path.join(folder, resume) if resume else None)
        res[name] = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        trainer.engine.destroy()
    return res


def test_trainer_trains_and_resumes_with_nvme_offload() -> None:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        r = spawn(_trainer, 2, root, out)[0]
    assert r["nvme"] == r["cpu"] and len(r["cpu"]) == 6
    assert r["resumed"] == r["nvme"]  # steps 1-3 from the checkpoint's trainer state, 4-6 trained after the load


def test_swap_files_fall_back_from_o_direct_and_round_trip(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """One process: values round-trip through the pieces and threads; a file system that refuses ``O_DIRECT`` (as
    tmpfs did before Linux 6.6: EINVAL at open) gets buffered I/O instead, with the same result."""
    from hf_zero.zero import nvme_io as nvme
    from hf_zero.zero.nvme_io import NvmeSpec, SwapFiles, SwapFolder, aligned_buffer

    real_open = os.open

    def refusing(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    for refuse in (False, True):
        if refuse:
            monkeypatch.setattr(nvme.os, "open", refusing)
        folder = SwapFolder(NvmeSpec(path=str(tmp_path), where="zero_optimization.offload_optimizer", block_size=5000,
                                     queue_depth=2, threads=3), "optimizer", None)
        assert not (refuse and folder.direct)
        files = SwapFiles(folder)
        src = aligned_buffer(70_000, pin=False)
        src[:70_000].copy_(torch.randint(0, 255, (70_000,), dtype=torch.uint8))
        assert files.write("x.bin", src, 70_000).wait() is None
        dst = aligned_buffer(70_000, pin=False)
        assert files.read("x.bin", dst, 70_000).wait() is None
        assert torch.equal(src[:70_000], dst[:70_000])
        files.close()
        folder.remove()
        assert not os.path.exists(folder.path) and os.listdir(tmp_path) == []


def _bench_rows(rank: int, world: int, root: str) -> dict:
    """``benchmarks/bench.py``'s hf2nvme / hf3nvme configs (the GPU rows' code) against the same config on "cpu"."""
    import argparse
    import importlib.util
    import sys
    from pathlib import Path

    import hf_zero

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    spec = importlib.util.spec_from_file_location("hf_zero_bench_nvme", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["hf_zero_bench_nvme"] = bench
    spec.loader.exec_module(bench)
    out = {}
    for name in bench.NVME_ENGINES:
        args = argparse.Namespace(model="tiny", micro=2, gas=2, seq=12, bucket=2000, prefetch=None, hf_config="{}",
                                  checkpoint_blocks=False, breakdown=True, compile=False, shard=0, tp=2, engines=name,
                                  dtype="fp32", lr=1e-2, nvme_path=root, max_in_cpu=0)
        cfg = bench.hf_engine_config(name, args, world)
        runs = {}
        for device in ("cpu", "nvme"):
            c = {**cfg, "zero_optimization": {**cfg["zero_optimization"],
                                              "stage3_param_persistence_threshold": 40}}
            if device == "cpu":
                zo = c["zero_optimization"]
                zo["offload_optimizer"] = {"device": "cpu"}
                if "offload_param" in zo:
                    zo["offload_param"] = {"device": "cpu"}
            engine, *_ = hf_zero.initialize(model=_model(), config=c)
            runs[device] = (_train(engine, range(2), 2, rank), _weights(engine))
            if device == "nvme":
                out[f"{name}-runner"] = type(engine.zero_optimizer.runner).__name__
                out[f"{name}-timed"] = sorted(engine.timers.means())  # --breakdown: the step's parts, NVMe's included
            engine.destroy()
        out[name] = runs["cpu"][0] == runs["nvme"][0] and bool(torch.equal(runs["cpu"][1], runs["nvme"][1]))
    return out


def test_bench_nvme_engines_run_nvme_offload() -> None:
    with tempfile.TemporaryDirectory() as root:
        r = spawn(_bench_rows, 2, root)[0]
    timed = r.pop("hf2nvme-timed"), r.pop("hf3nvme-timed")
    assert r == {"hf2nvme": True, "hf3nvme": True, "hf2nvme-runner": "NvmeRunner", "hf3nvme-runner": "NvmeRunner"}
    assert all({"step.nvme_wait", "step.cpu_optimizer", "step.to_device"} <= set(t) for t in timed), timed


def _pipeline(rank: int, world: int, root: str, ckpt: str) -> dict:
    """A 2-stage pipeline (split_causal_lm, 4 micro-batches, ZeRO-1 inside each stage) with the optimizer on NVMe
    against "cpu"; then the NVMe run's checkpoint loads into a "cpu" pipeline and both take one more batch."""
    import hf_zero
    from hf_zero.pipe import split_causal_lm

    def build(device: str):  # noqa: ANN202
        cfg = _config(1, device, root, 4, 0.5)
        cfg["pipeline"] = {"schedule": "1f1b"}
        engine, *_ = hf_zero.initialize(model=split_causal_lm(_model(), 2), config=cfg)
        return engine

    def batches(t: int) -> list:
        return [(b["input_ids"], b["labels"]) for b in (_batch(t, k, 0) for k in range(4))]

    out = {}
    for device in ("cpu", "nvme"):
        e = build(device)
        out[device] = [float(e.train_batch(iter(batches(t)))) for t in range(2)]
        out[f"{device}-w"] = torch.cat([p.detach().reshape(-1) for p in e.module.parameters()]).tolist()
        if device == "nvme":
            e.save_checkpoint(ckpt, tag="p")
            out["nvme-next"] = float(e.train_batch(iter(batches(2))))
        e.destroy()
    e = build("cpu")
    e.load_checkpoint(ckpt, tag="p")
    out["cpu-next"] = float(e.train_batch(iter(batches(2))))
    return out


def test_nvme_offload_inside_a_pipeline_equals_cpu_and_its_checkpoint_loads_into_cpu() -> None:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as ckpt:
        results = spawn(_pipeline, 2, root, ckpt)
    for r in results:  # each rank holds one stage
        assert r["nvme"] == r["cpu"] and r["nvme-w"] == r["cpu-w"], r
        assert r["nvme-next"] == r["cpu-next"]


def _tensor_parallel(rank: int, world: int, root: str) -> dict:
    """AutoTP 2 (each rank a slice of the linear layers) x ZeRO-2 with the optimizer on NVMe, against "cpu"."""
    import hf_zero

    out = {}
    for device in ("cpu", "nvme"):
        cfg = _config(2, device, root, 2, 0.5)
        cfg["tensor_parallel"] = {"autotp_size": 2}
        e, *_ = hf_zero.initialize(model=_model(), config=cfg)
        out[device] = _train(e, range(3), 2, 0)  # both ranks of the tp group read the same batch
        out[f"{device}-w"] = torch.cat([p.detach().reshape(-1) for p in e.module.parameters()]).tolist()
        e.destroy()
    return out


def _hybrid(rank: int, world: int, root: str) -> dict:
    """Hybrid sharding (``mics_shard_size`` 2 of 4 ranks: 2 replicas) at stage 3, both sections on NVMe, against "cpu"."""
    import hf_zero

    out = {}
    for device in ("cpu", "nvme"):
        cfg = _config(3, device, root, 2, 0.5, params=True)
        cfg["zero_optimization"]["mics_shard_size"] = 2
        e, *_ = hf_zero.initialize(model=_model(), config=cfg)
        out[device] = _train(e, range(2), 2, rank)
        out[f"{device}-w"] = _weights(e).tolist()
        if device == "nvme":  # then rank 3's disk fills: all 4 ranks stop at that step, both shard groups
            import errno

            from hf_zero.errors import NvmeError
            from hf_zero.zero import nvme_io

            if rank == 3:
                def full(fd: int, view: memoryview, offset: int) -> int:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                nvme_io._pwrite = full
            try:
                _train(e, range(2, 3), 2, rank)
            except NvmeError as err:
                out["full"] = str(err)
        e.destroy()
    return out


def test_nvme_offload_with_hybrid_sharding_equals_cpu() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_hybrid, 4, root)
    for r in results:
        assert r["nvme"] == r["cpu"] and r["nvme-w"] == r["cpu-w"]
    said = [r.get("full", "") for r in results]  # the other replica's shard group learns too, through the replicas
    assert all("is full" in m for m in said) and said[0].startswith("rank 3: "), said


def test_nvme_offload_under_tensor_parallelism_equals_cpu() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_tensor_parallel, 2, root)
    for r in results:
        assert r["nvme"] == r["cpu"] and r["nvme-w"] == r["cpu-w"]


def _killed_main(out: str) -> None:
    """A rank's script (``python tests/test_nvme.py OUT``, two started by hand over a FileStore): NVMe stage 3 trains 3
    steps with a checkpoint after step 1; with ``HFZ_NVME_KILL=1`` rank 1 SIGKILLs itself in step 2 while the swap
    writes its first group back. It loads ``latest`` first when there is one, as a resuming script does."""
    import signal
    import sys

    sys.path.insert(0, str(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import hf_zero
    from hf_zero.errors import PeerFailureError
    from hf_zero.zero import nvme_io as nvme

    rank = int(os.environ["RANK"])
    hf_zero.init_distributed(init_method="file://" + os.path.join(out, "store" + os.environ.get("HFZ_NVME_ATTEMPT", "")))
    root, ckpt = os.path.join(out, "nvme"), os.path.join(out, "ckpt")
    os.makedirs(root, exist_ok=True)
    e, *_ = hf_zero.initialize(model=_model(), config=_config(3, "nvme", root, 1, 0.5, True))
    if os.path.exists(os.path.join(ckpt, "latest")):
        e.load_checkpoint(ckpt)
    while e.global_steps < 3:
        if e.global_steps == 1 and rank == 1 and os.environ.get("HFZ_NVME_KILL"):
            def die(fd: int, view: memoryview, offset: int) -> int:
                os.kill(os.getpid(), signal.SIGKILL)
                return 0
            nvme._pwrite = die
        try:
            _train(e, range(e.global_steps, e.global_steps + 1), 1, rank)
        except PeerFailureError as err:
            with open(os.path.join(out, f"stopped{rank}"), "w") as f:
                f.write(str(err))
            raise
        if e.global_steps == 1:
            e.save_checkpoint(ckpt)
    with open(os.path.join(out, f"done{rank}"), "w") as f:
        f.write(repr(_weights(e).sum().item()))


def _by_hand(out: str, **extra: str) -> list:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HFZ_", "HF_ZERO_", "TORCHELASTIC_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=root, WORLD_SIZE="2", HF_ZERO_COMM_TIMEOUT="30",
               **extra)
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), out], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]


def test_a_rank_killed_during_the_nvme_step_stops_the_other_and_the_rerun_resumes(tmp_path) -> None:  # noqa: ANN001
    import signal

    out = str(tmp_path)
    r0, r1 = _by_hand(out, HFZ_NVME_KILL="1")
    text0, _ = r0.communicate(timeout=240)
    r1.communicate(timeout=60)
    assert r1.returncode == -signal.SIGKILL and r0.returncode == 1, text0[-3000:]
    said = open(os.path.join(out, "stopped0")).read()
    assert "rank 1" in said and "died" in said and "step 1" in said, said
    left = sorted(os.listdir(os.path.join(out, "nvme")))
    assert any(d.endswith("-rank00001") for d in left), left  # the killed rank's folder stays behind
    r0, r1 = _by_hand(out, HFZ_NVME_ATTEMPT="2")  # the rerun: resumes from step 1's checkpoint, finishes
    text0, _ = r0.communicate(timeout=240)
    r1.communicate(timeout=60)
    assert r0.returncode == 0 and r1.returncode == 0, text0[-3000:]
    assert "holds the swap folders of 1 earlier run(s)" in text0, text0[-3000:]  # named, never read
    assert os.path.exists(os.path.join(out, "done0")) and os.path.exists(os.path.join(out, "done1"))


# ---------------------------------------------------------------- GPUs (tests/gpu/gpu_check.py registers it)


def gpu_suite(rank: int, world: int) -> list[dict]:
    """NVMe vs cpu offload under NCCL, device ``cuda:LOCAL_RANK``, nvme_path in a temporary folder: stage 2 and
    stage 3 (both sections on NVMe), bf16, with accumulation and clipping; then a save and load of the NVMe run.

    Rows: ``case``, ``loss_err`` and ``w_err`` (relative, against the cpu offload run; both step the same fused CPU
    Adam on the same gradients, so 0 is expected) and ``tol`` (1e-6: gpu_check passes a row when the error is below it,
    so 0 passes and a real difference does not).
    """
    import torch.distributed as dist

    import hf_zero

    if torch.cuda.is_available():  # (on CPU ranks it runs too, over gloo: how it was checked before the GPUs)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    base = os.environ.get("HF_ZERO_NVME_TEST_DIR") or tempfile.gettempdir()
    root = [tempfile.mkdtemp(prefix="hf_zero_nvme_gpu_", dir=base) if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    root_dir = root[0]
    for stage, params in ((2, False), (3, True)):
        runs = {}
        for device in ("cpu", "nvme"):
            engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, device, root_dir, 2, 0.5, params,
                                                                            dtype="bf16"))
            losses = _train(engine, range(3), 2, rank)
            runs[device] = (torch.tensor(losses), _weights(engine))
            if device == "nvme":
                ckpt = os.path.join(root_dir, f"ckpt{stage}")
                engine.save_checkpoint(ckpt, tag="t")
                resumed, *_ = hf_zero.initialize(model=_model(), config=_config(stage, "nvme", root_dir, 2, 0.5, params,
                                                                                 dtype="bf16"))
                resumed.load_checkpoint(ckpt, tag="t")
                runs["resumed"] = (torch.tensor(_train(resumed, range(3, 4), 2, rank)), _weights(resumed))
                runs["continued"] = (torch.tensor(_train(engine, range(3, 4), 2, rank)), _weights(engine))
                resumed.destroy()
            engine.destroy()
        name = f"nvme stage {stage}" + (" + offload_param" if params else "")
        rows.append({"case": f"{name} vs cpu offload", "loss_err": _rel(runs["nvme"][0], runs["cpu"][0]),
                     "w_err": _rel(runs["nvme"][1], runs["cpu"][1]), "tol": 1e-6})
        rows.append({"case": f"{name} resumed vs continued", "loss_err": _rel(runs["resumed"][0], runs["continued"][0]),
                     "w_err": _rel(runs["resumed"][1], runs["continued"][1]), "tol": 1e-6})
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root_dir, ignore_errors=True)
    return rows


if __name__ == "__main__":
    import sys

    _killed_main(sys.argv[1])
