"""Reliability (issue 8): numerics, bad input, checkpoint faults and rotation, no pickle, long runs.

Each fault is shown the way a user meets it, on several gloo processes where ranks matter: what
the run does (skips, stops, refuses, keeps) and the one sentence it says. The rank that dies
or hangs is in ``test_reliability_rank_death.py``; Hub tokens in ``test_reliability_secrets.py``.
"""

from __future__ import annotations

import ast
import os
import traceback
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn
from tests.models import make_data, make_model

HERE = Path(__file__).resolve().parent
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


def _all_faults(rank: int, world: int, root: str) -> dict:
    """Every 2-rank case of this file in one spawned group (starting processes is the slow part)."""
    return {
        "numerics": _numerics(rank, world),
        "bad_input": _bad_input(rank, world, os.path.join(root, "bad_input")),
        "rotation": _rotation(rank, world, os.path.join(root, "rotation")),
        "planted": _planted(rank, world, os.path.join(root, "planted")),
        "save_faults": _save_faults(rank, world, os.path.join(root, "save_faults")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("reliability")
    for sub in ("bad_input", "rotation", "planted", "save_faults"):
        (root / sub).mkdir()
    return root, spawn(_all_faults, 2, str(root))


def _snapshot(engine) -> list[torch.Tensor]:  # noqa: ANN001
    """The fp32 masters this rank owns and its optimizer state, as copies."""
    zo = engine.zero_optimizer
    out = [m.detach().clone() for m in zo.master_params()]
    for st in zo.optimizer.state.values():
        out += [v.detach().clone() for _, v in sorted(st.items()) if torch.is_tensor(v)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ 4. numerics


def _numerics(rank: int, world: int) -> dict:
    import logging

    import hf_zero
    import hf_zero.training.step as step_policy
    from hf_zero.precision.policies import LossScaleFloorError, NonFiniteLossError

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("hf_zero").addHandler(Keep(logging.WARNING))
    ids, labels = make_data(4, 2 * world)
    mine = slice(2 * rank, 2 * rank + 2)
    out: dict = {}
    cases = [  # name, stage, bf16, nonfinite_loss (None: the default), what rank 1 multiplies its loss by at step 1
        ("stage0_fp32_default", 0, False, None, float("nan")),
        ("stage2_bf16_skip", 2, True, "skip", float("inf")),
        ("stage3_fp32_stop", 3, False, "stop", float("nan")),
        ("stage1_bf16_stop", 1, True, "stop", float("inf")),
    ]
    for name, stage, bf16, mode, poison in cases:
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "steps_per_print": None}
        if mode is not None:
            cfg["nonfinite_loss"] = mode
        engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
        r: dict = {}
        warnings.clear()
        for t in range(3):
            before = _snapshot(engine)
            loss = engine(ids[t, mine], labels[t, mine])
            if t == 1 and rank == 1:
                loss = loss * poison
            try:
                engine.backward(loss)
                engine.step()
            except NonFiniteLossError as e:
                r["error"] = str(e)
                r["unchanged"] = _same(before, _snapshot(engine))
                break
            r[f"changed{t}"] = not _same(before, _snapshot(engine))
        r.update(skipped=engine.skipped_steps, global_steps=engine.global_steps, warnings=list(warnings))
        out[name] = r

    # "off" without clipping skips the global norm's pass (nothing reads it) and trains the same
    snaps, norm_calls = {}, {}
    for mode in ("skip", "off"):
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "zero_optimization": {"stage": 2},
               "bf16": {"enabled": True}, "nonfinite_loss": mode, "gradient_clipping": 0.0}  # (DeepSpeed's default: 1.0)
        engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
        calls: list[int] = []
        inner = step_policy.grad_stats  # the global norm's pass over the shards, wherever it is asked for
        step_policy.grad_stats = lambda *a, _f=inner, _c=calls, **k: _c.append(1) or _f(*a, **k)
        try:
            for t in range(3):
                engine.backward(engine(ids[t, mine], labels[t, mine]))
                engine.step()
        finally:
            step_policy.grad_stats = inner
        snaps[mode], norm_calls[mode] = _snapshot(engine), len(calls)
        out[f"norm_after_{mode}"] = engine.get_global_grad_norm()
    out["off_same_as_skip"] = _same(snaps["skip"], snaps["off"])
    out["norm_calls"] = norm_calls

    # fp16: an overflow on every step halves the scale down to min_loss_scale, then the run stops
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "zero_optimization": {"stage": 2},
           "fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 2, "hysteresis": 1}}
    engine, _, _, _ = hf_zero.initialize(model=make_model(), config=cfg)
    scales = []
    start = _snapshot(engine)
    try:
        for t in range(10):
            loss = engine(ids[t % 4, mine], labels[t % 4, mine]) * (float("inf") if rank == 0 else 1.0)
            engine.backward(loss)
            engine.step()
            scales.append(engine.cur_scale)
        out["fp16"] = {"error": None}
    except LossScaleFloorError as e:
        out["fp16"] = {"error": str(e)}
    out["fp16"].update(scales=scales, skipped=engine.skipped_steps, unchanged=_same(start, _snapshot(engine)))
    return out


def test_nonfinite_loss_is_skipped_or_stops_and_fp16_storms_stop_at_min_loss_scale(two_ranks) -> None:  # noqa: ANN001
    for r in (rank["numerics"] for rank in two_ranks[1]):
        for name in ("stage0_fp32_default", "stage2_bf16_skip"):  # "skip" is the default
            c = r[name]
            assert c["changed0"] and not c["changed1"] and c["changed2"], (name, c)  # masters and Adam state
            assert c["skipped"] == 1 and c["global_steps"] == 3, (name, c)
            assert len(c["warnings"]) == 1 and c["warnings"][0].startswith(
                "step 1: the loss or gradients are not finite (global gradient norm "), c
            assert "step skipped, weights and optimizer state unchanged (1 skipped so far" in c["warnings"][0], c
        for name in ("stage3_fp32_stop", "stage1_bf16_stop"):
            c = r[name]
            assert c["error"].startswith("step 1: the loss or gradients are not finite (global gradient norm "), c
            assert 'as "nonfinite_loss" is "stop"' in c["error"] and "\n" not in c["error"], c
            assert c["unchanged"] and c["changed0"] and c["global_steps"] == 1, (name, c)
        f = r["fp16"]
        assert f["scales"] == [8.0, 4.0, 2.0] and f["skipped"] == 3 and f["unchanged"], f
        assert f["error"] == (
            "fp16 gradients overflowed at step 3 with the loss scale already at fp16.min_loss_scale=2; the run "
            "cannot continue in fp16 — lower the learning rate, check the data for inf/nan, or train in bf16."
        ), f


def test_nonfinite_loss_off_without_clipping_skips_the_norm(two_ranks) -> None:  # noqa: ANN001
    for r in two_ranks[1]:
        n = r["numerics"]
        assert n["off_same_as_skip"] and n["norm_calls"] == {"skip": 3, "off": 0}, n["norm_calls"]
        assert n["norm_after_off"] is None and n["norm_after_skip"] > 0


def test_nonfinite_loss_config_key() -> None:
    from hf_zero.config import ConfigError, ZeroConfig

    assert ZeroConfig.load({"train_batch_size": 2}).nonfinite_loss == "skip"
    assert ZeroConfig.load({"train_batch_size": 2, "nonfinite_loss": "STOP"}).nonfinite_loss == "stop"
    with pytest.raises(ConfigError, match="nonfinite_loss: got 'ignore', expected one of skip, stop, off"):
        ZeroConfig.load({"train_batch_size": 2, "nonfinite_loss": "ignore"})


# ------------------------------------------------------------------ 5. bad input, on every rank


def _bad_input(rank: int, world: int, root: str) -> dict:
    import hf_zero
    from hf_zero import ConfigError, UsageError

    bad = Path(root, f"bad{rank}.json")
    bad.write_text('{"train_batch_size": 4,\n "optimizer": }')
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW}
    out = {}

    def attempt(name: str, **kwargs) -> None:  # noqa: ANN003
        kwargs.setdefault("model", make_model())
        kwargs.setdefault("config", cfg)
        try:
            hf_zero.initialize(**kwargs)
            out[name] = None
        except (UsageError, ConfigError) as e:
            frames = traceback.extract_tb(e.__traceback__)
            out[name] = {
                "type": type(e).__name__, "message": str(e),
                "chained": e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__),
                "raised_in": os.path.relpath(frames[-1].filename, HERE.parent),
            }

    attempt("model_type", model=[1, 2])
    attempt("no_parameters", model=torch.nn.ReLU())
    attempt("config_type", config=3.5)
    attempt("optimizer_type", optimizer="adam", config={"train_batch_size": 2 * world})
    attempt("training_data_type", training_data=5)
    attempt("not_json", config=str(bad))
    attempt("missing_file", config=str(Path(root, "nope.json")))
    attempt("unreadable_path", config=root)  # a folder: open() fails
    attempt("batch_mismatch", config=dict(cfg, train_micro_batch_size_per_gpu=2 if rank == 0 else 4))
    attempt("refused_on_one_rank", config={"train_batch_size": 4 if rank == 0 else 5, "train_micro_batch_size_per_gpu": 2})
    return out


def test_bad_input_is_one_sentence_on_every_rank(two_ranks) -> None:  # noqa: ANN001
    r0, r1 = (rank["bad_input"] for rank in two_ranks[1])
    expect = {
        "model_type": r"initialize(model=...) expects a torch.nn.Module, got list",
        "no_parameters": "initialize(model=...) got a ReLU with no parameters; there is nothing to train",
        "config_type": "config: got a float, expected a JSON object (a dict) or the path of a DeepSpeed JSON file",
        "optimizer_type": "initialize(optimizer=...) expects a torch.optim.Optimizer or a callable taking parameters, got str",
        "training_data_type": "initialize(training_data=...) expects a torch Dataset",
        "not_json": "is not valid JSON (Expecting value at line 2, column 15)",
        "missing_file": "does not exist; pass a dict or the path of a DeepSpeed JSON file",
        "unreadable_path": "config: cannot read",
        "batch_mismatch": (
            "batch sizes differ across ranks: rank 0 has train_batch_size 4, train_micro_batch_size_per_gpu 2, "
            "gradient_accumulation_steps 1 but rank 1 has train_batch_size 8, train_micro_batch_size_per_gpu 4, "
            "gradient_accumulation_steps 1; every rank must run the same config"
        ),
    }
    for r in (r0, r1):
        for name, needle in expect.items():
            e = r[name]
            assert e is not None and needle in e["message"], (name, e)
            assert "\n" not in e["message"] and not e["chained"], (name, e)
            assert e["raised_in"].startswith("hf_zero/"), (name, e)  # not from deep inside torch or json
    assert r0["batch_mismatch"]["message"] == r1["batch_mismatch"]["message"]
    assert r1["refused_on_one_rank"]["message"].startswith("train_batch_size: got 5, which is not a multiple of")
    assert r0["refused_on_one_rank"]["message"] == (
        "the config's batch sizes were refused on rank 1 (its error says why); every rank must run the same config"
    )


# ------------------------------------------------------------------ 2, 3, 7. checkpoints


def _engine(cfg_extra: dict | None = None, model: torch.nn.Module | None = None):  # noqa: ANN202
    import hf_zero

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "zero_optimization": {"stage": 1},
           "steps_per_print": None, **(cfg_extra or {})}
    return hf_zero.initialize(model=model or make_model(), config=cfg)[0]


def _one_step(engine, t: int) -> None:  # noqa: ANN001
    ids, labels = make_data(t + 1, 2 * engine.world_size)
    r = engine.global_rank
    engine.backward(engine(ids[t, 2 * r : 2 * r + 2], labels[t, 2 * r : 2 * r + 2]))
    engine.step()


def _rotation(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from hf_zero.checkpoint import CheckpointError

    d = Path(root, "run")
    engine = _engine({"checkpoint": {"keep_last": 2}})
    if rank == 0:
        (d / "notes").mkdir(parents=True)  # not a checkpoint: never touched
        (d / "notes" / "a.txt").write_text("keep me")
    dist.barrier()
    out: dict = {"listings": []}
    for t in range(5):
        _one_step(engine, t)
        engine.save_checkpoint(str(d))
        out["listings"].append(sorted(os.listdir(d)))
    _one_step(engine, 5)  # a newer tag that latest does not name: latest's tag survives keep_last=1
    engine.save_checkpoint(str(d), tag="extra", save_latest=False, keep_last=1)
    out["after_extra"] = sorted(os.listdir(d))
    fresh = _engine()
    out["resumed"] = os.path.basename(fresh.load_checkpoint(str(d))[0])
    try:
        engine.save_checkpoint(str(d), keep_last=0)
    except ValueError as e:
        out["keep_last_0"] = str(e)

    # leftovers of crashed saves go on the next save; a tag caught between its two renames comes back
    e = Path(root, "leftovers")
    engine.save_checkpoint(str(e), tag="a")
    if rank == 0:
        (e / ".b.partial").mkdir()
        (e / ".c.deleting").mkdir()
        os.replace(e / "a", e / ".a.old")  # the crash came after "a" moved aside, before its replacement
    dist.barrier()
    engine.save_checkpoint(str(e), tag="z")
    out["leftovers"] = sorted(os.listdir(e))

    # 3. a latest that leaves its folder, and a model whose shapes differ
    if rank == 0:
        (e / "latest").write_text("../run/global_step5")
    dist.barrier()
    try:
        _engine().load_checkpoint(str(e))
        out["outside"] = "loaded"
    except CheckpointError as err:
        out["outside"] = str(err)

    class Wider(torch.nn.Module):  # the same names as tests.models.Awkward, fc1 one row wider
        def __init__(self) -> None:
            super().__init__()
            src = make_model()
            for n, m in src.named_children():
                setattr(self, n, m)
            self.fc1 = torch.nn.Linear(7, 16)
            self.fc2 = torch.nn.Linear(16, 7, bias=False)

    wider = _engine(model=Wider())
    before = [p.detach().clone() for p in wider.module.parameters()]
    try:
        wider.load_checkpoint(str(d))
        out["shapes"] = "loaded"
    except CheckpointError as err:
        out["shapes"] = str(err)
    out["shapes_untouched"] = all(torch.equal(a, p) for a, p in zip(before, wider.module.parameters()))
    return out


def test_checkpoints_rotate_leftovers_go_and_foreign_ones_are_refused(two_ranks) -> None:  # noqa: ANN001
    tmp_path, r = two_ranks[0] / "rotation", two_ranks[1][0]["rotation"]
    ls = r["listings"]
    assert ls[0] == ["global_step1", "latest", "notes"]
    assert ls[1] == ["global_step1", "global_step2", "latest", "notes"]
    for t in range(2, 5):  # keep_last 2: the two newest, deleted only after the new one is complete
        assert ls[t] == [f"global_step{t}", f"global_step{t + 1}", "latest", "notes"], ls
    assert r["after_extra"] == ["extra", "global_step5", "latest", "notes"], r
    assert (tmp_path / "run" / "latest").read_text() == "global_step5" and r["resumed"] == "global_step5"
    assert (tmp_path / "run" / "notes" / "a.txt").read_text() == "keep me"
    assert r["keep_last_0"].startswith("save_checkpoint(keep_last=...): got 0, expected an integer >= 1"), r
    assert r["leftovers"] == ["a", "latest", "z"], r
    assert r["outside"].endswith("the tag '../run/global_step5' is not a plain folder name inside " + str(tmp_path / "leftovers")
                                 + "; refusing to read outside it"), r
    assert r["shapes"].endswith("parameter 'fc1.weight' has shape [15, 7] there and [16, 7] here"), r
    assert r["shapes_untouched"]


def _long_run(rank: int, world: int, root: str, steps: int) -> dict:
    engine = _engine({"checkpoint": {"keep_last": 2}, "zero_optimization": {"stage": 2}})
    ids, labels = make_data(16, 2)

    def rss_kib() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    samples = {}
    for t in range(steps):
        loss = engine(ids[t % 16], labels[t % 16])
        engine.backward(loss)
        engine.step()
        if (t + 1) % 250 == 0:
            engine.save_checkpoint(os.path.join(root, "ckpt"))
        if (t + 1) % 100 == 0:
            samples[t + 1] = rss_kib()
    return {"samples": samples, "checkpoints": sorted(os.listdir(os.path.join(root, "ckpt"))), "loss": loss.item()}


def test_two_thousand_steps_keep_resident_memory_flat(tmp_path: Path) -> None:
    r = spawn(_long_run, 1, str(tmp_path), 2000)[0]
    s = {int(k): v for k, v in r["samples"].items()}
    warm = s[300]  # after the first checkpoint save and the optimizer's first steps
    growth = (max(v for k, v in s.items() if k >= 300) - warm) / warm
    print(f"\nRSS after warm-up {warm} KiB, at step 2000 {s[2000]} KiB, peak growth {100 * growth:.2f}%")
    assert growth < 0.05, s
    assert r["checkpoints"] == ["global_step1750", "global_step2000", "latest"], r


# ------------------------------------------------------------------ 6. no pickle


_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "recv_object_list", "send_object_list"}


def _unpickling_calls(tree: ast.AST) -> list[str]:
    """Imports of pickling modules, torch.load without weights_only=True, np.load with pickles, object collectives."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            last = name.rsplit(".", 1)[-1]
            if last == "load" and name.split(".")[0] == "torch":
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not ok:
                    found.append(ast.unparse(node))
            elif last == "load" and name.split(".")[0] in ("np", "numpy"):
                if not (isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is False) and "allow_pickle" in kw:
                    found.append(ast.unparse(node))
            elif last in _OBJECT_COLLECTIVES or last in ("loads", "load") and name.split(".")[0] in _PICKLE_MODULES:
                found.append(ast.unparse(node))
    return found


def test_no_code_path_of_hf_zero_unpickles() -> None:
    offenders = {}
    for path in sorted((HERE.parent / "hf_zero").rglob("*.py")):
        calls = _unpickling_calls(ast.parse(path.read_text()))
        if calls:
            offenders[str(path.relative_to(HERE.parent))] = calls
    assert not offenders, offenders
    # the scan itself finds what it is meant to find
    planted = "import pickle\nimport torch\ntorch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\n" \
              "dist.all_gather_object(a, b)\nnp.load(f, allow_pickle=True)\ntorch.load(f, weights_only=True)\n"
    assert len(_unpickling_calls(ast.parse(planted))) == 6


def test_a_pickle_planted_in_a_checkpoint_is_never_executed(two_ranks) -> None:  # noqa: ANN001
    """Every file name a pickle-based loader would open, in the checkpoint folder and its tag; loads fine."""
    for r in (rank["planted"] for rank in two_ranks[1]):
        assert r["loaded"] == "global_step1" and not Path(r["marker"]).exists(), r


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - unpickling this would create the marker file
        return (open, (self.marker, "w"))


def _planted(rank: int, world: int, root: str) -> dict:
    import pickle

    import torch.distributed as dist

    d = Path(root, "ckpt")
    engine = _engine()
    _one_step(engine, 0)
    engine.save_checkpoint(str(d))
    marker = str(Path(root, "PICKLE_WAS_EXECUTED"))
    payload = pickle.dumps(_Planted(marker))
    names = ["pytorch_model.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin",
             "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    if rank == 0:
        for folder in (d, d / "global_step1"):
            for n in names:
                (folder / n).write_bytes(payload)
    dist.barrier()
    path, _ = _engine().load_checkpoint(str(d))
    return {"loaded": os.path.basename(path), "marker": marker}


def _save_faults(rank: int, world: int, root: str) -> dict:
    """A save that fails on one rank, or on all: every rank raises at once, nothing saved before is lost."""
    import time

    import hf_zero.checkpoint.consolidated as consolidated
    from hf_zero.checkpoint import CheckpointError, save

    d = Path(root, "run")
    engine = _engine({"zero_optimization": {"stage": 2}})
    _one_step(engine, 0)
    engine.save_checkpoint(str(d))  # global_step1, named by latest
    out: dict = {}

    def attempt(name: str) -> None:
        t0 = time.monotonic()
        try:
            engine.save_checkpoint(str(d))
            out[name] = {"error": None}
        except CheckpointError as e:
            out[name] = {"error": str(e)}
        out[name]["seconds"] = time.monotonic() - t0
        out[name]["listing"] = sorted(os.listdir(d))
        out[name]["latest"] = (d / "latest").read_text()

    _one_step(engine, 1)
    real_write_file = save.write_file  # what writes each safetensors file of a rank's share

    def disk_full(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise OSError(28, "No space left on device")

    # 1. rank 1's disk fills up while it writes its shards
    if rank == 1:
        save.write_file = disk_full
    try:
        attempt("disk_full_rank1")
    finally:
        save.write_file = real_write_file

    # 2. rank 0 fails after every share is written, while it writes the index
    real_config = consolidated.save_model_config
    if rank == 0:
        consolidated.save_model_config = disk_full
    try:
        attempt("index_fails_rank0")
    finally:
        consolidated.save_model_config = real_config

    # 3. a param group value no checkpoint can hold, on every rank: refused before anything is written
    pg = engine.zero_optimizer.optimizer.param_groups[0]
    pg["note"] = object()
    attempt("unstorable")
    del pg["note"]

    # 4. the same run saves again once the fault is gone, and a fresh engine resumes from it
    attempt("recovered")
    out["resumed"] = os.path.basename(_engine({"zero_optimization": {"stage": 2}}).load_checkpoint(str(d))[0])
    return out


def test_a_save_that_fails_on_one_rank_stops_every_rank_and_keeps_the_previous_checkpoint(two_ranks) -> None:  # noqa: ANN001
    """Without agreement the other ranks waited in a barrier for the failed one until the timeout."""
    root = two_ranks[0] / "save_faults" / "run"
    for r in (rank["save_faults"] for rank in two_ranks[1]):
        disk, index = r["disk_full_rank1"], r["index_fails_rank0"]
        assert disk["error"] == (
            f"save_checkpoint failed on rank 1 (OSError: [Errno 28] No space left on device); the checkpoints "
            f"already in {root} are kept"
        ), disk
        assert index["error"] == disk["error"].replace("rank 1", "rank 0"), index
        for case in (disk, index):  # the half-written global_step2 is gone, global_step1 and latest untouched
            assert case["listing"] == ["global_step1", "latest"] and case["latest"] == "global_step1", case
            assert case["seconds"] < 30, case
        bad = r["unstorable"]
        assert bad["error"] == (
            "optimizer param group 'note' is of type object, which a checkpoint cannot store without pickle; keep it to "
            "numbers, strings, lists, dicts and tensors"
        ), bad
        assert bad["listing"] == ["global_step1", "latest"], bad
        ok = r["recovered"]
        assert ok["error"] is None and ok["listing"] == ["global_step1", "global_step2", "latest"], ok
        assert ok["latest"] == "global_step2" and r["resumed"] == "global_step2", r
