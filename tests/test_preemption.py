"""Preemption: SIGTERM (or SIGUSR1) makes every rank agree, save a resume checkpoint and exit with 128 + signum;
the next start resumes to the weights of a run never interrupted. Engine and hf_zero's Trainer, 2 gloo ranks.

This file is also the training script the tests start (``python tests/test_preemption.py OUT``, under torchrun
or as two processes by hand), driven by environment variables the way a real job is signalled:

- ``HFZ_TEST_MODE``: ``engine`` (a DeepSpeed-style loop, ZeRO 2, accumulation 2, a checkpoint every 2 steps)
  or ``trainer`` (hf_zero's Trainer: evaluation every 2 steps, ``save_steps`` 3, ``save_total_limit`` 1,
  ``async_save``);
- ``HFZ_TEST_PAUSE_AT``: ``step,micro`` (engine) or ``step`` (trainer: the first evaluation batch after that
  step): each rank writes its pid to ``pid_rank<r>`` and waits there until it has received a signal or the
  file ``signalled`` exists (only on the first start, never on a resumed one). The test signals meanwhile,
  so the signal lands at a known point: between two micro-steps, or during evaluation;
- ``HFZ_TEST_SLOW_SAVE``: ``global_step4:S`` sleeps S seconds in the first file write of that checkpoint (the
  signal then lands during a save; with ``async_save``, the write is still going when the script ends) and
  ``preempt:S`` in the preemption save (for a second signal or the grace period to cut short), after writing
  ``saving_rank<r>``. Only this script slows down; hf_zero is as shipped;
- ``HFZ_TEST_CHECKPOINT``: JSON merged into the config's ``checkpoint`` section.

Each rank writes ``exit_rank<r>`` (the status it exits with) when ``SystemExit`` leaves the script.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS, GAS, SAVE_EVERY = 8, 2, 2
TRAINER_STEPS = 6


def _wait_for_signal(out: Path, rank: int) -> None:
    from hf_zero.training import preemption

    (out / f"pid_rank{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while preemption.received() is None and not (out / "signalled").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _slow_saves(out: Path, rank: int) -> None:
    """Make one checkpoint write of this process slow (see the module doc), by wrapping the writer of each file."""
    spec = os.environ.get("HFZ_TEST_SLOW_SAVE")
    if not spec:
        return
    from hf_zero.checkpoint import save
    from hf_zero.training import preemption

    when, seconds = spec.split(":")
    real, done = save.write_file, []

    def slow(path, items, metadata=None, sync=True):  # noqa: ANN001, ANN202
        hit = f".{when}." in path or (when == "preempt" and preemption._WATCH.done)
        if hit and not done:
            done.append(path)
            (out / f"saving_rank{rank}").write_text(path)
            time.sleep(float(seconds))
        return real(path, items, metadata, sync)

    save.write_file = slow


def engine_main(out: Path, rank: int) -> None:
    import random

    import numpy as np
    import torch

    import hf_zero
    from tests.models import make_data, make_model

    if os.environ.get("HFZ_TEST_FILESTORE"):
        hf_zero.init_distributed(init_method="file://" + os.environ["HFZ_TEST_FILESTORE"])
    world = int(os.environ["WORLD_SIZE"])
    random.seed(rank)  # the checkpoint stores Python's and NumPy's streams too: the same in every run
    np.random.seed(rank)
    checkpoint = {"save_on_signal": ["SIGTERM", "SIGUSR1"], **json.loads(os.environ.get("HFZ_TEST_CHECKPOINT", "{}"))}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": None,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "checkpoint": checkpoint,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 40}}
    engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
    ckpt, resumed = out / "ckpt", False
    for folder in (Path(checkpoint.get("save_dir") or ckpt), ckpt):
        if (folder / "latest").exists():
            path, _ = engine.load_checkpoint(str(folder))
            (out / f"resumed_rank{rank}").write_text(os.path.basename(path))
            resumed = True
            break
    pause = os.environ.get("HFZ_TEST_PAUSE_AT")
    pause_at = tuple(int(x) for x in pause.split(",")) if pause and not resumed else None
    ids, labels = make_data(STEPS * GAS, 2 * world)
    mine = slice(2 * rank, 2 * rank + 2)
    while engine.global_steps < STEPS:
        for micro in range(GAS):
            if (engine.global_steps, micro) == pause_at:
                _wait_for_signal(out, rank)
            t = engine.global_steps * GAS + micro
            engine.backward(engine(ids[t, mine], labels[t, mine]))
            engine.step()
        if engine.global_steps % SAVE_EVERY == 0:
            engine.save_checkpoint(str(ckpt))
    engine.save_pretrained(str(out / "final"))
    torch.distributed.barrier()
    writing = engine._background is not None and engine._background.in_flight and engine._background.job.thread.is_alive()
    (out / f"writing_at_end_rank{rank}").write_text(str(writing))


def trainer_main(out: Path, rank: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    import hf_zero

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8))
    rows = [[(i * 5 + j * 7) % 32 for j in range(8)] for i in range(TRAINER_STEPS * 2 * 2)]
    data = Dataset.from_dict({"input_ids": rows, "labels": rows})
    evals = Dataset.from_dict({"input_ids": rows[:4], "labels": rows[:4]})
    run = out / "run"
    resumed = run.is_dir() and any(p.name.startswith("checkpoint-") for p in run.iterdir())
    pause = os.environ.get("HFZ_TEST_PAUSE_AT")
    pause_at = int(pause) if pause and not resumed else None

    class PauseInEvaluation(TrainerCallback):
        def on_prediction_step(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            nonlocal pause_at
            if state.global_step == pause_at:
                pause_at = None
                _wait_for_signal(out, rank)

    checkpoint = {"async_save": True, **json.loads(os.environ.get("HFZ_TEST_CHECKPOINT", "{}"))}
    zero = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "checkpoint": checkpoint}
    args = hf_zero.TrainingArguments(
        output_dir=str(run), per_device_train_batch_size=2, max_steps=TRAINER_STEPS, logging_steps=1, report_to="none",
        disable_tqdm=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2, save_strategy="steps",
        save_steps=3, save_total_limit=1, zero_config=zero, seed=0, learning_rate=1e-2)
    trainer = hf_zero.Trainer(model=model, args=args, train_dataset=data, eval_dataset=evals,
                              callbacks=[PauseInEvaluation()])
    trainer.train(resume_from_checkpoint=True if resumed else None)
    trainer.save_model(str(out / "final"))


def main(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    _slow_saves(out, rank)
    try:
        (trainer_main if os.environ.get("HFZ_TEST_MODE") == "trainer" else engine_main)(out, rank)
    except SystemExit as e:
        (out / f"exit_rank{rank}").write_text(f"{e.code} {time.time()!r}")
        raise


# ------------------------------------------------------------------------------ tests


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HFZ_TEST_", "HF_ZERO_", "TORCHELASTIC_", "ACCELERATE_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_hand(out: Path, world: int = 2, **extra: str) -> list[subprocess.Popen]:
    """The ranks started without torchrun, rendezvous over env:// (the test signals them one by one)."""
    out.mkdir(parents=True, exist_ok=True)
    port, procs = str(_free_port()), []
    for rank in range(world):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        procs.append(subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _torchrun(out: Path, **extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
            __file__, str(out)]
    return subprocess.Popen(argv, env=_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    results = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        results.append((p.returncode, text))
    return results


def _wait_for(path: Path, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _exit_of(out: Path, rank: int) -> int:
    return int((out / f"exit_rank{rank}").read_text().split()[0])


def _same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].equal(y[k]), k


@pytest.fixture(scope="module")
def engine_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run never interrupted: its final weights, and its checkpoints of steps 2, 4, 6 and 8 in ``ckpt``.

    Written in the background (``async_save``); the script ends without waiting for the last one, which the
    process's end does (the writer thread is joined before hf_zero.distributed.dist's exit barrier)."""
    out = tmp_path_factory.mktemp("engine_ref")
    for code, text in _finish(_by_hand(out, HFZ_TEST_MODE="engine", HFZ_TEST_SLOW_SAVE="global_step8:1",
                                       HFZ_TEST_CHECKPOINT=json.dumps({"async_save": True}))):
        assert code == 0, text[-3000:]
    assert [(out / f"writing_at_end_rank{r}").read_text() for r in (0, 1)] == ["True", "True"]
    assert (out / "ckpt" / "latest").read_text() == "global_step8"
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [f"global_step{s}" for s in (2, 4, 6, 8)] + ["latest"]
    return out


def test_sigterm_to_torchrun_between_micro_steps_saves_exits_143_and_resumes_to_the_same_weights(
    tmp_path: Path, engine_reference: Path
) -> None:
    """The launcher forwards SIGTERM; it lands between the two micro-steps of step 4: the ranks launch the
    all-reduce carrying it at that boundary (step 4) and decide at the next (step 5)."""
    extra = {"HFZ_TEST_MODE": "engine", "HFZ_TEST_PAUSE_AT": "3,1",
             "HFZ_TEST_CHECKPOINT": json.dumps({"save_dir": str(tmp_path / "preempt")})}
    launcher = _torchrun(tmp_path, **extra)
    for r in (0, 1):
        _wait_for(tmp_path / f"pid_rank{r}")
    os.kill(launcher.pid, signal.SIGTERM)
    (code, text), = _finish([launcher])
    assert [_exit_of(tmp_path, r) for r in (0, 1)] == [143, 143], text[-3000:]
    assert (tmp_path / "preempt" / "latest").read_text() == "global_step5", text[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    assert "every rank stopped after step 5 and saved the resume checkpoint" in text, text[-3000:]
    print(f"\ntorchrun exited with {code} after forwarding SIGTERM; workers 143, saved global_step5")
    resumed = _finish(_by_hand(tmp_path, HFZ_TEST_MODE="engine",
                               HFZ_TEST_CHECKPOINT=json.dumps({"save_dir": str(tmp_path / "preempt")})))
    assert [c for c, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert (tmp_path / "resumed_rank1").read_text() == "global_step5"
    _same_weights(tmp_path / "final", engine_reference / "final")


def test_sigterm_to_one_rank_during_a_save_stops_both_with_the_uninterrupted_runs_checkpoint(
    tmp_path: Path, engine_reference: Path
) -> None:
    """Only rank 1 is signalled, while the checkpoint of step 4 is being written: that save completes, the
    all-reduce of step 5 carries rank 1's flag to rank 0, and both save global_step6 and exit 143. That
    checkpoint is byte for byte the one the uninterrupted run wrote (in the background) at step 6, which
    resumes exactly, as the torchrun case shows."""
    procs = _by_hand(tmp_path, HFZ_TEST_MODE="engine", HFZ_TEST_SLOW_SAVE="global_step4:2")
    _wait_for(tmp_path / "saving_rank1")
    os.kill(procs[1].pid, signal.SIGTERM)
    results = _finish(procs)
    assert [c for c, _ in results] == [143, 143], results[0][1][-3000:] + results[1][1][-3000:]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step6"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "global_step4", "global_step6", "latest"]
    mine, ref = ckpt / "global_step6", engine_reference / "ckpt" / "global_step6"
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in ref.iterdir())
    for f in ref.iterdir():
        assert (mine / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_second_signal_exits_at_once_and_publishes_nothing(tmp_path: Path) -> None:
    """SIGTERM, then SIGUSR1 while the preemption checkpoint is being written: out at once with 128 + 10."""
    procs = _by_hand(tmp_path, HFZ_TEST_MODE="engine", HFZ_TEST_PAUSE_AT="3,1", HFZ_TEST_SLOW_SAVE="preempt:60")
    for r in (0, 1):
        _wait_for(tmp_path / f"pid_rank{r}")
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    _wait_for(tmp_path / "saving_rank0")
    t0 = time.monotonic()
    for p in procs:
        os.kill(p.pid, signal.SIGUSR1)
    results = _finish(procs)
    seconds = time.monotonic() - t0
    assert [c for c, _ in results] == [138, 138], results[0][1][-3000:]
    assert "received SIGUSR1 again" in results[0][1] and "exiting at once with status 138" in results[0][1]
    assert seconds < 20, seconds  # not the 60 s the save would have taken
    print(f"\nboth ranks exited 138 {seconds:.2f} s after the second signal")
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step4"
    assert not (ckpt / "global_step5").exists() and (ckpt / ".global_step5.partial").is_dir()


def test_the_grace_period_running_out_exits_at_once(tmp_path: Path) -> None:
    """One process, ``grace_seconds`` 2: the preemption save (slowed to 60 s) is cut short 2 s after the signal."""
    (proc,) = _by_hand(tmp_path, world=1, HFZ_TEST_MODE="engine", HFZ_TEST_PAUSE_AT="3,1",
                       HFZ_TEST_SLOW_SAVE="preempt:60", HFZ_TEST_CHECKPOINT=json.dumps({"grace_seconds": 2}))
    _wait_for(tmp_path / "pid_rank0")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    ((code, text),) = _finish([proc])
    seconds = time.monotonic() - t0
    assert code == 143, text[-3000:]
    assert "checkpoint.grace_seconds (2 s) ran out after SIGTERM: exiting at once with status 143" in text, text[-3000:]
    assert 1.5 < seconds < 20, seconds
    print(f"\nexited 143 {seconds:.2f} s after SIGTERM (grace_seconds 2)")
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step2" and not (ckpt / "global_step4").exists()


def test_trainer_sigterm_during_evaluation_saves_checkpoint_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    """hf_zero's Trainer (SIGTERM and SIGUSR1 on by default, ``async_save``, ``save_total_limit`` 1) under torchrun:
    the signal lands in the evaluation after step 2, the ranks decide at the end of step 4, ``checkpoint-4``
    is saved with its trainer state and every rank exits 143; ``resume_from_checkpoint=True`` finishes the run
    with the weights of one never interrupted."""
    ref = _finish([_torchrun(tmp_path / "ref", HFZ_TEST_MODE="trainer")])[0]
    assert ref[0] == 0, ref[1][-3000:]
    hit = tmp_path / "hit"
    launcher = _torchrun(hit, HFZ_TEST_MODE="trainer", HFZ_TEST_PAUSE_AT="2")
    for r in (0, 1):
        _wait_for(hit / f"pid_rank{r}")
    os.kill(launcher.pid, signal.SIGTERM)
    ((code, text),) = _finish([launcher])
    assert [_exit_of(hit, r) for r in (0, 1)] == [143, 143], text[-3000:]
    run = hit / "run"
    # checkpoint-3 (save_steps) stays while checkpoint-4 is written in the background, save_total_limit 1 or not
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3", "checkpoint-4"]
    assert (run / "checkpoint-4" / "trainer_state.json").is_file()
    assert (run / "checkpoint-4" / "zero_state" / "checkpoint.json").is_file()
    resumed = _finish([_torchrun(hit, HFZ_TEST_MODE="trainer")])[0]
    assert resumed[0] == 0, resumed[1][-3000:]
    _same_weights(hit / "final", tmp_path / "ref" / "final")


# ------------------------------------------------------------------ the signal watch itself, in this process


def test_checkpoint_keys_are_checked_with_their_json_path() -> None:
    from hf_zero.config import ZeroConfig
    from hf_zero.errors import ConfigError

    ok = ZeroConfig.load({"checkpoint": {"save_on_signal": ["sigterm", "SIGUSR1", "SIGTERM"], "save_dir": "/ckpt",
                                         "grace_seconds": 20, "async_save": True}})
    assert ok.checkpoint_save_on_signal == ("SIGTERM", "SIGUSR1") and ok.checkpoint_save_dir == "/ckpt"
    assert ok.checkpoint_grace_seconds == 20.0 and ok.checkpoint_async_save is True
    assert ZeroConfig.load({}).checkpoint_save_on_signal is None  # not given: the Trainer's default applies
    allowed = "SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP, SIGQUIT, SIGXCPU"
    refused = {
        '"SIGTERM"': ({"save_on_signal": "SIGTERM"}, "checkpoint.save_on_signal: got 'SIGTERM', expected a list of signal "
                      f'names such as ["SIGTERM", "SIGUSR1"] (any of {allowed})'),
        "TERM": ({"save_on_signal": ["TERM"]}, "checkpoint.save_on_signal[0]: got 'TERM', expected a signal's full name "
                 "such as 'SIGTERM'"),
        "SIGKILL": ({"save_on_signal": ["SIGUSR1", "SIGKILL"]}, "checkpoint.save_on_signal[1]: got 'SIGKILL', which no "
                    f"process can catch; expected one of {allowed}"),
        "SIGFOO": ({"save_on_signal": ["SIGFOO"]}, f"checkpoint.save_on_signal[0]: got 'SIGFOO', expected one of {allowed}"),
        "save_dir": ({"save_dir": ""}, "checkpoint.save_dir: got '', expected a folder path (a non-empty string)"),
        "grace": ({"grace_seconds": 0}, "checkpoint.grace_seconds: got 0, expected a positive number"),
        "async": ({"async_save": "yes"}, "checkpoint.async_save: got 'yes', expected true or false"),
    }
    for name, (section, sentence) in refused.items():
        with pytest.raises(ConfigError) as e:
            ZeroConfig.load({"checkpoint": section})
        assert str(e.value) == sentence, name


def test_one_delivery_twice_is_one_request_a_different_signal_exits_and_forked_children_keep_sigterm() -> None:
    """Two SIGUSR1 within a second (the scheduler's and torchrun's) are one request; SIGUSR2 after exits with 140;
    the grace timer exits with 128 + signum; a forked child (a DataLoader worker) still dies of SIGTERM."""
    from hf_zero.training import preemption

    watch = preemption._WATCH
    exits: list[int] = []
    real_exit, watch.exit = watch.exit, exits.append
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert watch.start([signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM], grace=None)
        pid = os.fork()
        if pid == 0:  # the child: the handlers it inherited are gone, SIGTERM kills it
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        time.sleep(0.2)
        assert preemption.received() is None  # the child's signal never reached this process's record
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        assert preemption.received() == signal.SIGUSR1 and exits == []
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.3)
        assert exits == [128 + signal.SIGUSR2]
        watch.stop()
        assert signal.getsignal(signal.SIGUSR1) == previous and preemption.received() is None
        assert watch.start([signal.SIGUSR1], grace=0.3)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.8)
        assert exits == [128 + signal.SIGUSR2, 128 + signal.SIGUSR1]
    finally:
        while watch.users > 0:
            watch.stop()
        watch.exit = real_exit
    assert signal.getsignal(signal.SIGUSR1) == previous


if __name__ == "__main__":
    main(Path(sys.argv[1]))
