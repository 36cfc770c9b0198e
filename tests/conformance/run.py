"""DeepSpeed's own unit tests as hf_zero's conformance suite: one command, both sides, one table.

``python -m tests.conformance.run`` runs the chosen subset of DeepSpeed 0.19.8's ``tests/unit``
(``subset.json``; vendored in ``deepspeed_unit/``) twice on the CPU, each side a pytest subprocess of its own:

- **deepspeed**: DeepSpeed 0.19.8 itself (the oracle environment of ``tests/dsenv.py``, ``DS_ACCELERATOR=cpu``);
- **hf_zero**: the same interpreter with ``tests/conformance/alias`` first on the path, so that
  ``import deepspeed`` is hf_zero (see the alias's docstring for what it maps, computes and stubs).

Both sides get the same third-party packages and ``LOCAL_SIZE=4`` (what DeepSpeed's launcher exports: its CPU
accelerator counts that many devices, so two- and four-rank tests run instead of skipping). It prints a table
(test, DeepSpeed's result, hf_zero's, the reason for each hf_zero failure) and the figure: of the tests that
pass under DeepSpeed, how many pass under hf_zero. ``--record`` stores both results in ``subset.json`` (the
reasons there are written by hand and kept); ``--markdown`` rewrites the conformance section of
COMPATIBILITY.md from ``subset.json``. ``-k TEXT`` keeps the ids containing TEXT; ``--fast`` runs the quick
part ``tests/test_conformance.py`` uses; ``--side`` runs one side.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conformance.paths import ALIAS, LAST_RUN, REPO, SUBSET, VENDORED_TESTS

SIDES = ("deepspeed", "hf_zero")
PASSED = "passed"


def _python() -> Path:
    from tests.dsenv import build

    return build()


def side_command(side: str, args: list[str], *, ids: list[str] | None = None,
                 python: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The pytest command line and environment of one side (run it in ``VENDORED_TESTS``)."""
    from tests.dsenv import ds_environ

    env = ds_environ(LOCAL_SIZE="4", DS_UNITTEST_TIMEOUT="300", PYTHONDONTWRITEBYTECODE="1")
    # DeepSpeed compiles its CPU ops (cpu_adam, shm comm) on first use into torch's extension cache; a cache of
    # the harness's own keeps another process's build (or its stale lock, which torch waits on) out of the way.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hf_zero" / "conformance_torch_extensions"))
    if side == "hf_zero":
        env["PYTHONPATH"] = os.pathsep.join([str(ALIAS), str(REPO), env.get("PYTHONPATH", "")])
    elif side != "deepspeed":
        raise ValueError(f"side: got {side!r}, expected one of {SIDES}")
    cmd = [str(python or _python()), "-m", "pytest", "-p", "tests.conformance.plugin", "-p", "no:cacheprovider",
           "-o", "console_output_style=classic", *args, *(ids or [])]
    return cmd, env


STALL = float(os.environ.get("HF_ZERO_CONFORMANCE_STALL", "480"))  # seconds without a new result: a hang


def _run_until_stalled(cmd: list[str], env: dict[str, str], res_file: Path, out: Any) -> bool:
    """Run one pytest session; kill its whole process group when no test has finished for :data:`STALL` seconds.

    DeepSpeed's DistributedTest times a test out only while waiting for its ranks' results; a rank process or
    the pool's teardown that never returns hangs the session for good. Returns True when it had to be killed.
    """
    proc = subprocess.Popen(cmd, env=env, cwd=VENDORED_TESTS, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    last, seen = time.monotonic(), -1.0
    while proc.poll() is None:
        time.sleep(5)
        stamp = res_file.stat().st_mtime if res_file.exists() else 0.0
        if stamp != seen:
            seen, last = stamp, time.monotonic()
        elif time.monotonic() - last > STALL:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this harness started, with its rank processes
            proc.wait()
            return True
    return False


def run_side(side: str, ids: list[str], log: Path) -> tuple[dict[str, dict[str, Any]], float]:
    """Run ``ids`` on one side; a test that hangs or ends the session is marked, and the run goes on after it."""
    results: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    todo = list(ids)
    with tempfile.TemporaryDirectory() as tmp, open(log, "w", encoding="utf-8") as out:
        while todo:
            res_file, alias_log = Path(tmp) / "results.json", Path(tmp) / "alias.log"
            cmd, env = side_command(side, [], ids=todo)
            env.update(HF_ZERO_CONFORMANCE_OUT=str(res_file), HF_ZERO_ALIAS_LOG=str(alias_log))
            killed = _run_until_stalled(cmd, env, res_file, out)
            got = json.loads(res_file.read_text()) if res_file.exists() else {}
            res_file.unlink(missing_ok=True)
            for key, rec in got.items():
                if key.endswith("::<collection>"):
                    for node in todo:
                        if node.startswith(key.removesuffix("::<collection>") + "::"):
                            results[node] = {**rec, "outcome": "collection error"}
            results.update({k: v for k, v in got.items() if not k.endswith("::<collection>")})
            left = [node for node in todo if node not in results]
            if left:  # the session ended (or was ended) inside the first test it did not report
                why = (f"no test finished for {STALL:.0f} s; the session was killed in this test" if killed
                       else "the session ended in this test (DeepSpeed's own timeout, or a crash)")
                results[left[0]] = {"outcome": "hung", "reason": why, "seconds": 0.0}
                left = left[1:]
            todo = left
    return results, time.monotonic() - start


def figure(tests: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(pass under both, pass under DeepSpeed) over recorded or fresh results."""
    ds_pass = [n for n, r in tests.items() if r.get("deepspeed") == PASSED]
    return sum(tests[n].get("hf_zero") == PASSED for n in ds_pass), len(ds_pass)


def table(tests: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    rows = []
    for node, r in tests.items():
        ds, hf = r.get("deepspeed", "not run"), r.get("hf_zero", "not run")
        reason = r.get("reason", "")
        why = "" if hf == PASSED else (r.get("observed") if reason.startswith("UNCLASSIFIED") and r.get("observed")
                                       else reason or r.get("observed", ""))
        if ds != PASSED and hf != PASSED:
            why = "(does not count: " + (r.get("deepspeed_reason") or "fails under DeepSpeed") + ")"
        rows.append((node, ds, hf, why))
    if markdown:
        lines = ["| DeepSpeed test | DeepSpeed 0.19.8 | hf_zero | why hf_zero differs |", "|---|---|---|---|"]
        lines += [f"| `{n}` | {d} | {h} | {w.replace('|', '/')} |" for n, d, h, w in rows]
        return "\n".join(lines)
    width = max((len(n) for n, *_ in rows), default=10)
    return "\n".join(f"{n:<{width}}  {d:<16} {h:<16} {w}" for n, d, h, w in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.conformance.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=(*SIDES, "both"), default="both")
    ap.add_argument("-k", dest="keep", action="append", default=None,
                    help="only the test ids containing this text (repeat it: any of them)")
    ap.add_argument("--fast", action="store_true", help="only the quick part (subset.json's 'fast' list)")
    ap.add_argument("--record", action="store_true", help="store the results in subset.json")
    ap.add_argument("--markdown", action="store_true", help="rewrite COMPATIBILITY.md's conformance section and stop")
    opts = ap.parse_args(argv)
    subset = json.loads(SUBSET.read_text())
    if opts.markdown:
        from tests.conformance.report import write_compatibility

        write_compatibility(subset)
        return 0
    ids = list(subset["tests"])
    if opts.fast:
        ids = [n for n in ids if n in set(subset.get("fast", []))]
    if opts.keep:
        ids = [n for n in ids if any(k in n for k in opts.keep)]
    sides = SIDES if opts.side == "both" else (opts.side,)
    fresh: dict[str, dict[str, Any]] = {n: {} for n in ids}
    seconds = {}
    for side in sides:
        log = LAST_RUN.with_name(f"last_run_{side}.log")
        print(f"{side}: {len(ids)} tests (log: {log})", file=sys.stderr, flush=True)
        results, seconds[side] = run_side(side, ids, log)
        for node in ids:
            rec = results.get(node, {"outcome": "not run", "reason": ""})
            fresh[node][side] = rec["outcome"]
            fresh[node][f"{side}_observed"] = rec.get("reason", "")
            fresh[node][f"{side}_seconds"] = rec.get("seconds", 0.0)
            fresh[node][f"{side}_stubs"] = rec.get("stubs", [])  # none this time: the recorded ones go
        print(f"{side}: {seconds[side]:.0f} s", file=sys.stderr, flush=True)
    merged = {}
    for node in ids:
        # a side run now reports its own stub uses: the recorded ones of an earlier run do not carry over
        old = {k: v for k, v in subset["tests"].get(node, {}).items() if k not in {f"{s}_stubs" for s in sides}}
        rec = {**old, **fresh[node]}
        rec.setdefault("observed", rec.get("hf_zero_observed", ""))
        if rec.get("hf_zero") != PASSED:
            rec["observed"] = rec.get("hf_zero_observed", "")
        if rec.get("deepspeed") != PASSED and "deepspeed_observed" in rec:  # else the recorded reason stays
            rec["deepspeed_reason"] = rec["deepspeed_observed"]
        merged[node] = rec
    LAST_RUN.write_text(json.dumps({"seconds": seconds, "tests": merged}, indent=1) + "\n")
    print(table(merged))
    both, ds = figure(merged)
    print(f"\n{both} of {ds} tests that pass under DeepSpeed 0.19.8 pass under hf_zero"
          + (f" ({100 * both / ds:.1f}%)" if ds else "") + "; "
          + ", ".join(f"{s} side {t:.0f} s" for s, t in seconds.items()))
    if opts.record:
        keep = ("reason", "deepspeed_reason")
        for node, rec in merged.items():
            old = subset["tests"].get(node, {})
            new = {side: rec[side] for side in sides if side in rec}
            new.update({k: old[k] for k in (*SIDES, *keep) if k in old and k not in new})
            if "deepspeed" in sides and rec.get("deepspeed") != PASSED:
                new["deepspeed_reason"] = rec.get("deepspeed_observed", "")
            if "hf_zero" in sides and rec.get("hf_zero") == PASSED:
                new.pop("reason", None)
            elif "hf_zero" in sides and (not new.get("reason") or new["reason"].startswith("UNCLASSIFIED")):
                new["reason"] = "UNCLASSIFIED: " + rec.get("hf_zero_observed", "")  # a hand-written reason is kept
            if rec.get("hf_zero_stubs"):
                new["hf_zero_stubs"] = rec["hf_zero_stubs"]
            else:
                new.pop("hf_zero_stubs", None)
            subset["tests"][node] = new
        if not opts.fast and not opts.keep:
            subset["seconds"] = {s: round(t) for s, t in seconds.items()}
        SUBSET.write_text(json.dumps(subset, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
