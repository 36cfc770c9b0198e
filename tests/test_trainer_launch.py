"""``hf_zero.Trainer`` started by ``hf-zero launch --num_gpus 2`` on a machine without GPUs, as a user
runs it: a script that never set ``use_cpu=True`` still shards the data over 2 CPU processes, logs each
line once and saves from rank 0 only; and a rank killed in the middle of ``train()`` is named by the
survivor (and by torchrun's summary as the root cause) instead of a raw gloo error, with no hang.

This file is also the training script the tests start (``python tests/test_trainer_launch.py OUT``):
``HFZ_TEST_KILL_AT=k`` makes rank 1 kill itself with SIGKILL when step ``k`` ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS, MICRO = 4, 2


def main(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    import hf_zero

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8))
    n = STEPS * MICRO * 2
    ids = [[i % 32] + [(i * 7 + j) % 32 for j in range(7)] for i in range(n)]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    kill_at = int(os.environ.get("HFZ_TEST_KILL_AT", "-1"))
    seen: list[int] = []

    def collate(rows: list[dict]) -> dict:
        seen.extend(r["input_ids"][0] for r in rows)  # the first token is the row's index
        return {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "labels")}

    class KillRank1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            # after the step, before the Trainer gathers the loss to log it: the survivor's next
            # collective is transformers' / Accelerate's, not the engine's
            if state.global_step == kill_at and int(os.environ["RANK"]) == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    zero = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    args = hf_zero.TrainingArguments(  # no use_cpu=True: the machine has no GPU, hf_zero sees to it
        output_dir=str(out / "run"), per_device_train_batch_size=MICRO, max_steps=STEPS, logging_steps=1,
        report_to="none", disable_tqdm=True, save_strategy="no", zero_config=zero, seed=0)
    trainer = hf_zero.Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[KillRank1()])
    trainer.train()
    trainer.save_model(str(out / "run" / "final"))
    record = {"world_size": args.world_size, "process_index": args.process_index, "should_save": args.should_save,
              "should_log": args.should_log, "seen": seen}
    (out / f"rank{args.process_index}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------ tests


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment, as seen on a machine without GPUs, without this file's switches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HFZ_TEST_", "HF_ZERO_", "TORCHELASTIC_", "ACCELERATE_"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **extra)
    return env


def _launch(out: Path, **extra: str) -> subprocess.CompletedProcess:
    """``hf-zero launch --num_gpus 2`` of this file, with CUDA hidden as on a machine without GPUs."""
    out.mkdir(parents=True, exist_ok=True)
    env = _env(**extra)
    argv = [sys.executable, "-m", "hf_zero.launch.cli", "launch", "--num_gpus", "2", "--master_port", str(_free_port()),
            __file__, str(out)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_gpu_less_launch_shards_the_data_without_use_cpu(tmp_path: Path) -> None:
    done = _launch(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    notices = [line for line in done.stderr.splitlines() if "CPU process" in line]
    assert len(notices) == 1 and "gloo" in notices[0], done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["process_index"]) for r in ranks] == [(2, 0), (2, 1)]
    assert [r["should_save"] for r in ranks] == [True, False] and [r["should_log"] for r in ranks] == [True, False]
    seen0, seen1 = set(ranks[0]["seen"]), set(ranks[1]["seen"])
    assert not seen0 & seen1 and len(seen0 | seen1) == STEPS * MICRO * 2, (ranks[0]["seen"], ranks[1]["seen"])
    logged = [line for line in done.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(logged) == STEPS, done.stdout  # once per step, by rank 0 only
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def _by_hand(out: Path, **extra: str) -> list[subprocess.Popen]:
    """Two ranks started without torchrun (which would stop the survivor itself), rendezvous over env://."""
    out.mkdir(parents=True, exist_ok=True)
    port, procs = str(_free_port()), []
    for rank in (0, 1):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", **extra)
        procs.append(subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def test_a_rank_killed_inside_train_is_named_by_the_survivor(tmp_path: Path) -> None:
    rank0, rank1 = _by_hand(tmp_path, HFZ_TEST_KILL_AT="2", HF_ZERO_COMM_TIMEOUT="60")
    out0, _ = rank0.communicate(timeout=180)  # no hang: the survivor stops at its next collective
    rank1.communicate(timeout=30)
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == 1, out0[-3000:]
    last = [line for line in out0.strip().splitlines() if line.strip()][-1]
    assert "hf_zero.errors.PeerFailureError: rank 1 (pid " in last, out0[-3000:]  # torch prefixes "[rank0]: "
    assert "has died, so rank 0 stops in Trainer.train() instead of waiting for it" in last, last


def test_torchrun_names_the_killed_rank_not_the_survivor(tmp_path: Path) -> None:
    done = _launch(tmp_path, HFZ_TEST_KILL_AT="2", HF_ZERO_COMM_TIMEOUT="60")
    assert done.returncode != 0
    err = done.stderr
    root = err.split("Root Cause (first observed failure):")[-1]
    assert "rank      : 1 (local_rank: 1)" in root and "SIGKILL" in root, err[-3000:]
    # the survivor either said who died (then waited for torchrun to stop it) or was stopped first
    said = [line for line in err.splitlines() if "PeerFailureError" in line or "Connection" in line]
    assert all("rank 1 (pid " in line and "has died" in line for line in said), said
    assert not (tmp_path / "rank0.json").exists()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
