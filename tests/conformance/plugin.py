"""pytest plugin for the conformance harness: one JSON record per DeepSpeed test, for either side.

Loaded with ``-p tests.conformance.plugin`` into the pytest that runs the vendored DeepSpeed tests (under
DeepSpeed's interpreter or under hf_zero's alias); it imports neither. It writes
``$HF_ZERO_CONFORMANCE_OUT`` (JSON: node id -> outcome, a one-line reason, seconds, and the alias stubs the
test reached, read from ``$HF_ZERO_ALIAS_LOG`` after each test), rewritten after every test so that a
run stopped part-way still says what it saw.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

_results: dict[str, dict[str, Any]] = {}

# DeepSpeed's DistributedTest starts a fresh pool of rank processes for every test, from a forkserver. With
# these modules imported once in that server, a rank starts by forking a process that already has them, not by
# importing torch and DeepSpeed (or hf_zero) again: seconds per test on an idle machine, tens on a loaded one.
# The same on both sides; what each test runs is unchanged.
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.comm", "unit.common", "unit.simple_model"]


def pytest_configure(config: pytest.Config) -> None:
    import multiprocessing
    import multiprocessing.pool

    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.pool.starmapstar = _starmapstar  # looked up when DistributedTest's pool.starmap_async is called


def _starmapstar(args: tuple[Any, Any]) -> list[Any]:
    """multiprocessing's ``starmapstar`` (one chunk of ``Pool.starmap``), with pytest's ``Failed`` reported.

    A ``pytest.raises`` that sees no exception (or a ``pytest.fail``) inside a DistributedTest rank raises
    ``Failed``, a BaseException: the pool worker lets it end the process without reporting the task, so
    DeepSpeed's DistributedTest waits for it until its timeout and its teardown hangs for good. Raised as an
    AssertionError, the pool hands it back to the test, which fails at once with pytest's line, as it would
    outside a rank. Nothing else changes, on either side: every other outcome passes through as it was.
    """
    import itertools

    try:
        return list(itertools.starmap(args[0], args[1]))
    except pytest.fail.Exception as e:
        raise AssertionError(f"in a rank process: {e.msg}") from None
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _reason(report: pytest.TestReport) -> str:
    """The line a reader needs: a skip's reason, or the exception line of a failure."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    text = _ANSI.sub("", text)
    # DistributedTest re-raises a worker's exception through multiprocessing: keep the worker's line
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:400]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    rec = _results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "seconds": 0.0})
    rec["seconds"] = round(rec["seconds"] + report.duration, 2)
    if report.when == "call" or report.failed or report.skipped:
        if report.skipped:
            rec["outcome"], rec["reason"] = "skipped", _reason(report)
        elif report.failed and rec["outcome"] != "failed":
            rec["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
            rec["reason"] = _reason(report)
    if report.when == "teardown":
        log = os.environ.get("HF_ZERO_ALIAS_LOG")
        if log and os.path.exists(log):
            with open(log, encoding="utf-8") as f:
                rec["stubs"] = sorted({ln.strip() for ln in f if ln.strip()})
            os.remove(log)
        _write()


def pytest_collection_finish(session: pytest.Session) -> None:
    out = os.environ.get("HF_ZERO_CONFORMANCE_IDS")  # tests.conformance.select: the ids, one a line
    if out:  # after pytest.ini's -m deselection (DeepSpeed's "sequential", "nightly", ... tests)
        with open(out, "w", encoding="utf-8") as f:
            f.write("".join(item.nodeid + "\n" for item in session.items))
        # and each id's parameters by name (select.py finds the ZeRO stage of a parametrized test there)
        params = {item.nodeid: {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                                for k, v in item.callspec.params.items()}
                  for item in session.items if hasattr(item, "callspec")}
        with open(out + ".params.json", "w", encoding="utf-8") as f:
            json.dump(params, f)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:  # a module that does not import: say so for the ids it would have held
        _results[f"{report.nodeid}::<collection>"] = {"outcome": "collection error", "reason": _reason(report),
                                                       "seconds": 0.0}
        _write()


def _write() -> None:
    out = os.environ.get("HF_ZERO_CONFORMANCE_OUT")
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
        os.replace(tmp, out)
