"""Where the conformance harness keeps things (imports nothing else, so every side can read it)."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENDORED = HERE / "deepspeed_unit"  # DeepSpeed's files, verbatim but for the edits its README lists
VENDORED_TESTS = VENDORED / "tests"  # pytest runs here: DeepSpeed's conftest.py and pytest.ini apply
ALIAS = HERE / "alias"  # first on the hf_zero side's path: its ``deepspeed`` package is hf_zero
SUBSET = HERE / "subset.json"  # the chosen tests and their recorded results
LAST_RUN = HERE / "last_run.json"  # what the latest run saw (not committed)
