"""DeepSpeed's own unit tests against hf_zero: the quick part of the conformance harness, and its honesty rules.

The whole harness (``python -m tests.conformance.run``, both sides, an hour or more on two cores) is run by
hand; ``subset.json`` records what each side gave. Here the hf_zero side runs ``subset.json``'s ``fast`` list
(tests of several areas that start no process, or one) and fails if a test recorded as passing under
hf_zero no longer does. The alias's stubs are checked to fail loudly, and COMPATIBILITY.md's section to be
the one ``subset.json`` gives. The vendored tests run in a pytest process of their own (with the DeepSpeed
oracle environment's interpreter, for DeepSpeed's test dependencies; its ``deepspeed`` is shadowed by the alias).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conformance.paths import ALIAS, REPO, SUBSET

SUBSET_DATA = json.loads(SUBSET.read_text())


def test_fast_part_passes_as_recorded(tmp_path: Path) -> None:
    from tests.conformance.run import run_side
    from tests.dsenv import deepspeed_python

    deepspeed_python()  # skips, saying why, where the environment cannot be built
    fast = SUBSET_DATA["fast"]
    assert len(fast) >= 10 and all(SUBSET_DATA["tests"][n].get("hf_zero") == "passed" for n in fast)
    results, _ = run_side("hf_zero", fast, tmp_path / "hf_zero.log")
    broken = {n: results.get(n, {}).get("reason", "not run") for n in fast if results.get(n, {}).get("outcome") != "passed"}
    assert not broken, f"DeepSpeed tests recorded as passing under hf_zero now fail: {broken}"


def test_an_unmet_pytest_raises_in_a_rank_comes_back_as_a_failure() -> None:
    """The plugin's pool chunk runner: a rank's pytest ``Failed`` (a BaseException, which would end the pool worker
    unreported and hang DistributedTest) is raised as an AssertionError; results and other errors pass as they were."""
    import pytest

    from tests.conformance.plugin import _starmapstar

    def unmet() -> None:
        with pytest.raises(AssertionError):
            pass

    def broken() -> None:
        raise KeyError("k")

    assert _starmapstar((lambda a, b: a + b, [(1, 2), (3, 4)])) == [3, 7]
    # pytest 9.2 names the class bare ("DID NOT RAISE AssertionError"), earlier ones as "<class 'AssertionError'>"
    with pytest.raises(AssertionError, match=r"in a rank process: DID NOT RAISE (<class ')?AssertionError"):
        _starmapstar((unmet, [()]))
    with pytest.raises(KeyError):
        _starmapstar((broken, [()]))


def _alias(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` with the alias first on the path, in a process of its own (never ``import deepspeed`` here)."""
    env = {"PYTHONPATH": f"{ALIAS}:{REPO}", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(REPO))


def test_alias_is_hf_zero_and_its_stubs_fail_loudly() -> None:
    """``deepspeed.X`` is hf_zero's; a stubbed internal raises naming itself when used; isinstance says False and
    is logged; a name hf_zero lacks stays an AttributeError; an unmapped module path is a ModuleNotFoundError."""
    out = _alias("""
        import json, os, tempfile
        log = os.path.join(tempfile.mkdtemp(), "alias.log")
        os.environ["HF_ZERO_ALIAS_LOG"] = log
        import deepspeed, hf_zero, hf_zero.comm
        import deepspeed.comm as dist
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.moe.layer import MoE
        seen = {"initialize": deepspeed.initialize is hf_zero.initialize, "comm": dist.get_rank is hf_zero.comm.get_rank,
                "isinstance": isinstance(object(), FP16_UnfusedOptimizer), "hasattr": hasattr(deepspeed, "no_such_name")}
        for name, use in (("call", lambda: MoE(8)), ("attr", lambda: FP16_UnfusedOptimizer.step)):
            try:
                use()
            except NotImplementedError as e:
                seen[name] = f"{type(e).__name__}: {e}"
        try:
            import deepspeed.inference.v2
        except ModuleNotFoundError as e:
            seen["module"] = str(e)
        seen["log"] = open(log).read().split()
        print(json.dumps(seen))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["initialize"] and seen["comm"] and not seen["isinstance"] and not seen["hasattr"]
    assert seen["call"].startswith("InternalName: deepspeed.moe.layer.MoE is DeepSpeed-internal") and "calls it" in seen["call"]
    assert "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer" in seen["attr"] and "reads .step" in seen["attr"]
    assert "No module named 'deepspeed.inference'" in seen["module"] and "neither maps nor stubs it" in seen["module"]
    assert "isinstance" in seen["log"] and "deepspeed.moe.layer.MoE" in seen["log"]


def test_compatibility_md_shows_the_recorded_results() -> None:
    from tests.conformance.report import COMPATIBILITY, section

    assert section(SUBSET_DATA) in COMPATIBILITY.read_text(encoding="utf-8"), (
        "COMPATIBILITY.md's conformance section is stale: run `python -m tests.conformance.run --markdown`")
