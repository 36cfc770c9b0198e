"""Real DeepSpeed configs from public repositories (tests/ds_corpus.py) through hf_zero's parser.

Each is accepted as published, "auto" left in as the Trainer passes it, or refused with the
sentence naming a feature hf_zero does not have yet (offload, sequence parallelism, or the
feature a DeepSpeed demo config exists to show), never as a typo or an unknown key, except
for a key DeepSpeed 0.19.8 refuses too (tests/ds_corpus.py's DEEPSPEED_REFUSES). With its
"auto" values filled as the Trainer fills them, an accepted config resolves to numbers.
COMPATIBILITY.md is generated from the same verdicts and must be current.
"""

from __future__ import annotations

import re

import pytest

from hf_zero.config import ZeroConfig
from tests.ds_corpus import (
    AS_DEEPSPEED,
    COMPATIBILITY,
    CONFIGS,
    CORPUS,
    compatibility_markdown,
    fill_autos,
    refused_for,
    verdict,
)

pytestmark = pytest.mark.filterwarnings("ignore:hf_zero")  # the warnings' contents: tests/test_config_rules.py


def _auto_paths(section: dict, prefix: str = "") -> set[str]:
    """Every JSON path whose value is "auto" ("amp": {"enabled": "auto"} gives amp.enabled)."""
    out = set()
    for key, value in section.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out |= _auto_paths(value, path)
        elif value == "auto":
            out.add(path)
    return out


def test_the_corpus_is_real_configs_with_their_sources() -> None:
    assert len(CORPUS) >= 30
    files = {s.file for s in CORPUS}
    assert len(files) == len(CORPUS) and files == {p.name for p in CONFIGS.glob("*.json")}
    assert len({s.repo for s in CORPUS}) >= 8
    for s in CORPUS:
        assert re.fullmatch(r"[0-9a-f]{40}", s.commit) and s.url.startswith("https://github.com/"), s
        assert isinstance(s.load(), dict), s.file


@pytest.mark.parametrize("source", CORPUS, ids=[s.file for s in CORPUS])
def test_each_config_is_accepted_or_refused_for_a_missing_feature(source) -> None:
    path = str(CONFIGS / source.file)
    v = verdict(path)
    if v.refused:
        assert refused_for(v.refused, source), f"{source.file} refused for something else: {v.refused}"
        assert AS_DEEPSPEED in v.refused or ("unknown key" not in v.refused and "did you mean" not in v.refused)
        return
    assert not source.refuses, f"{source.file} was expected to be refused ({source.refuses})"
    given = source.load()
    cfg = ZeroConfig.load(path)
    assert cfg.auto_keys == _auto_paths(given), "every \"auto\" is recorded for the Trainer to fill"
    assert cfg.raw == given
    filled = ZeroConfig.load(fill_autos(given))  # what the Trainer hands the engine
    assert not filled.auto_keys
    filled.resolve_batch_sizes(2)
    assert filled.train_batch_size == filled.train_micro_batch_size_per_gpu * filled.gradient_accumulation_steps * 2


def test_only_offload_sequence_parallel_and_demo_features_are_refused() -> None:
    refused = {s.file: verdict(str(CONFIGS / s.file)).refused for s in CORPUS}
    mainstream = [s for s in CORPUS if not s.refuses]
    accepted = [s for s in mainstream if not refused[s.file]]
    assert len(accepted) >= 30, f"{len(accepted)} accepted"
    allowed = ("", "offload", "sequence parallelism", "as DeepSpeed 0.19.8")
    assert all(refused_for(refused[s.file], s) in allowed for s in mainstream)


def test_compatibility_md_is_generated_from_the_corpus() -> None:
    assert COMPATIBILITY.read_text(encoding="utf-8") == compatibility_markdown(), (
        "COMPATIBILITY.md is stale: run `python -m tests.ds_corpus`")
