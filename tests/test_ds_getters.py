"""DeepSpeed's engine getters answer as DeepSpeed 0.19.8's do, for the same configs.

``tests/ds_oracle_getters.py`` builds one engine per config and calls every getter it lists; it runs under
DeepSpeed on the CPU (its own interpreter, ``tests/dsenv.py``) and here with ``hf_zero`` passed as
``deepspeed``. The answers must be equal, config by config and getter by getter (the getters live in
``hf_zero/engine/surface.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests import ds_oracle_getters as oracle
from tests import dsenv
from tests.distributed import spawn

# Where hf_zero answers otherwise on purpose, and why: (config, getter) -> (DeepSpeed's answer, hf_zero's answer).
KNOWN = {
    # hf_zero's config defaults steps_per_print to 10 (hf_zero/config/__init__.py): its step line every 10 steps;
    # DeepSpeed 0.19.8's default is None, never
    (config, "steps_per_print"): (None, 10) for config, c in oracle.CONFIGS.items() if "steps_per_print" not in c
}


def _hf_zero_side(rank: int, world: int) -> dict:
    import hf_zero

    return oracle.observe(hf_zero)


def test_the_getters_answer_what_deepspeed_answers(tmp_path: Path) -> None:
    out = tmp_path / "deepspeed.json"
    dsenv.run_torchrun(Path(oracle.__file__), 1, str(out), timeout=900)
    theirs = json.loads(out.read_text())
    ours = spawn(_hf_zero_side, 1)[0]
    assert sorted(ours) == sorted(theirs) == sorted(oracle.CONFIGS)
    differ = [f"{config}: {getter}: DeepSpeed {theirs[config].get(getter)!r}, hf_zero {ours[config].get(getter)!r}"
              for config in oracle.CONFIGS for getter in ("initialize", *oracle.GETTERS)
              if theirs[config].get(getter) != ours[config].get(getter)
              and KNOWN.get((config, getter)) != (theirs[config].get(getter), ours[config].get(getter))]
    assert not differ, "getters that answer otherwise than DeepSpeed's:\n" + "\n".join(differ)
    assert all(len(v) == len(oracle.GETTERS) for v in ours.values()), ours  # every config built an engine
