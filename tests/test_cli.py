"""``hf-zero launch`` (DeepSpeed flags -> torchrun) and ``hf-zero estimate`` (this engine's memory model).

The launch tests start real torchrun process groups on CPU (gloo), so they cost a few seconds
each; everything else checks the flag translation and the arithmetic without starting processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_zero.launch import cli
from hf_zero.planning.estimate import (
    GIB,
    MemoryEstimate,
    count_model_parameters,
    estimate_memory,
    estimate_offload_memory,
    offload_host_bytes,
    optimizer_state_bytes_per_element,
    parse_param_count,
)

# ------------------------------------------------------------------------------ helpers

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    record = {"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]), "sum": t.item(),
              "argv": sys.argv[1:], "omp": os.environ.get("OMP_NUM_THREADS"),
              "nccl": os.environ.get("NCCL_HFZ_TEST")}
    sys.stdout.write("RESULT " + json.dumps(record) + "\\n")  # one write: lines of two ranks never mix
    sys.stdout.flush()
    dist.destroy_process_group()
    if rank == 1 and "--fail_on_rank1" in sys.argv:
        sys.exit(3)
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_env() -> dict[str, str]:
    """The caller's environment on a machine seen as GPU-less, with a NCCL variable to follow."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"CUDA_VISIBLE_DEVICES": "", "NCCL_HFZ_TEST": "kept"})
    return env


def _hf_zero(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_zero.launch.cli", *args],
        cwd=cwd,
        env=env or _cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _results(stdout: str) -> list[dict]:
    return sorted(
        (json.loads(line[len("RESULT ") :]) for line in stdout.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )


def _plan(argv: list[str], environ: dict[str, str] | None = None, gpus: int = 0) -> cli.LaunchPlan:
    args = cli.build_parser().parse_args(["launch", *argv])
    return cli.plan_launch(args, environ or {}, gpus)


# ------------------------------------------------------------------ launch: real processes


def test_launch_two_cpu_ranks_all_reduce_and_pass_args_through(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    port = _free_port()
    argv = f"launch --num_gpus 2 --master_port {port} script.py --foo 1 --num_gpus 7".split()
    proc = _hf_zero(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = _results(proc.stdout)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2
        assert r["sum"] == 3.0  # (0 + 1) + (1 + 1)
        assert r["argv"] == ["--foo", "1", "--num_gpus", "7"]  # flags after the script belong to it
        assert r["omp"] == "1"  # CPU ranks, user did not set it
        assert r["nccl"] == "kept"
    launch_lines = [line for line in proc.stderr.splitlines() if line.startswith("hf-zero launch: ")]
    assert launch_lines[0] == "hf-zero launch: no GPU is visible: starting 2 CPU processes (communication over gloo)"
    assert len(launch_lines) == 2  # said once, by the launcher, not by each rank
    assert "torch.distributed.run" in launch_lines[1]
    assert "--nproc-per-node=2" in launch_lines[1] and f"--master-port={port}" in launch_lines[1]


def test_launch_propagates_a_failing_rank(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    env = {**_cpu_env(), "OMP_NUM_THREADS": "2"}
    proc = _hf_zero(
        ["launch", "--num_gpus=2", f"--master_port={_free_port()}", "script.py", "--fail_on_rank1"],
        tmp_path,
        env,
    )
    assert proc.returncode != 0
    results = _results(proc.stdout)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [r["omp"] for r in results] == ["2", "2"]  # the user's setting wins


@pytest.mark.parametrize(
    "flags, match",
    [(["--hostfile", "hosts"], "--hostfile hosts does not exist"), (["-H", "hosts"], "--hostfile hosts does not exist"),
     (["--launcher", "pdsh"], "--launcher is for starting the hosts of a hostfile"), (["--ssh_port", "22"], "there is none")],
)
def test_launch_host_flags_need_a_hostfile(flags: list[str], match: str, tmp_path: Path) -> None:
    """The flags of DeepSpeed's multi-node launch (tests/test_launch_multinode.py) without a hostfile to start."""
    if flags[0] != "--hostfile":  # the CLI path once; the rest through the planning only
        from hf_zero.launch import job

        with pytest.raises(cli.LaunchError, match=match):
            job.plan(cli.build_parser().parse_args(["launch", *flags, "train.py"]), {}, cwd=str(tmp_path))
        return
    proc = _hf_zero(["launch", *flags, "--num_gpus", "2", "train.py"], tmp_path)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("hf-zero launch: error: --hostfile hosts does not exist") and "\n" not in err
    assert proc.stdout == ""


# -------------------------------------------------------------- launch: flag translation


def test_plan_maps_flags_one_to_one_onto_torchrun() -> None:
    plan = _plan(
        [
            "--num_nodes",
            "2",
            "--node_rank",
            "1",
            "--master_addr",
            "10.1.2.3",
            "--master_port",
            "6000",
            "--max_restarts",
            "3",
            "--num_gpus",
            "4",
            "train.py",
            "--lr",
            "1e-4",
            "--num_nodes",
            "9",
        ],
        environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
        gpus=4,
    )
    assert plan.argv == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--node-rank=1",
        "--master-addr=10.1.2.3",
        "--master-port=6000",
        "--max-restarts=3",
        "train.py",
        "--lr",
        "1e-4",
        "--num_nodes",
        "9",
    ]
    assert plan.env_updates == {}  # GPU run: OMP_NUM_THREADS is torchrun's business
    assert plan.command_line().endswith("train.py --lr 1e-4 --num_nodes 9")


def test_plan_defaults() -> None:
    gpu = _plan(["train.py"], gpus=8)
    assert "--nproc-per-node=8" in gpu.argv and "--master-port=29500" in gpu.argv
    assert "--master-addr=127.0.0.1" in gpu.argv and "--nnodes=1" in gpu.argv and "--node-rank=0" in gpu.argv
    cpu = _plan(["train.py"], gpus=0)
    assert "--nproc-per-node=1" in cpu.argv and cpu.env_updates == {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    assert cpu.notice == "no GPU is visible: starting 1 CPU process (communication over gloo)" and gpu.notice == ""
    assert _plan(["--num_gpus", "3", "train.py"], {"OMP_NUM_THREADS": "4", "ACCELERATE_USE_CPU": "0"}).env_updates == {}
    assert "--nproc-per-node=3" in _plan(["--num_accelerators", "3", "train.py"]).argv
    module = _plan(["--module", "pkg.train", "--x"])
    assert module.argv[-3:] == ["--module", "pkg.train", "--x"]
    assert _plan(["--no_python", "./run.sh"]).argv[-2:] == ["--no-python", "./run.sh"]
    # DeepSpeed flags that describe what torchrun does anyway are accepted
    assert _plan(["--no_local_rank", "--no_ssh", "train.py"]).argv[-1] == "train.py"


@pytest.mark.parametrize(
    "argv, gpus, match",
    [
        (["--num_nodes", "2", "--node_rank", "0", "train.py"], 0, "--master_addr"),
        (["--num_nodes", "2", "--master_addr", "h0", "train.py"], 0, "--node_rank"),
        (["--num_nodes", "2", "--master_addr", "h0", "--node_rank", "2", "train.py"], 0, r"\[0, 2\)"),
        (["--num_gpus", "5", "train.py"], 4, "4 visible GPU"),
        (["--num_gpus", "0", "train.py"], 0, ">= 1"),
        (["--include", "localhost:0", "train.py"], 0, "no visible GPU"),
        (["--include", "localhost:0", "--num_gpus", "1", "train.py"], 2, "cannot be combined"),
        (["--include", "worker-1:0", "train.py"], 2, "this node"),
        (["--include", "localhost:7", "train.py"], 2, "GPU 7"),
        (["--include", "localhost:0", "--exclude", "localhost:1", "train.py"], 2, "mutually exclusive"),
        (["--exclude", "localhost", "train.py"], 2, "leaves no GPU"),
        (["--elastic_training", "train.py"], 2, "does not support"),
        (["--force_multi", "train.py"], 2, "starts other hosts"),
        (["--num_nodes", "2", "train.py"], 0, "pass --hostfile H"),
    ],
)
def test_plan_errors_are_one_sentence(argv: list[str], gpus: int, match: str) -> None:
    with pytest.raises(cli.LaunchError, match=match) as info:
        _plan(argv, gpus=gpus)
    assert "\n" not in str(info.value) and str(info.value).endswith(".")


def test_plan_include_exclude_set_visible_devices() -> None:
    inc = _plan(["--include", "localhost:1,3", "train.py"], gpus=4)
    assert inc.env_updates == {"CUDA_VISIBLE_DEVICES": "1,3"} and "--nproc-per-node=2" in inc.argv
    exc = _plan(["-e", "localhost:0", "train.py"], gpus=4)
    assert exc.env_updates == {"CUDA_VISIBLE_DEVICES": "1,2,3"} and "--nproc-per-node=3" in exc.argv
    # ids are the ones CUDA_VISIBLE_DEVICES already names
    narrowed = _plan(["--exclude", "localhost:5", "train.py"], {"CUDA_VISIBLE_DEVICES": "4,5,6"}, gpus=3)
    assert narrowed.env_updates == {"CUDA_VISIBLE_DEVICES": "4,6"}
    whole = _plan(["--include", f"{socket.gethostname()}", "train.py"], gpus=2)
    assert whole.env_updates == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_help_lists_only_built_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "launch" in out and "estimate" in out and "consolidate" in out
    with pytest.raises(SystemExit) as info:
        cli.main(["export", "out"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------------------ estimate: formulas

PSI, N = 1000, 3  # a shard is ceil(1000 / 3) = 334 elements: padded, uneven


# (params, grads, optim) bytes for stages 0..3, by hand: 1336 = 4*334, 2672 = 8*334, 4008 = 12*334;
# 16-bit stage 3 keeps no 16-bit parameters between steps (units are cast from the fp32 masters);
# stages 1-3 hold only the reduced gradient shard at the step (stage 1's full gradients are freed once reduced)
# fmt: off
EXPECTED = {
    ("fp32", "adam"):         [(4000, 4000, 8000), (4000, 1336, 2672), (4000, 1336, 2672), (1336, 1336, 2672)],
    ("fp32", "sgd"):          [(4000, 4000, 0), (4000, 1336, 0), (4000, 1336, 0), (1336, 1336, 0)],
    ("fp32", "sgd_momentum"): [(4000, 4000, 4000), (4000, 1336, 1336), (4000, 1336, 1336), (1336, 1336, 1336)],
    ("bf16", "adam"):         [(2000, 6000, 12000), (2000, 1336, 4008), (2000, 1336, 4008), (0, 1336, 4008)],
    ("fp16", "adamw"):        [(2000, 6000, 12000), (2000, 1336, 4008), (2000, 1336, 4008), (0, 1336, 4008)],
    ("bf16", "sgd"):          [(2000, 6000, 4000), (2000, 1336, 1336), (2000, 1336, 1336), (0, 1336, 1336)],
}
# fmt: on


@pytest.mark.parametrize("dtype, optimizer", list(EXPECTED))
def test_estimate_memory_matches_the_engine_model(dtype: str, optimizer: str) -> None:
    for stage, (params, grads, optim) in enumerate(EXPECTED[dtype, optimizer]):
        est = estimate_memory(PSI, N, stage, dtype, optimizer)
        assert isinstance(est, MemoryEstimate) and est.stage == stage
        assert (est.params_bytes, est.grads_bytes, est.optim_bytes) == (params, grads, optim), (stage, est)
        assert est.total_bytes == params + grads + optim
        assert "Ψ" in est.formula


def test_estimate_memory_edges_and_errors() -> None:
    # one rank: sharding changes nothing, except that from stage 1 on the 16-bit gradients are
    # freed once reduced into the fp32 ones, and stage 3 keeps no 16-bit parameters between steps
    assert [estimate_memory(PSI, 1, s, "fp32").total_bytes for s in range(4)] == [16 * PSI] * 4
    bf16_totals = [estimate_memory(PSI, 1, s, "bf16").total_bytes for s in range(4)]
    assert bf16_totals == [20 * PSI, 18 * PSI, 18 * PSI, 16 * PSI]
    assert estimate_memory(PSI, N, 2, "bf16").formula == "params 2Ψ + grads 4Ψ/N + optim (4+8)Ψ/N"
    ks = [optimizer_state_bytes_per_element(o) for o in ("adam", "AdamW", "sgd", "sgd_momentum")]
    assert ks == [8, 8, 0, 4]
    with pytest.raises(ValueError, match="optimizer"):
        optimizer_state_bytes_per_element("lion")
    with pytest.raises(ValueError, match="stage"):
        estimate_memory(PSI, N, 4)
    with pytest.raises(ValueError, match="dtype"):
        estimate_memory(PSI, N, 1, "int8")
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(PSI, 0, 1)


def test_parse_param_count() -> None:
    assert parse_param_count("7B") == 7_000_000_000
    assert parse_param_count("1.1B") == 1_100_000_000
    assert parse_param_count("1.1e9") == 1_100_000_000
    assert parse_param_count("350M") == 350_000_000
    assert parse_param_count("125k") == 125_000
    assert parse_param_count("1_000") == 1000
    for bad in ("7x", "0", "-5", "B", ""):
        with pytest.raises(ValueError, match="--params"):
            parse_param_count(bad)


def test_estimate_cli_prints_four_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["estimate", "--params", "1.1B", "--num_gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "Ψ = 1,100,000,000" in out and "N = G*M = 4*1 = 4" in out and "N-1" in out
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line[:5].strip().isdigit()}
    assert sorted(rows) == [0, 1, 2, 3]
    for stage, cols in rows.items():
        est = estimate_memory(1_100_000_000, 4, stage, "bf16", "adam")
        assert cols[1:5] == [
            f"{b / GIB:.2f}" for b in (est.params_bytes, est.grads_bytes, est.optim_bytes, est.total_bytes)
        ]
    assert rows[3][4] == "4.10"  # (0 + 4/4 + 12/4) bytes * 1.1e9 / 2**30


# (device params, device grads, host) bytes for offload_optimizer cpu at stages 1..3, by hand: S = 334;
# host (4 master + 4 gradient copy + k) * 334, at stages 1-2 in 16 bits + 2 * 334 for the 16-bit copy sent to the
# device; stage 3 keeps only the compute-dtype shard on the device
# fmt: off
EXPECTED_OFFLOAD = {
    ("bf16", "adam"):         [(2000, 1336, 6012), (2000, 1336, 6012), (668, 1336, 5344)],
    ("fp32", "sgd"):          [(4000, 1336, 2672), (4000, 1336, 2672), (1336, 1336, 2672)],
    ("fp16", "sgd_momentum"): [(2000, 1336, 4676), (2000, 1336, 4676), (668, 1336, 4008)],
}
# fmt: on


@pytest.mark.parametrize("dtype, optimizer", list(EXPECTED_OFFLOAD))
def test_estimate_offload_memory_by_hand(dtype: str, optimizer: str) -> None:
    for stage, (params, grads, host) in zip((1, 2, 3), EXPECTED_OFFLOAD[dtype, optimizer]):
        est = estimate_offload_memory(PSI, N, stage, dtype, optimizer)
        assert (est.device_params_bytes, est.device_grads_bytes, est.host_bytes) == (params, grads, host), (stage, est)
        assert est.device_bytes == params + grads and est.stage == stage
        copy = 2 if stage < 3 and dtype != "fp32" else 0
        assert est.host_bytes == offload_host_bytes(334, optimizer_state_bytes_per_element(optimizer), copy_bytes=copy)
    with pytest.raises(ValueError, match="stage"):
        estimate_offload_memory(PSI, N, 0)  # offload needs a partitioned optimizer, as the config parser says
    with pytest.raises(ValueError, match="world_size"):
        estimate_offload_memory(PSI, 0, 2)


def test_estimate_cli_prints_offload_rows_per_rank_and_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["estimate", "--params", "7B", "--num_gpus", "8", "--num_nodes", "2"]) == 0
    out = capsys.readouterr().out
    rows = {int(line.split()[1]): line.split() for line in out.splitlines() if line.startswith("cpu ")}
    assert sorted(rows) == [1, 2, 3]
    for stage, cols in rows.items():
        est = estimate_offload_memory(7_000_000_000, 16, stage, "bf16", "adam")
        assert cols[2:5] == [f"{b / GIB:.2f}" for b in (est.device_bytes, est.host_bytes, 8 * est.host_bytes)]
    assert rows[3][2:5] == ["2.44", "6.52", "52.15"]  # (2 + 4)/16, 16/16 and 8 * 16/16 bytes * 7e9 / 2**30
    # stage 3 with offload_param too: the 2Ψ/N shard moves from the device column to the host ones
    param = next(line.split() for line in out.splitlines() if line.startswith("cpu+param "))
    est = estimate_offload_memory(7_000_000_000, 16, 3, "bf16", "adam", params=True)
    assert param[1] == "3" and param[2:5] == [f"{b / GIB:.2f}" for b in (est.device_bytes, est.host_bytes, 8 * est.host_bytes)]
    assert param[2:5] == ["1.63", "7.33", "58.67"]  # 4/16, 18/16 and 8 * 18/16 bytes * 7e9 / 2**30


# ------------------------------------------------------------------- estimate: counting


def _tiny_configs():
    from transformers import GPT2Config, LlamaConfig

    llama = LlamaConfig(
        vocab_size=97,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    gpt2 = GPT2Config(
        vocab_size=97, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return llama, gpt2


def test_count_model_parameters_matches_real_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    llama, gpt2 = _tiny_configs()
    for config in (llama, gpt2):
        torch.manual_seed(0)
        real = AutoModelForCausalLM.from_config(config)
        unique = sum(p.numel() for p in real.parameters())
        directory = tmp_path / config.model_type
        config.save_pretrained(directory)
        assert count_model_parameters(config) == unique
        assert count_model_parameters(directory) == unique
        assert count_model_parameters(directory / "config.json") == unique
        assert count_model_parameters(real) == unique
        with_ties = sum(p.numel() for _, p in real.named_parameters(remove_duplicate=False))
        if config is gpt2:  # lm_head.weight is wte.weight: counted once
            assert with_ties == unique + 97 * 16
        else:
            assert with_ties == unique
    # the CLI prints the count and uses it for Ψ
    assert cli.main(["estimate", "--model", str(tmp_path / "gpt2" / "config.json"), "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    n = count_model_parameters(gpt2)
    assert f"Ψ = {n:,} trainable params" in out and f"ceil(Ψ/N) = {n:,}" in out


def test_count_model_parameters_skips_frozen_and_rejects_other_inputs(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Linear(15, 3))
    assert count_model_parameters(model) == 7 * 15 + 15 + 15 * 3 + 3
    model[0].requires_grad_(False)
    assert count_model_parameters(model) == 15 * 3 + 3
    with pytest.raises(TypeError, match="PretrainedConfig"):
        count_model_parameters(42)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        count_model_parameters(tmp_path / "missing")


def test_estimate_ref_model_column_counts_a_frozen_copy_whole_at_stages_0_2_and_sharded_at_3(capsys: pytest.CaptureFixture) -> None:
    from hf_zero.launch.cli import main
    from hf_zero.planning.estimate import reference_model_bytes

    assert main(["estimate", "--params", "1.1B", "--num_gpus", "2", "--ref-model"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1] in "0123" and "+" in ln]
    assert [r[4] for r in rows] == ["2.05", "2.05", "2.05", "1.02"]  # ref GiB: 2 bytes x 1.1e9, halved at stage 3
    # with optimizer offload the frozen copy (no optimizer to offload) stays on the device
    offload = [ln.split() for ln in out.splitlines() if ln.startswith("cpu ")]
    for cols in offload:
        stage = int(cols[1])
        device = estimate_offload_memory(1_100_000_000, 2, stage).device_bytes + reference_model_bytes(1_100_000_000, 2, stage)
        assert cols[2] == f"{device / GIB:.2f}" and "+ ref 2Ψr" in " ".join(cols), cols
    assert len(offload) == 3
    assert [reference_model_bytes(10, 4, s, "fp32") for s in (2, 3)] == [40, 12]  # ceil(10/4) = 3 elements of 4 bytes
    assert main(["estimate", "--params", "1.1B", "--ref-model", "3e9"]) == 0
    assert "Ψr = 3,000,000,000" in capsys.readouterr().out
