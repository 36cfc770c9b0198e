"""A rank dies (SIGKILL) or hangs mid-step: the others stop, with one sentence naming it, and
``hf-zero launch --max_restarts 1`` resumes from the last checkpoint to the same final weights.

This file is also the training script the tests start (``python tests/test_reliability_rank_death.py
OUT``), configured by environment variables, the way fault injection reaches a real job:

- ``HFZ_TEST_KILL_AT=k``: rank 1 kills itself with SIGKILL at step ``k``, after its forward, on
  the first attempt only (``TORCHELASTIC_RESTART_COUNT`` tells torchrun's attempts apart);
- ``HFZ_TEST_HANG_AT=k``: rank 1 sleeps instead of running step ``k``'s backward;
- ``HFZ_TEST_FILESTORE=path``: rendezvous through a FileStore (tests started without torchrun).

It trains a small model with ZeRO stage 2 on 2 ranks, saves a checkpoint every
``HFZ_TEST_SAVE_EVERY`` steps, loads ``latest`` first when there is one (as a user's script
does), and writes the final weights with ``save_pretrained``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8
SAVE_EVERY = 2


def main(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    import hf_zero
    from hf_zero.distributed.dist import PeerFailureError
    from tests.models import make_data, make_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at = int(os.environ.get("HFZ_TEST_KILL_AT", "-1"))
    hang_at = int(os.environ.get("HFZ_TEST_HANG_AT", "-1"))
    steps = int(os.environ.get("HFZ_TEST_STEPS", STEPS))
    every = int(os.environ.get("HFZ_TEST_SAVE_EVERY", SAVE_EVERY))
    if os.environ.get("HFZ_TEST_FILESTORE"):
        hf_zero.init_distributed(init_method="file://" + os.environ["HFZ_TEST_FILESTORE"])
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 40},
        "steps_per_print": None,
    }
    engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
    ckpt = out / "ckpt"
    if (ckpt / "latest").exists():
        path, _ = engine.load_checkpoint(str(ckpt))
        (out / f"resumed_rank{rank}_attempt{attempt}").write_text(os.path.basename(path))
    ids, labels = make_data(steps, 4)
    mine = slice(2 * rank, 2 * rank + 2)
    while engine.global_steps < steps:
        t = engine.global_steps
        loss = engine(ids[t, mine], labels[t, mine])
        if rank == 1 and attempt == 0 and t == kill_at:
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and attempt == 0 and t == hang_at:
            (out / "hung_at").write_text(repr(time.time()))
            time.sleep(600)
        try:
            engine.backward(loss)
            engine.step()
        except PeerFailureError:
            (out / f"stopped_rank{rank}").write_text(repr(time.time()))
            raise
        if engine.global_steps % every == 0:
            engine.save_checkpoint(str(ckpt))
    engine.save_pretrained(str(out / "final"))


# ------------------------------------------------------------------------------ tests


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HFZ_TEST_", "HF_ZERO_", "TORCHELASTIC_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _two_ranks(out: Path, **extra: str) -> list[subprocess.Popen]:
    """Two ranks started by hand (no torchrun, which would tear the survivor down itself)."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", HFZ_TEST_FILESTORE=str(out / "store"), **extra)
        procs.append(subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _last_line(text: str) -> str:
    return [line for line in text.strip().splitlines() if line.strip()][-1]


def test_a_killed_rank_is_named_by_the_survivor_within_seconds(tmp_path: Path) -> None:
    rank0, rank1 = _two_ranks(tmp_path, HFZ_TEST_KILL_AT="3", HF_ZERO_COMM_TIMEOUT="20")
    out0, _ = rank0.communicate(timeout=90)
    rank1.communicate(timeout=30)
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == 1, out0
    last = _last_line(out0)
    assert "hf_zero.errors.PeerFailureError: rank 1 (pid " in last and "has died" in last, out0
    assert "rank 0 stops in backward of step 3" in last and "--max_restarts" in last, last
    seconds = float((tmp_path / "stopped_rank0").read_text()) - float((tmp_path / "killed_at").read_text())
    print(f"\nsurvivor stopped {seconds:.2f} s after the kill: {last}")
    assert seconds < 10  # gloo sees the socket close at once; far below the 20 s timeout


def test_a_hung_rank_stops_the_others_after_the_configured_timeout(tmp_path: Path) -> None:
    rank0, rank1 = _two_ranks(tmp_path, HFZ_TEST_HANG_AT="2", HF_ZERO_COMM_TIMEOUT="3")
    try:
        out0, _ = rank0.communicate(timeout=90)
    finally:
        rank1.kill()
        rank1.communicate(timeout=30)
    assert rank0.returncode == 1, out0
    last = _last_line(out0)
    assert "PeerFailureError: rank 1 did not answer within 3 s (HF_ZERO_COMM_TIMEOUT), so rank 0 stops in" in last, out0
    seconds = float((tmp_path / "stopped_rank0").read_text()) - float((tmp_path / "hung_at").read_text())
    print(f"\nsurvivor stopped {seconds:.2f} s after rank 1 hung (timeout 3 s): {last}")
    assert 2.5 < seconds < 15


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, **extra: str) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "hf_zero.launch.cli", "launch", "--num_gpus", "2", "--max_restarts", "1",
            "--master_port", str(_free_port()), __file__, str(out)]
    return subprocess.run(argv, env=_env(**extra), capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_launch_max_restarts_resumes_after_a_kill_to_the_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ref = _launch(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    hit = _launch(tmp_path / "hit", HFZ_TEST_KILL_AT="5")  # checkpoints at steps 2 and 4; killed in step 5
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert (tmp_path / "hit" / "killed_at").exists()
    assert "Signal 9" in hit.stderr or "SIGKILL" in hit.stderr or "exitcode: -9" in hit.stderr, hit.stderr[-3000:]
    for rank in (0, 1):  # the second attempt picked up the last complete checkpoint
        assert (tmp_path / "hit" / f"resumed_rank{rank}_attempt1").read_text() == "global_step4"
    a = load_file(str(tmp_path / "ref" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "hit" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
