"""Checkpoints written in the background (``"checkpoint": {"async_save": true}``), on 2 gloo ranks.

The oracle is the synchronous save: the same step saved both ways gives the same files, byte for byte.
Around it, what the background must keep: at most one save in flight (the next one waits, training does
not), a failure on one rank raised on every rank at the next wait point with nothing published,
``load_checkpoint`` reading the checkpoint still being written only once it is whole, the host-memory
check before the copy, and a rank SIGKILLed while its write is in flight leaving ``latest`` on the
previous checkpoint, which loads. (A writer killed halfway in one process is
``tests/test_checkpoint.py::test_writer_killed_halfway_leaves_previous_checkpoint``, run both ways.)
"""

from __future__ import annotations

import filecmp
import os
import signal
import time
from pathlib import Path

import pytest

from tests.distributed import spawn
from tests.models import make_data, make_model

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


def _engine(stage: int, extra: dict | None = None):  # noqa: ANN202
    import hf_zero

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "steps_per_print": None,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 20},
           "checkpoint": {"async_save": True}, **(extra or {})}
    return hf_zero.initialize(model=make_model(), config=cfg)[0]


def _step(engine, t: int) -> None:  # noqa: ANN001
    """Step ``t`` on 2 samples a rank, at any world size (tests/gpu/gpu_check.py runs it at 1 to N ranks)."""
    import torch.distributed as dist

    ids, labels = make_data(t + 1, 2 * dist.get_world_size())
    r = engine.global_rank
    engine.backward(engine(ids[t, 2 * r : 2 * r + 2], labels[t, 2 * r : 2 * r + 2]))
    engine.step()


def _same_files(a: Path, b: Path) -> list[str]:
    """The names that differ (or exist in one folder only) between two checkpoint folders."""
    names = set(os.listdir(a)) | set(os.listdir(b))
    return sorted(n for n in names if not ((a / n).exists() and (b / n).exists() and filecmp.cmp(a / n, b / n, shallow=False)))


def _cases(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import hf_zero.checkpoint.background as background
    import hf_zero.checkpoint.save as save_module
    from hf_zero.checkpoint import CheckpointError
    from hf_zero.planning import estimate

    out: dict = {}
    root_p = Path(root)

    # 1. the same step saved synchronously and in the background: the same bytes (stages 2 and 3)
    for stage in (2, 3):
        engine = _engine(stage)
        _step(engine, 0)
        _step(engine, 1)
        engine.config.checkpoint_async_save = False
        engine.save_checkpoint(str(root_p / f"sync{stage}"))
        engine.config.checkpoint_async_save = True
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root_p / f"async{stage}"))
        out[f"returned{stage}"] = time.perf_counter() - t0
        out[f"waited{stage}"] = os.path.basename(engine.wait_for_checkpoint())
        dist.barrier()
        out[f"differ{stage}"] = _same_files(root_p / f"sync{stage}" / "global_step2", root_p / f"async{stage}" / "global_step2")
        out[f"listing{stage}"] = sorted(os.listdir(root_p / f"async{stage}"))
        engine.destroy()

    # 2. the host copy against the estimate: fp32 master and Adam's two moments of ceil(Ψ/N) trainable elements
    engine = _engine(2)
    _step(engine, 0)
    share = save_module.plan_share(engine.train_state())
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    out["trainable_bytes"] = save_module.plan_bytes({k: v for k, v in share["tensors"].items() if not k.startswith("frozen|")})
    out["estimate_bytes"] = estimate.async_save_host_bytes(trainable, world, 2, "adamw")
    out["buffers"] = len(engine.zero_optimizer.groups)

    # 3. at most one save in flight: the second waits for the first; training runs meanwhile
    d = root_p / "slow"
    real_write = save_module.write_rank
    seen: list[list[str]] = []

    def slow_write(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        seen.append(sorted(n for n in os.listdir(d) if n.endswith(".partial")))
        time.sleep(1.0)
        real_write(*args, **kwargs)

    save_module.write_rank = slow_write
    try:
        t0 = time.perf_counter()
        engine.save_checkpoint(str(d), tag="first")
        out["first_returned"] = time.perf_counter() - t0
        _step(engine, 1)
        out["in_flight_after_step"] = engine._background.in_flight
        out["step_done_after"] = time.perf_counter() - t0
        engine.save_checkpoint(str(d), tag="second")
        out["second_returned"] = time.perf_counter() - t0
        out["second_waited"] = os.path.basename(engine.wait_for_checkpoint())
    finally:
        save_module.write_rank = real_write
    out["partials_seen"] = seen
    out["slow_listing"] = sorted(os.listdir(d))

    # 4. rank 1's disk fills up in the thread: nothing published, the sentence on every rank at the next wait point
    def disk_full(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise OSError(28, "No space left on device")

    if rank == 1:
        save_module.write_rank = disk_full
    try:
        engine.save_checkpoint(str(d), tag="third")
    finally:
        save_module.write_rank = real_write
    try:
        engine.wait_for_checkpoint()
        out["failed"] = None
    except CheckpointError as e:
        out["failed"] = str(e)
    dist.barrier()
    out["failed_listing"] = sorted(os.listdir(d))
    out["failed_latest"] = (d / "latest").read_text()

    # 5. load_checkpoint of the checkpoint being written waits for it
    save_module.write_rank = slow_write
    try:
        _step(engine, 2)
        engine.save_checkpoint(str(d), tag="fourth")
        path, _ = engine.load_checkpoint(str(d))
        out["loaded_while_writing"] = os.path.basename(path)
    finally:
        save_module.write_rank = real_write
    engine.destroy()

    # 6. the host memory the copy needs, checked before it is made (every rank, the same sentence)
    real_available = background.available_host_bytes
    background.available_host_bytes = lambda: 1000
    try:
        fresh = _engine(2)
        _step(fresh, 0)
        fresh.save_checkpoint(str(root_p / "nomem"))
        out["nomem"] = None
    except CheckpointError as e:
        out["nomem"] = str(e)
    finally:
        background.available_host_bytes = real_available
    dist.barrier()
    out["nomem_listing"] = sorted(os.listdir(root_p / "nomem"))
    out["pipeline"] = _pipeline(rank, root_p / "pipe")
    return out


def _pipeline(rank: int, d: Path) -> dict:
    """A 2-stage pipeline: a background save equals a synchronous one; a signal to stage 1 alone stops both stages."""
    import torch
    import torch.distributed as dist

    import hf_zero
    from hf_zero.pipe import split_causal_lm
    from tests.test_pipe import MODELS

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": None,
           "optimizer": ADAMW, "pipeline": {"schedule": "1f1b"}, "zero_optimization": {"stage": 0},
           "checkpoint": {"async_save": True, "save_on_signal": ["SIGUSR1"]}}
    engine = hf_zero.initialize(model=split_causal_lm(MODELS["llama2"](), 2), config=cfg)[0]
    ids = torch.randint(0, 32, (20, 4, 6), generator=torch.Generator().manual_seed(3))

    def train_batch(t: int) -> None:
        engine.train_batch(iter([(ids[t, 2 * i : 2 * i + 2], ids[t, 2 * i : 2 * i + 2]) for i in range(2)]))

    out: dict = {}
    train_batch(0)
    engine.config.checkpoint_async_save = False
    engine.save_checkpoint(str(d / "sync"))
    engine.config.checkpoint_async_save = True
    engine.save_checkpoint(str(d / "async"))
    engine.wait_for_checkpoint()
    dist.barrier()
    out["differ"] = _same_files(d / "sync" / "global_step1", d / "async" / "global_step1")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)  # the watcher thread records it
    try:
        for t in range(1, 10):
            train_batch(t)
        out["exit"] = None
    except SystemExit as e:
        out["exit"] = e.code
    out["steps"] = engine.global_steps
    engine.destroy()
    dist.barrier()
    out["latest"] = (d / "async" / "latest").read_text()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("async")
    return root, spawn(_cases, 2, str(root))


def test_a_background_save_writes_the_same_bytes_as_a_synchronous_one(two_ranks) -> None:  # noqa: ANN001
    for r in two_ranks[1]:
        for stage in (2, 3):
            assert r[f"differ{stage}"] == [], r
            assert r[f"waited{stage}"] == "global_step2" and r[f"listing{stage}"] == ["global_step2", "latest"], r
        # the estimate's ceil(Ψ/N) against the elements this rank owns: at most one more or less per flat buffer
        assert abs(r["trainable_bytes"] - r["estimate_bytes"]) <= 12 * r["buffers"], r


def test_a_pipeline_saves_in_the_background_and_stops_on_a_signal_to_one_stage(two_ranks) -> None:  # noqa: ANN001
    """The signal reaches stage 1 before step 2's boundary: the all-reduce of step 2 carries it, step 3 decides."""
    for r in two_ranks[1]:
        p = r["pipeline"]
        assert p["differ"] == [], p
        assert p["exit"] == 128 + signal.SIGUSR1 and p["steps"] == 3 and p["latest"] == "global_step3", p


def test_one_save_in_flight_training_goes_on_and_failures_reach_every_rank(two_ranks) -> None:  # noqa: ANN001
    root, ranks = two_ranks
    for r in ranks:
        print(f"\nrank: first save returned after {r['first_returned']:.3f} s (its write takes 1 s), "
              f"a step ran by {r['step_done_after']:.3f} s, the second save returned at {r['second_returned']:.3f} s")
        assert r["first_returned"] < 0.5 and r["in_flight_after_step"] and r["step_done_after"] < 0.9, r
        assert r["second_returned"] >= 0.95, r  # it waited for the first write (1 s) before its own copy
        assert r["second_waited"] == "second"
        # each write found only its own partial folder: never two saves at once
        assert r["partials_seen"][:2] == [[".first.partial"], [".second.partial"]], r
        assert r["slow_listing"] == ["first", "latest", "second"], r
        assert r["failed"] == (
            f"the background write of {root / 'slow' / 'third'} failed on rank 1 (OSError: [Errno 28] No space left on "
            f"device); the checkpoints already in {root / 'slow'} are kept"
        ), r
        assert r["failed_listing"] == ["first", "latest", "second"] and r["failed_latest"] == "second", r
        assert r["loaded_while_writing"] == "fourth", r
        assert r["nomem"].startswith("checkpoint.async_save needs ") and "more host memory on " in r["nomem"], r
        assert "but 1000 bytes is available (MemAvailable, of which 5% stays free); turn checkpoint.async_save off" in r["nomem"]
        assert r["nomem_listing"] == [], r
    assert ranks[0]["failed"] == ranks[1]["failed"] and ranks[0]["nomem"] == ranks[1]["nomem"]


# --------------------------------------------------------------- a rank killed mid-write


def _killed_while_writing(rank: int, world: int, root: str) -> None:
    import hf_zero.checkpoint.save as save_module

    d = str(Path(root) / "ckpt")
    engine = _engine(2)
    _step(engine, 0)
    engine.save_checkpoint(d)  # global_step1, complete
    engine.wait_for_checkpoint()
    real_write = save_module.write_rank

    def die_or_crawl(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if rank == 1:
            Path(root, "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)  # rank 0 is still writing when its peer dies
        real_write(*args, **kwargs)

    save_module.write_rank = die_or_crawl
    _step(engine, 1)
    engine.save_checkpoint(d)  # global_step2 in the background; rank 1 dies in it
    for t in range(2, 50):  # rank 0 trains on until a collective finds its peer gone
        _step(engine, t)


def _load_latest(rank: int, world: int, root: str) -> dict:
    engine = _engine(2)
    path, _ = engine.load_checkpoint(str(Path(root) / "ckpt"))
    ids, labels = make_data(2, 4)
    engine.backward(engine(ids[1], labels[1]))
    engine.step()
    return {"loaded": os.path.basename(path), "global_steps": engine.global_steps}


def test_a_rank_killed_while_its_background_write_is_in_flight_leaves_latest_loadable(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        spawn(_killed_while_writing, 2, str(tmp_path))
    assert (tmp_path / "killed").exists()
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step1"
    assert not (ckpt / "global_step2").exists(), sorted(os.listdir(ckpt))
    got = spawn(_load_latest, 1, str(tmp_path))[0]  # one process reads the 2-rank checkpoint (any world size loads it)
    assert got["loaded"] == "global_step1" and got["global_steps"] == 2


# --------------------------------------------------------------- the random streams a background save stores

RNG_PAIRS = 50


def _saved_rng(folder: Path, rank: int) -> dict:
    """Every random stream one rank's share stores: Python's and NumPy's (its JSON index), torch's (its tensors)."""
    import json

    from safetensors import safe_open

    index = json.loads((folder / f"rank{rank:05d}.json").read_text())
    out = {f"json.{k}": v for k, v in index["rng"].items()}
    for key, fname in index["files"].items():
        if key.startswith("rng."):
            with safe_open(str(folder / fname), "pt") as f:
                out[key] = f.get_tensor(key).tolist()
    return out


def _rng_pairs(rank: int, world: int, root: str, stage: int, drawing: bool) -> dict:
    """``RNG_PAIRS`` times: the same step saved synchronously and in the background; the streams each stored.

    Each pair first draws from every stream, so each pair stores a different state; a training step runs while the
    background write is in flight. The first background save of the process (the one that builds the writers' gloo
    group and, on a GPU, registers the host buffers) is the first pair's. ``drawing``: a call inside the save path
    draws from NumPy's and Python's global streams, as a library's call can (modelled in the background save's
    host-memory check and the synchronous save's publishing on rank 0, both on the main thread); the streams stored
    must still be those of the moment save_checkpoint was called, and the run must go on from them."""
    import random
    import threading

    import numpy as np
    import torch
    import torch.distributed as dist

    import hf_zero.checkpoint.save as save_module
    from hf_zero.checkpoint.background import BackgroundWriter

    real_prepare, real_finish = BackgroundWriter.prepare, save_module._finish

    def draw() -> None:
        if threading.current_thread() is threading.main_thread():
            np.random.rand(3)
            random.random()

    def prepare(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        draw()
        return real_prepare(self, *args, **kwargs)

    def finish(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        draw()
        real_finish(*args, **kwargs)

    if drawing:
        BackgroundWriter.prepare, save_module._finish = prepare, finish
    try:
        engine = _engine(stage)
        _step(engine, 0)
        differ, moved, streams = [], [], set()
        for i in range(RNG_PAIRS):
            random.random()
            np.random.rand(1 + i % 3)
            torch.rand(1 + i % 2)
            engine.config.checkpoint_async_save = False
            engine.save_checkpoint(str(Path(root, f"sync{stage}")), tag=f"p{i}", save_latest=False)
            engine.config.checkpoint_async_save = True
            engine.save_checkpoint(str(Path(root, f"async{stage}")), tag=f"p{i}", save_latest=False)
            _step(engine, 1)  # training goes on while the write is in flight (it draws from no stream)
            engine.wait_for_checkpoint()
            now = {"json.python": [*random.getstate()[:1], list(random.getstate()[1]), random.getstate()[2]],
                   "json.numpy": np.random.get_state()[2], "rng.torch_cpu": torch.get_rng_state().tolist()}
            a = _saved_rng(Path(root, f"sync{stage}", f"p{i}"), rank)
            b = _saved_rng(Path(root, f"async{stage}", f"p{i}"), rank)
            streams |= set(a)
            if a != b:
                differ.append([i, sorted(k for k in a if a[k] != b.get(k))])
            stored = {"json.python": a["json.python"], "json.numpy": a["json.numpy"][2], "rng.torch_cpu": a["rng.torch_cpu"]}
            if now != stored or np.random.get_state()[1].tolist() != a["json.numpy"][1]:
                moved.append(i)  # the run does not go on from the streams the checkpoint stores
        dist.barrier()
        engine.destroy()
    finally:
        BackgroundWriter.prepare, save_module._finish = real_prepare, real_finish
    return {"differ": differ, "moved": moved, "streams": sorted(streams)}


@pytest.mark.parametrize("stage, drawing", [(2, False), (3, False), (2, True)], ids=["stage2", "stage3", "stage2-drawing"])
def test_a_background_save_stores_the_random_streams_of_a_synchronous_one(tmp_path: Path, stage: int, drawing: bool) -> None:
    """50 sync/async pairs: Python's ``random``, NumPy's global RandomState and torch's generators (CUDA's where
    there is one) stored by the background save equal the synchronous save's of the same step, every time, and the
    run goes on from them; also when a call inside the save path draws from a global stream."""
    for r in spawn(_rng_pairs, 2, str(tmp_path), stage, drawing):
        assert {"json.python", "json.numpy", "rng.torch_cpu"} <= set(r["streams"]), r["streams"]
        assert r["differ"] == [], r["differ"]
        assert r["moved"] == [], r["moved"]
