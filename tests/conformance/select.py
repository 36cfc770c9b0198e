"""Which of the vendored DeepSpeed tests form the conformance subset, by a rule written before any result.

``python -m tests.conformance.select`` collects the vendored files under DeepSpeed 0.19.8 and rewrites the
``tests`` list of ``subset.json``: every collected test except the functions named in :data:`EXCLUDED`
(each with its reason), and of a function with more than :data:`CAP` parametrizations every k-th in
DeepSpeed's collection order (k = ceil(n / CAP)), so that no one combinatorial grid outweighs the areas
(the functions in :data:`UNCAPPED` keep every case). Then, for a function parametrized over ``zero_stage`` whose
chosen ids hold no stage 3 while DeepSpeed collects stage-3 ids of it, the stage-3 id of each chosen stage-1 or
stage-2 id (the same other parameters), so that stage 3, hf_zero's hardest stage, is never sampled away.
Recorded results of tests that stay in the list are kept.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

from tests.conformance.paths import SUBSET, VENDORED_TESTS

CAP = 3
HELPERS = {"test_zero_user_backward.py"}  # vendored because a chosen file imports from it, not chosen itself

# test function (node id without parameters) -> why it is not in the subset
EXCLUDED: dict[str, str] = {
    **{f"unit/runtime/test_ds_config_dict.py::{name}": (
        "drives DeepSpeed's config class (DeepSpeedConfig) or its helpers directly, not through initialize, for "
        "attributes hf_zero's view of the config (hf_zero/config/deepspeed_view.py) does not carry; hf_zero's parser is "
        "compared with DeepSpeed's own by tests/test_ds_config_oracle.py, the view's batch arithmetic and attributes "
        "by tests/test_ds_config_view.py")
       for name in ("test_temp_config_json", "test_gradient_allreduce_op",
                    "test_gradient_allreduce_op_default", "test_invalid_gradient_allreduce_op",
                    "test_sum_gradient_allreduce_rejects_zero3", "test_sum_gradient_allreduce_rejects_zenflow",
                    "test_sum_gradient_allreduce_rejects_deepcompile", "test_gather_16bit_params_on_model_save",
                    "test_get_bfloat16_enabled", "test_quantized_eigenvalue_config_parses",
                    "test_compression_training_without_legacy_quantize_training_uses_defaults")},
    "unit/checkpoint/test_zero_optimizer.py::TestSaveTensorClone::test_save_tensor_clone":
        "tests DeepSpeed's internal helper deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "unit/checkpoint/test_zero_optimizer.py::test_elastic_checkpoint_is_deprecated_for_zero3":
        "tests a deprecation warning of DeepSpeed's internal DeepSpeedZeroConfig class",
    "unit/checkpoint/test_zero_optimizer.py::TestZeRONonDistributed::test_chmod_exception_handling":
        "tests the private engine._change_recovery_script_permissions",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROPPLoadCheckpoint::test_load_zeropp_model":
        "ZeRO++ (hpZ partitioning), a DeepSpeed feature hf_zero does not provide",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROPPLoadCheckpoint::test_load_zeropp_checkpoint":
        "ZeRO++ (hpZ partitioning), a DeepSpeed feature hf_zero does not provide",
    "unit/v1/zero/test_zero.py::TestPartitionNcclAlignment::test":
        "reads the NCCL alignment of DeepSpeed's internal partition buffers",
    "unit/v1/zero/test_zero.py::TestIncorectAllgatherBucketSize::test":
        "asserts DeepSpeed's internal constraint tying allgather_bucket_size to its NCCL buffer alignment",
    "unit/runtime/zero/test_zero_context.py::TestMiCSGatheredParametersFree::test":
        "MiCS (deepspeed.zero.MiCS_Init), a DeepSpeed feature hf_zero does not provide",
    "unit/runtime/zero/test_zero_context.py::test_multiple_all_gather_handles_wait_passes_dependency_by_keyword":
        "tests DeepSpeed's internal MultipleAllGatherHandles class",
    "unit/runtime/zero/test_zero_context.py::TestSerialContext::test_throughput_calculation":
        "reads the engine's internal throughput timer (engine.tput_timer)",
}


# test function -> why every one of its parametrizations is in the subset, past CAP
UNCAPPED: dict[str, str] = {
    "unit/runtime/test_ds_config_dict.py::TestBatchConfig::test":
        "four cases, each a different rule of the batch arithmetic (all sizes given, two given, refusals), and "
        "each runs in a second: sampling would drop a rule",
}


def collect() -> tuple[list[str], dict[str, dict]]:
    """Node ids of the vendored files, as DeepSpeed 0.19.8's pytest collects them, and each id's parameters."""
    from tests.conformance.run import side_command

    files = sorted(str(p.relative_to(VENDORED_TESTS)) for p in VENDORED_TESTS.rglob("test_*.py")
                   if p.name not in HELPERS)
    with tempfile.TemporaryDirectory() as tmp:
        cmd, env = side_command("deepspeed", ["--collect-only", "-q", *files])
        env["HF_ZERO_CONFORMANCE_IDS"] = str(Path(tmp) / "ids.txt")
        out = subprocess.run(cmd, env=env, cwd=VENDORED_TESTS, capture_output=True, text=True, timeout=900)
        ids_file = Path(tmp) / "ids.txt"
        ids = ids_file.read_text().split() if ids_file.exists() else []
        params_file = Path(str(ids_file) + ".params.json")
        params = json.loads(params_file.read_text()) if params_file.exists() else {}
    if not ids or out.returncode != 0:
        raise SystemExit(f"collection under DeepSpeed failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids, params


def choose(ids: list[str], params: dict[str, dict] | None = None) -> list[str]:
    params = params or {}
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for node in ids:
        groups.setdefault(node.split("[")[0], []).append(node)
    chosen = []
    for func, nodes in groups.items():
        if func in EXCLUDED:
            continue
        picked = nodes if func in UNCAPPED else nodes[:: math.ceil(len(nodes) / CAP)]
        chosen += picked + _stage3_siblings(picked, nodes, params)
    return chosen


def _stage3_siblings(picked: list[str], nodes: list[str], params: dict[str, dict]) -> list[str]:
    """The stage-3 ids of ``picked``'s stage-1/2 ids, when no picked id is at stage 3 and DeepSpeed has some."""
    def stage(node: str) -> object:
        return params.get(node, {}).get("zero_stage")

    if any(stage(n) == 3 for n in picked) or not any(stage(n) == 3 for n in nodes):
        return []
    out = []
    for node in picked:
        if stage(node) in (1, 2):
            want = {**params[node], "zero_stage": 3}
            out += [n for n in nodes if params.get(n) == want and n not in out]
    return out


def main() -> None:
    ids, params = collect()
    subset = json.loads(SUBSET.read_text()) if SUBSET.exists() else {}
    old = subset.get("tests", {})
    tests = {node: old.get(node, {}) for node in choose(ids, params)}
    subset.update({"rule": __doc__.split("\n\n")[1].replace("\n", " "), "cap": CAP, "excluded": EXCLUDED,
                   "uncapped": UNCAPPED, "collected": len(ids), "tests": tests})
    SUBSET.write_text(json.dumps(subset, indent=1) + "\n")
    print(f"{len(tests)} of {len(ids)} collected tests chosen -> {SUBSET}", file=sys.stderr)


if __name__ == "__main__":
    main()
