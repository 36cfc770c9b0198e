"""DeepSpeed 0.19.8's own config parser as the oracle for hf_zero's (skipped where it cannot be installed).

One DeepSpeed process (tests/dsenv.py) reads DeepSpeed's schema from DeepSpeed itself
(tests/ds_config_schema.py: the keys ``DeepSpeedConfig`` looks up, and every field and alias of
its pydantic models, nested ones included) and parses every corpus config with its "auto"
values filled as the Trainer fills them. Then:

- every key of that schema, names and aliases, is known to hf_zero (acted on, inert or refused:
  ``config_schema.classify``), and a field and its alias land on one hf_zero key;
- every corpus config DeepSpeed accepts, hf_zero accepts too, or refuses it for offload or
  sequence parallelism (until their issues land) or for the feature a demo config exists to show;
- the sections DeepSpeed closes (a pydantic model with ``extra="forbid"``) are the sections hf_zero
  closes, with the same keys, save hf_zero's own and those older DeepSpeed accepted; DeepSpeed's table
  of removed keys is hf_zero's table of legacy keys;
- both directions on hand-made configs (:data:`CASES`): where DeepSpeed refuses, hf_zero refuses too or
  names the key in the warning saying DeepSpeed 0.19.8 refuses it (a typo in every closed section, a
  fractional ``fp16.min_loss_scale``, the legacy ``curriculum_learning`` and every removed key). One removed
  key hf_zero accepts even where it asks for its feature, knowingly: MiCS's ``mics_shard_size`` (older
  DeepSpeed configs carry it), which hf_zero runs as hybrid sharding (``hf_zero/parallel/grid.py``); where
  DeepSpeed accepts (keys that look odd: "auto" in a closed section, fp16 knobs dynamic scaling does
  not read, unknown keys where DeepSpeed reads key by key), hf_zero accepts. hf_zero's own keys in
  closed sections are the one listed exception (:data:`HF_ZERO_OWN`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from hf_zero.config.schema import CLOSED_WHOLE, SECTIONS, TOP, ZERO, classify
from hf_zero.config.unknown_keys import OWN_CLOSED
from tests import dsenv
from tests.ds_corpus import CORPUS, DEEPSPEED_REFUSES, fill_autos, refused_for, verdict

MB = {"train_micro_batch_size_per_gpu": 1}
# hf_zero's own keys inside sections DeepSpeed 0.19.8 closes: DeepSpeed refuses them, hf_zero acts on them
# (compile's were DeepSpeed 0.14.0-0.14.3's torch.compile fields; 0.16.6 on, compile is DeepCompile's model)
HF_ZERO_OWN = {"zero_optimization": {"overlap_param_gather"}, "compile": {"enabled", "backend", "kwargs"}}
# hf_zero's closed sections: the ones it walks key by key, and the ones it takes whole
CLOSED = ({path for path, section in SECTIONS.items() if section.closed} | set(CLOSED_WHOLE)) - set(OWN_CLOSED)  # OWN_CLOSED: ours alone


def _nest(path: str, value: object) -> dict:
    """``{"a": {"b": value}}`` for the path "a.b"."""
    for part in reversed(path.split(".")):
        value = {part: value}
    return value  # type: ignore[return-value]


# (name, config, DeepSpeed refuses it?): the two directions on configs made here
CASES: list[tuple[str, dict, bool]] = [
    *[(f"typo in {p}", {**MB, **_nest(p, {"typo_key": 1})}, True) for p in sorted(CLOSED)],
    ("typo in bfloat16", {**MB, "bfloat16": {"enabled": True, "typo_key": 1}}, True),
    ("the issue's bf16 typo", {**MB, "bf16": {"enabled": True, "typo_key": 1}}, True),
    ("fp16.fused_mode", {**MB, "fp16": {"enabled": True, "fused_mode": True}}, True),
    ("aio inside zero_optimization", {**MB, "zero_optimization": {"stage": 3, "aio": {"block_size": 262144}}}, True),
    ("fractional min_loss_scale, fp16 on", {**MB, "fp16": {"enabled": True, "min_loss_scale": 1e-10}}, True),
    ("fractional min_loss_scale, fp16 off", {**MB, "fp16": {"enabled": False, "min_loss_scale": 0.5}}, True),
    ("legacy curriculum_learning, disabled",
     {**MB, "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 8}}, True),
    ("legacy curriculum_learning, enabled",
     {**MB, "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                    "max_difficulty": 1024, "schedule_type": "fixed_linear",
                                    "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}}}, True),
    *[(f"removed {k} (asking for nothing)", {**MB, k: v}, True) for k, v in (
        ("amp", {"enabled": False}), ("nebula", {"enabled": False}), ("compression_training", {}),
        ("quantize_training", {"enabled": False}), ("sparse_gradients", False), ("eigenvalue", {"enabled": False}),
        ("sparse_attention", {}), ("elasticity", {"enabled": False}), ("graph_harvesting", False),
        ("progressive_layer_drop", {"enabled": False}))],
    *[(f"removed zero_optimization.{k}", {**MB, "zero_optimization": {"stage": 3, k: v}}, True) for k, v in (
        ("mics_shard_size", -1), ("mics_hierarchical_params_gather", False), ("zeropp_loco_param", None))],
    # MiCS asked for: DeepSpeed 0.19.8 refuses the key; hf_zero runs it (hybrid sharding) and names it in the warning
    ("removed zero_optimization.mics_shard_size 2 (hybrid sharding)",
     {**MB, "zero_optimization": {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}}, True),
    ("removed nebula, enabled", {**MB, "nebula": {"enabled": True}}, True),
    *[(f"hf_zero's {p}.{k}", {**MB, **_nest(p, {k: v})}, True) for p, k, v in (
        ("zero_optimization", "overlap_param_gather", True), ("compile", "enabled", True),
        ("compile", "backend", "inductor"), ("compile", "kwargs", {}))],
    # DeepSpeed accepts these, odd as they look
    *[(f"typo = auto in {p}", {**MB, **_nest(p, {"typo_key": "auto"})}, False) for p in ("bf16", "fp16", "wandb",
                                                                                        "zero_optimization.offload_param")],
    ("fp16 off: min_loss_scale 0, loss_scale_window 0", {**MB, "fp16": {"enabled": False, "min_loss_scale": 0,
                                                                        "loss_scale_window": 0}}, False),
    ("static loss scale: min_loss_scale 0", {**MB, "fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 0}}, False),
    ("integral float min_loss_scale", {**MB, "fp16": {"enabled": True, "min_loss_scale": 1.0}}, False),
    ("deprecated fp16 alias of a ZeRO key", {**MB, "zero_optimization": {"stage": 3,
                                                                         "stage3_gather_fp16_weights_on_model_save": True}}, False),
    ("boolean zero_optimization and allgather_size", {**MB, "zero_optimization": True, "allgather_size": 5e8}, False),
    ("tensor_parallel.tp", {**MB, "tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1}}}, False),
    ("unknown keys where DeepSpeed reads key by key",
     {**MB, "comms_config": {"verbose": False}, "checkpoint": {"keep": 1}, "activation_checkpointing": {"every": 2},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}, "note": "x"}, "timers": {"other": {}},
      "pipeline": {"chunks": 2}, "torch_autocast": {"enabled": False, "note": 1}}, False),
    ("hf_zero's keys in sections DeepSpeed reads key by key",
     {**MB, "checkpoint": {"keep_last": 2}, "activation_checkpointing": {"checkpoint_blocks": True},
      "seed": 1, "nonfinite_loss": "stop"}, False),
]


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DeepSpeed's schema, its verdicts on the filled corpus and on :data:`CASES`, from one DeepSpeed process."""
    path: Path = tmp_path_factory.mktemp("ds_oracle") / "configs.json"
    configs = {s.file: fill_autos(s.load()) for s in CORPUS}
    configs.update({f"case: {name}": config for name, config, _ in CASES})
    path.write_text(json.dumps(configs))
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
    verdicts: dict[str, str] = {k: v for k, v in deepspeed["verdicts"].items() if not k.startswith("case: ")}
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


def test_the_sections_deepspeed_closes_are_the_sections_hf_zero_closes(deepspeed: dict) -> None:
    closed: dict[str, list[str]] = deepspeed["closed"]
    assert deepspeed["open"] == []  # every DeepSpeedConfigModel of 0.19.8 forbids extra keys
    assert {"bf16", "fp16", "zero_optimization", "zero_optimization.offload_param", "compile"} <= set(closed)
    assert set(closed) == CLOSED, (sorted(set(closed) - CLOSED), sorted(CLOSED - set(closed)))
    for path, names in closed.items():
        if path in CLOSED_WHOLE:
            assert CLOSED_WHOLE[path] == set(names), path
            continue
        ours = set(SECTIONS[path].names())
        assert set(names) <= ours, (path, set(names) - ours)
        extra = ours - set(names)
        legacy = set(SECTIONS[path].legacy) | {k for k in SECTIONS[path].unsupported if f"{path}.{k}" in deepspeed["removed"]}
        assert extra == HF_ZERO_OWN.get(path, set()) | legacy, (path, extra)


def test_deepspeeds_removed_keys_are_hf_zeros_legacy_keys(deepspeed: dict) -> None:
    ours = set(TOP.legacy) | {f"zero_optimization.{k}" for k in ZERO.legacy}
    assert ours == set(deepspeed["removed"]), (sorted(ours ^ set(deepspeed["removed"])))
    assert "curriculum_learning" in deepspeed["removed"]


@pytest.mark.parametrize("name, config, refused_by_deepspeed", CASES, ids=[c[0] for c in CASES])
def test_both_directions(deepspeed: dict, name: str, config: dict, refused_by_deepspeed: bool) -> None:
    """DeepSpeed refuses => hf_zero refuses, or names the key as one DeepSpeed 0.19.8 refuses; accepts => accepts."""
    said = deepspeed["verdicts"][f"case: {name}"]
    assert (said != "ok") == refused_by_deepspeed, said
    if name.startswith("typo in") or name.startswith("the issue's"):
        assert "extra_forbidden" in said, said  # refused for the key, not for something else
    v = verdict(config)
    if not refused_by_deepspeed:
        assert not v.refused, v.refused
        return
    if name.startswith("hf_zero's "):
        assert not v.refused and not v.legacy and not v.unknown and not v.ignored, v  # documented: HF_ZERO_OWN
        return
    if v.refused:
        return
    assert v.legacy, f"DeepSpeed refuses it ({said[:160]}), hf_zero accepts it without naming it"
    named = {"fractional": "fp16.min_loss_scale", "legacy curriculum": "curriculum_learning"}
    key = next((k for prefix, k in named.items() if name.startswith(prefix)), name.split()[1] if name.startswith("removed") else None)
    assert key in v.legacy, (key, v.legacy)


def test_gradient_clipping_defaults_to_deepspeeds() -> None:
    """A config without ``gradient_clipping`` clips as DeepSpeed's does: its default, read from DeepSpeed 0.19.8's
    own parser (``DeepSpeedConfig`` on a config that leaves the key out), is hf_zero's."""
    from hf_zero.config import ZeroConfig

    done = dsenv.run_python("""
        from deepspeed.runtime.config import get_gradient_clipping
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
        print(get_gradient_clipping({"train_batch_size": 2}), GRADIENT_CLIPPING_DEFAULT)
    """)
    theirs, constant = map(float, done.stdout.split()[-2:])
    assert theirs == constant == ZeroConfig.load({"train_batch_size": 2}).gradient_clipping == 1.0
