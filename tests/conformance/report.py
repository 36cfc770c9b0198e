"""COMPATIBILITY.md's section on DeepSpeed's own unit tests, written from ``subset.json``.

``python -m tests.conformance.run --markdown`` calls :func:`write_compatibility`. The section sits below
``tests.ds_corpus``'s marker (that generator keeps what follows it) between markers of its own, so each
generator rewrites only its part; ``tests/test_conformance.py`` fails when the section is stale.
"""

from __future__ import annotations

import collections
from typing import Any

from tests.conformance.paths import REPO
from tests.conformance.run import PASSED, figure, table
from tests.ds_corpus import KEEP_MARKER

COMPATIBILITY = REPO / "COMPATIBILITY.md"
BEGIN, END = "<!-- conformance: python -m tests.conformance.run --markdown -->", "<!-- /conformance -->"


def section(subset: dict[str, Any]) -> str:
    tests = subset["tests"]
    both, ds = figure(tests)
    outcomes = collections.Counter(r.get("deepspeed", "not run") for r in tests.values())
    files = sorted({n.split("::")[0] for n in tests})
    failing = {n: r for n, r in tests.items() if r.get("deepspeed") == PASSED and r.get("hf_zero") != PASSED}
    reasons = collections.Counter(r.get("reason", "") for r in failing.values())
    seconds = subset.get("seconds", {})
    lines = [
        BEGIN,
        "",
        "## DeepSpeed's own unit tests, run against hf_zero",
        "",
        f"**{both} of the {ds} tests that pass under DeepSpeed 0.19.8 pass under hf_zero"
        + (f" ({100 * both / ds:.1f}%).**" if ds else ".**"),
        "",
        f"`python -m tests.conformance.run` runs {len(tests)} tests of DeepSpeed's own `tests/unit` (from {len(files)} files,"
        " vendored verbatim in `tests/conformance/deepspeed_unit/`, whose README names the commit and the one edit)"
        " twice on the CPU, each side in its own pytest process and with the same packages: under DeepSpeed 0.19.8"
        " (`DS_ACCELERATOR=cpu`), and with `import deepspeed` resolving to hf_zero through `tests/conformance/alias/`."
        " The alias maps DeepSpeed's module paths to hf_zero's modules; where a test file imports a DeepSpeed internal"
        " (or a public name hf_zero lacks) at module level, the alias puts a stub there that raises, naming itself,"
        " when a test uses it, so a test fails on what it uses and never passes on something stubbed. Both sides see"
        " `LOCAL_SIZE=4`, as DeepSpeed's launcher exports, so DeepSpeed's CPU accelerator runs its 2- and 4-rank tests"
        " instead of skipping them.",
        "",
        f"Which tests: every test of those files except the functions `tests/conformance/select.py` excludes, each with"
        f" its reason (attributes of DeepSpeed's config class that hf_zero's view of it lacks, internal helpers, ZeRO++"
        f" and MiCS); of a function with more than {subset.get('cap')} parametrizations every k-th in DeepSpeed's"
        f" order, so that {subset.get('cap')} remain (but for {len(subset.get('uncapped', {}))} function(s) kept whole,"
        " each with its reason); and of a function parametrized over the ZeRO stage whose chosen ids hold no stage 3,"
        " the stage-3 id of each chosen stage-1 or stage-2 one. Under DeepSpeed on this CPU: "
        + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
        + "; a test DeepSpeed skips or fails here counts on neither side.",
        "",
    ]
    if seconds:
        lines += ["Time for the whole subset on a 2-core machine shared with other jobs: "
                  + ", ".join(f"{side} side {s // 60} min {s % 60} s" for side, s in seconds.items()) + ".", ""]
    if failing:
        lines += ["Tests that pass under DeepSpeed and not under hf_zero, by reason:", ""]
        lines += [f"- {count} × {why}" for why, count in reasons.most_common()]
        lines.append("")
    lines += ["<details><summary>Every test of the subset</summary>", "", table(tests, markdown=True), "", "</details>",
              "", END]
    return "\n".join(lines)


def write_compatibility(subset: dict[str, Any]) -> None:
    text = COMPATIBILITY.read_text(encoding="utf-8")
    new = section(subset)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + new + rest.split(END, 1)[1]
    else:
        if KEEP_MARKER not in text:
            text = text.rstrip("\n") + "\n\n" + KEEP_MARKER + "\n"
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    COMPATIBILITY.write_text(text, encoding="utf-8")
