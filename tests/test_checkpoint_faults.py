"""Damaged and foreign checkpoints are refused with one sentence, before anything is loaded.

Truncated file, flipped byte (sha256 recorded at save time), missing rank file, a file name that
leaves the folder, unreadable JSON, another model's checkpoint; and a pickle planted in the folder
is never executed. Plus a scan showing hf_zero never unpickles.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import torch

from tests.distributed import spawn
from tests.models import make_data, make_model

HERE = Path(__file__).resolve().parent


class _Planted:
    def __reduce__(self):  # noqa: ANN204 - unpickling this would create the marker file
        return (open, (str(HERE.parent / "out" / "PICKLE_WAS_EXECUTED"), "w"))


def _engine(model: torch.nn.Module | None = None):  # noqa: ANN202
    import hf_zero

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 40}}
    engine, _, _, _ = hf_zero.initialize(model=model or make_model(), config=cfg)
    return engine


def _faults(rank: int, world: int, root: str) -> dict:
    from hf_zero.checkpoint import CheckpointError

    base = Path(root) / "good"
    engine = _engine()
    ids, labels = make_data(1, 2)
    engine.backward(engine(ids[0], labels[0]))
    engine.step()
    engine.save_checkpoint(str(base))
    tag = base / "global_step1"
    shard = next(tag.glob("*.safetensors"))

    def damaged(name: str, how) -> str:  # noqa: ANN001
        d = Path(root) / name
        shutil.copytree(base, d)
        how(d / "global_step1")
        return str(d)

    def truncate(t: Path) -> None:
        f = t / shard.name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def flip(t: Path) -> None:
        f = t / shard.name
        b = bytearray(f.read_bytes())
        b[-3] ^= 0xFF
        f.write_bytes(bytes(b))

    def outside(t: Path) -> None:
        m = json.loads((t / "rank00000.json").read_text())
        m["files"] = {k: "../evil.safetensors" for k in m["files"]}
        (t / "rank00000.json").write_text(json.dumps(m))

    def plant(t: Path) -> None:
        for name in ("pytorch_model.bin", "optimizer.pt", "rng_state.pth"):
            (t / name).write_bytes(pickle.dumps(_Planted()))

    cases = {
        "truncated": damaged("truncated", truncate),
        "flipped": damaged("flipped", flip),
        "missing": damaged("missing", lambda t: (t / "rank00000.json").unlink()),
        "outside": damaged("outside", outside),
        "bad_json": damaged("bad_json", lambda t: (t / "checkpoint.json").write_text("{not json")),
        "planted": damaged("planted", plant),
    }
    out = {}
    for name, path in cases.items():
        fresh = _engine()
        before = [p.detach().clone() for p in fresh.module.parameters()]
        try:
            fresh.load_checkpoint(path)
            out[name] = "loaded"
        except CheckpointError as e:
            out[name] = str(e)
        out[name + "_untouched"] = all(torch.equal(a, p) for a, p in zip(before, fresh.module.parameters()))

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(11, 7)
            self.fc1 = torch.nn.Linear(7, 16)  # 16, not 15

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.fc1(self.emb(x)).mean()

    other = _engine(Other())
    try:
        other.load_checkpoint(str(base))
        out["foreign"] = "loaded"
    except CheckpointError as e:
        out["foreign"] = str(e)
    return out


def test_damaged_and_foreign_checkpoints_are_refused(tmp_path: Path) -> None:
    marker = HERE.parent / "out" / "PICKLE_WAS_EXECUTED"
    marker.unlink(missing_ok=True)
    (HERE.parent / "out").mkdir(exist_ok=True)
    r = spawn(_faults, 1, str(tmp_path))[0]
    assert "checksum" in r["truncated"] and r["truncated_untouched"], r
    assert "checksum" in r["flipped"] and r["flipped_untouched"], r
    assert "rank00000.json is missing" in r["missing"] and r["missing_untouched"], r
    assert "outside its checkpoint folder" in r["outside"] and r["outside_untouched"], r
    assert "not valid JSON" in r["bad_json"] and r["bad_json_untouched"], r
    assert r["planted"] == "loaded" and not marker.exists(), r  # the pickles sit there, never opened
    assert "different model" in r["foreign"] and "fc2.weight" in r["foreign"], r
    for k, v in r.items():
        if isinstance(v, str) and v != "loaded":
            assert "\n" not in v, (k, v)


def test_hf_zero_never_unpickles() -> None:
    for path in (HERE.parent / "hf_zero").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*import pickle|^\s*from pickle|cPickle|dill", text, re.M), path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)
