"""DeepSpeed 0.19.8's own config parser as the oracle for hf_zero's (skipped where it cannot be installed).

One DeepSpeed process (tests/dsenv.py) reads DeepSpeed's schema from DeepSpeed itself
(tests/ds_config_schema.py: the keys ``DeepSpeedConfig`` looks up, and every field and alias of
its pydantic models, nested ones included) and parses every corpus config with its "auto"
values filled as the Trainer fills them. Then:

- every key of that schema, names and aliases, is known to hf_zero (acted on, inert or refused:
  ``config_schema.classify``), and a field and its alias land on one hf_zero key;
- every corpus config DeepSpeed accepts, hf_zero accepts too, or refuses it for offload or
  sequence parallelism (until their issues land) or for the feature a demo config exists to show.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from hf_zero.config_schema import SECTIONS, classify
from tests import dsenv
from tests.ds_corpus import CORPUS, DEEPSPEED_REFUSES, fill_autos, refused_for, verdict


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DeepSpeed's schema and its verdicts on the filled corpus, from one DeepSpeed process."""
    path: Path = tmp_path_factory.mktemp("ds_oracle") / "configs.json"
    path.write_text(json.dumps({s.file: fill_autos(s.load()) for s in CORPUS}))
    code = f"""
        import sys
        sys.argv = ["ds_config_schema", {str(path)!r}]
        from tests import ds_config_schema
        ds_config_schema.main()
    """
    done = dsenv.run_python(code, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_key_of_deepspeeds_schema_is_known_to_hf_zero(deepspeed: dict) -> None:
    keys: dict[str, str] = deepspeed["keys"]
    # the probe really read DeepSpeed: its ZeRO fields, an alias, a hand-read section, a nested model
    for path in ("zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                 "activation_checkpointing.cpu_checkpointing", "zero_optimization.offload_optimizer.ratio",
                 "comms_logger.prof_ops", "sequence_parallel_size"):
        assert path in keys, path
    assert len(keys) > 250, len(keys)
    unknown = sorted(path for path in keys if classify(path) is None)
    assert not unknown, f"DeepSpeed 0.19.8 keys hf_zero does not know: {unknown}"


def test_a_field_and_its_alias_are_one_key_in_hf_zero(deepspeed: dict) -> None:
    renamed = {old: new for old, new in deepspeed["renamed"].items() if " " not in new}
    assert deepspeed["aliases"]["zero_optimization.stage3_max_live_parameters"] == "zero_optimization.max_live_parameters"
    checked = 0
    for alias, field in {**deepspeed["aliases"], **renamed}.items():
        section, a = alias.rpartition(".")[::2]
        b = field.rpartition(".")[2]
        if section not in SECTIONS:
            continue  # a section hf_zero takes whole (tensor_parallel: refused)
        known = SECTIONS[section]
        if alias in renamed and a not in known.aliases:
            continue  # renamed with a conversion (cpu_offload: true -> offload_optimizer on the cpu): two keys
        assert known.aliases.get(a, a) == known.aliases.get(b, b), f"{alias} and {field} are two keys in hf_zero"
        checked += 1
    assert checked >= 10, checked


def test_every_config_deepspeed_accepts_hf_zero_accepts(deepspeed: dict) -> None:
    verdicts: dict[str, str] = deepspeed["verdicts"]
    assert set(verdicts) == {s.file for s in CORPUS}
    refused_by_deepspeed = {name for name, v in verdicts.items() if v != "ok"}
    assert refused_by_deepspeed == set(DEEPSPEED_REFUSES), {n: verdicts[n][:200] for n in refused_by_deepspeed}
    wrong = {}
    for source in CORPUS:
        if verdicts[source.file] != "ok":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = verdict(fill_autos(source.load()))
        if v.refused and not refused_for(v.refused, source):
            wrong[source.file] = v.refused
    assert not wrong, f"DeepSpeed accepts these, hf_zero refuses them: {wrong}"
