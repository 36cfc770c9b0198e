"""The tutorial's examples under the launcher, exactly as shipped (only the import swapped).

01 and 04 must train; 03 calls ``backward`` on a non-scalar output and must stop every rank
with one sentence and a non-zero exit, without hanging; 02 splits its two layers over two
pipeline stages and must run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _launch(script: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "hf_zero.launch.cli", "launch", "--num_gpus", "2", "--master_port", str(port), str(EXAMPLES / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize("script", ["01_data_parallel.py", "04_multi_gpu_loop.py"])
def test_examples_train(script: str) -> None:
    out = _launch(script)
    assert out.returncode == 0, out.stderr[-3000:]
    if script.startswith("04"):
        assert out.stdout.count("Training on multiple GPUs with DeepSpeed") == 1  # rank 0 only
        assert "step=10" in out.stderr  # steps_per_print: 512 samples / 64 per step = 8 + ... logged by rank 0


def test_example_03_non_scalar_backward_stops_every_rank_with_one_sentence() -> None:
    out = _launch("03_zero.py")
    assert out.returncode != 0
    sentence = "engine.backward(loss) needs a scalar loss but got a tensor of shape (64, 10)"
    assert out.stderr.count(sentence) >= 2, out.stderr[-3000:]  # once per rank
    assert "[rank0]" in out.stderr and "[rank1]" in out.stderr


def test_example_02_pipeline_runs_in_two_stages() -> None:
    """Two processes, two stages: ``engine(inputs)`` passes the activation from stage 0 to stage 1."""
    out = _launch("02_pipeline.py")
    assert out.returncode == 0, out.stderr[-3000:]
