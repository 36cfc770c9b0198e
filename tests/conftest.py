"""pytest settings for hf_zero's own suite: every test file has a kind, and ``-m unit`` runs the fast ones.

The kinds (issue 30's "tests by kind"), one per file in :data:`KINDS`:

- ``unit``: one process (a process group of world size 1 inside it, or a fresh interpreter to check an import,
  are allowed; ranks are not); the whole set runs in under two minutes on two cores: ``python -m pytest -m unit``.
  A unit test that starts ranks fails (the guard below), so the label cannot drift from what the file does;
- ``dist``: gloo ranks on the CPU (``tests/distributed.py``'s ``spawn``, or torchrun), equal to one process;
- ``oracle``: a peer as the reference (DeepSpeed 0.19.8 in its own environment, transformers, TRL, peft);
- ``integration``: the Trainer, Accelerate, the CLI, the README's job and examples, the Hub server.

Shared helpers live beside this file: ``distributed.py`` (spawn), ``models.py`` (tiny transformers models and
Trainer set-ups), ``dsenv.py`` (the DeepSpeed oracle), ``hub_server.py``, ``memtrack.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every process a test starts (torchrun, `hf-zero launch`, `accelerate launch`, the examples) imports the hf_zero of
# the checkout under test, not whichever tree an editable install last pointed at: a second clone's
# `pip install -e` re-points the shared install, and its launch tests then failed with "No module named 'hf_zero'".
_REPO = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH", "")]))

# DeepSpeed's unit tests, vendored for the conformance harness (python -m tests.conformance.run), which runs
# them in pytest sessions of their own under DeepSpeed and under hf_zero; they are not hf_zero's tests.
collect_ignore = ["conformance/deepspeed_unit"]

UNIT = ("test_api.py test_optim.py test_sequence_parallel.py test_config.py test_config_rules.py test_ds_corpus.py "
        "test_fill_auto.py test_layering.py test_trainer_args.py test_pipe_schedule.py test_ds_surface.py "
        "test_checkpoint_fileio.py test_init_memory.py test_offload_floor.py test_host_adam.py")
ORACLE = ("test_cpu_adam.py test_deepspeed_checkpoints.py test_deepspeed_autoep.py test_deepspeed_parity.py test_ds_config_oracle.py test_ds_config_view.py "
          "test_ds_semantics.py test_estimate_offload.py test_tensor_parallel.py test_trl.py test_peft.py "
          "test_any_module.py test_conformance.py test_pipe_topology.py test_ds_getters.py test_zenflow_deepspeed.py")
INTEGRATION = ("test_accelerate.py test_accelerate_deepspeed_yaml.py test_bench_checkpoint.py test_bench_finetune.py "
               "test_cli.py test_ds_corpus_trainer.py test_examples.py test_finetune.py test_host_overhead.py "
               "test_hub.py test_model_cards.py test_reliability_secrets.py test_sequence_parallel_trainer.py "
               "test_tensor_parallel_trainer.py test_trainer.py test_trainer_launch.py test_trainer_life.py "
               "test_preemption.py test_consolidated.py test_launch_multinode.py test_fp8_trainer.py test_fp8_loss_curve.py test_expert_accelerate.py")
DIST = ("test_activation_checkpointing.py test_async_checkpoint.py test_checkpoint.py test_checkpoint_faults.py "
        "test_compile.py test_ds_api.py test_host_threads.py test_memory.py test_nvme.py test_offload.py test_offload_overlap.py test_offload_parity.py test_offload_ratio.py test_zenflow.py "
        "test_overlap_param_gather.py test_parity.py test_pipe.py test_pipe_checkpoint.py test_precision.py "
        "test_reliability.py test_reliability_rank_death.py test_sequence_parallel_dist.py "
        "test_sequence_parallel_engine.py test_stage3.py test_stage3_tools.py test_zero_init.py test_planner.py "
        "test_hybrid_shard.py test_grid_parity.py test_bench_layouts.py test_released_params.py test_eval_memory.py "
        "test_fp8.py test_fp8_paths.py test_expert_parallel.py test_expert_checkpoint.py test_expert_trainer.py test_expert_peft.py "
        "test_unit_steps.py test_host_kernel_offload.py")
KINDS: dict[str, str] = {f: kind for kind, files in (("unit", UNIT), ("dist", DIST), ("oracle", ORACLE),
                                                       ("integration", INTEGRATION)) for f in files.split()}


def pytest_configure(config: pytest.Config) -> None:
    for kind in ("unit", "dist", "oracle", "integration"):
        config.addinivalue_line("markers", f"{kind}: a test of kind {kind} (tests/conftest.py says what each means)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        if name.startswith("test_") and Path(str(item.fspath)).parent == Path(__file__).parent:
            if name not in KINDS:
                raise pytest.UsageError(f"tests/{name} has no kind: add it to one list of tests/conftest.py")
            item.add_marker(KINDS[name])


@pytest.fixture(autouse=True)
def _unit_starts_no_ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked unit that starts ranks fails: its file belongs to another kind."""
    if request.node.get_closest_marker("unit") is None:
        return
    import torch.multiprocessing as mp

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} is marked unit but starts ranks; list its file under dist "
                             "(or another kind) in tests/conftest.py")

    monkeypatch.setattr(mp, "start_processes", refuse)
    monkeypatch.setattr(mp, "spawn", refuse)
