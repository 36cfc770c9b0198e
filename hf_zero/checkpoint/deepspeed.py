"""Coming from DeepSpeed: its checkpoints as hf_zero checkpoints, and resumed as they are.

A DeepSpeed checkpoint (ZeRO 0-3, fp32/bf16/fp16) is rewritten in hf_zero's own resume format
(``checkpoint/format.py``: safetensors + JSON, every tensor "elements [a, b) of parameter
``name``"): one hf_zero rank file per DeepSpeed rank, holding that rank's fp32 masters, its
optimizer moments and step counts, its frozen slices, and on rank 0 the buffers;
``checkpoint.json`` carries the counters, the scheduler, the loss scaler and the client state.
hf_zero's reshardable loader then reads it at any world size and stage. Reading DeepSpeed's
files runs no code from them (``deepspeed_read.py``); mapping its flat partitions back to names
is ``deepspeed_map.py``.

Why a converted folder on disk rather than an in-memory reader handed to the loader: the on-disk
format is the one contract between this module and the loader (``checkpoint/load.py`` verifies,
plans and reads it), so the conversion cannot drift from what a real hf_zero checkpoint is, and
``hf-zero convert-deepspeed`` and ``engine.load_checkpoint`` share every line. The price is one
temporary copy of the fp32 state, written in parallel (each rank converts every world-th
DeepSpeed rank) into a hidden folder next to the checkpoint and removed once loaded; if that
folder cannot be written, convert once with ``hf-zero convert-deepspeed`` and load the result.

DeepSpeed stores no RNG state in its engine checkpoints; loading one leaves this process's
random streams as they were (transformers' Trainer keeps its own ``rng_state_*.pth``, which
``Trainer`` restores as transformers does).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hf_zero.checkpoint.atomic import write_json as _write_json
from hf_zero.checkpoint.deepspeed_map import DS_KEYS, Plan, plan, read_share
from hf_zero.checkpoint.deepspeed_read import DeepSpeedCheckpointError, is_deepspeed_checkpoint, load_pickle
from hf_zero.checkpoint.format import FORMAT, LATEST, to_json
from hf_zero.checkpoint.save import write_files
from hf_zero.checkpoint.tp_reshard import base_name
from hf_zero.errors import CheckpointError
from hf_zero.parallel.tp_split import parse_slice_name

if TYPE_CHECKING:
    from hf_zero.checkpoint.state import Progress, TrainState

__all__ = ["DeepSpeedCheckpointError", "convert", "is_deepspeed_checkpoint", "load", "resume_trainer", "consolidate",
           "weights"]



# ------------------------------------------------------------------------------------ writing


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _jsonable(obj: Any, where: str) -> Any:
    """Scheduler and client state as the JSON hf_zero's checkpoints hold (the format's own rule, format.to_json)."""
    try:
        return to_json(obj, where)
    except CheckpointError as e:
        raise DeepSpeedCheckpointError(str(e)) from None


def _seeded_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """RNG states for the rank files (DeepSpeed saved none): a fresh seed-0 stream, as a new run would have."""
    py = random.Random(0).getstate()
    npst = np.random.RandomState(0).get_state()
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]}
    return {"rng.torch_cpu": torch.Generator().manual_seed(0).get_state()}, meta


def _write_share(p: Plan, rank: int, out: str) -> None:
    """DeepSpeed rank ``rank``'s state as hf_zero's ``rankNNNNN`` files: by parameter name and element range."""
    share = read_share(p, rank)
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list] = {}
    scalars: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for pc in share.pieces:
        n = pc.b - pc.a
        master = share.masters[pc.flat]
        # one range of a parameter per rank, except an AutoEP expert block's, whose gate and up rows interleave
        suffix = "" if pc.name not in seen else f"|{pc.a}"
        seen.add(pc.name)
        key = f"master|{pc.name}{suffix}"
        tensors[key] = master[pc.at : pc.at + n].to(torch.float32)
        ranges[key] = [pc.name, pc.a, pc.b]
        for k, v in share.states[pc.flat].items():
            if torch.is_tensor(v) and v.dim() > 0:
                if v.numel() < pc.at + n:
                    raise DeepSpeedCheckpointError(
                        f"{p.folder.path}: rank {rank}'s optimizer state '{k}' is shorter than its fp32 partition; the checkpoint is damaged"
                    )
                key = f"optim.{k}|{pc.name}{suffix}"
                tensors[key] = v.reshape(-1)[pc.at : pc.at + n]
                ranges[key] = [pc.name, pc.a, pc.b]
            elif torch.is_tensor(v):
                scalars.setdefault(pc.name, {})[k] = {"value": v.item(), "dtype": _dtype_name(v.dtype)}
            else:
                scalars.setdefault(pc.name, {})[k] = {"value": _jsonable(v, f"optimizer state '{k}'")}
    for name, a, b, values in share.frozen:
        key = f"frozen|{name}"
        tensors[key] = values
        ranges[key] = [name, a, b]
    if rank == 0:
        module = p.model0["module"]
        for name, src in p.buffer_names():
            tensors[f"buffer|{name}"] = module[src]
    rng_tensors, rng_meta = _seeded_rng()
    tensors.update(rng_tensors)

    # written as hf_zero's own saves write them: files side by side, straight from the tensors, hashed as written
    files, digests = write_files({k: (v, v.dtype) for k, v in tensors.items()}, out, rank)
    _write_json(os.path.join(out, f"rank{rank:05d}.json"),
                {"files": files, "sha256": digests, "ranges": ranges, "scalars": scalars, "rng": rng_meta, "sampler": None})


def _loss_scaler(p: Plan) -> dict | None:
    """DeepSpeed's fp16 loss scaler in hf_zero's terms (bf16 and fp32 have none)."""
    if p.compute_dtype != torch.float16:
        return None
    fp16 = (p.model0.get("ds_config") or {}).get("fp16") or {}
    hysteresis = int(fp16.get("hysteresis", 2))
    if p.kind in ("fp16_optimizer", "fp16_unfused"):
        o = p.optim0 or {}
        src: dict[str, Any] = {k: o[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter") if k in o}
    else:
        scaler = (p.optim0 or {}).get("loss_scaler")
        src = dict(vars(scaler)) if scaler is not None else {}
    if "cur_scale" not in src:
        raise DeepSpeedCheckpointError(f"{p.folder.path} is an fp16 checkpoint without its loss scaler state")
    return {"scale": float(src["cur_scale"]), "cur_hysteresis": int(src.get("cur_hysteresis", hysteresis)),
            "cur_iter": int(src.get("cur_iter", 0)), "last_overflow_iter": int(src.get("last_overflow_iter", -1))}


def client_state(p: Plan) -> dict:
    """The keys the user's script added to DeepSpeed's ``save_checkpoint(client_state=...)``."""
    return {k: v for k, v in p.model0.items() if k not in DS_KEYS}


def _gas(p: Plan) -> int:
    cfg = p.model0.get("ds_config") or {}
    gas = cfg.get("gradient_accumulation_steps")
    if isinstance(gas, int) and gas > 0:
        return gas
    micro, total = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("train_batch_size")
    if isinstance(micro, int) and isinstance(total, int) and micro > 0:
        return max(1, total // (micro * p.world))
    return 1


def _meta(p: Plan, client: Any, frozen_excluded: bool = False) -> dict:
    """``checkpoint.json`` of the converted checkpoint.

    ``"frozen_excluded": true`` when the folder was saved with ``exclude_frozen_parameters=True`` (as transformers'
    Trainer saves PEFT models under DeepSpeed): ``Plan.frozen_excluded`` tells it from the files at ZeRO 2-3,
    ``frozen_excluded`` from the model being loaded (:func:`_same_model`). A load of it keeps the model's own values
    for the parameters frozen there that it holds none of (``hf_zero/checkpoint/load.py``), as for hf_zero's own."""
    m0 = p.model0
    params: dict[str, Any] = {}
    for name, info in p.table().items():
        params[name] = {"shape": list(info["shape"]), "dtype": _dtype_name(p.compute_dtype), "trainable": True,
                        "group": info["group"], **({"ep": info["ep"]} if "ep" in info else {})}
    for name, (shape, dtype) in p.frozen.items():
        params[name] = {"shape": list(shape), "dtype": _dtype_name(dtype), "trainable": False, "group": None}
    steps = int(m0.get("global_steps") or 0)
    gas = _gas(p)
    sched = m0.get("lr_scheduler")
    return {
        "format": FORMAT, "world_size": p.shares, "zero_stage": p.stage, "compute_dtype": _dtype_name(p.compute_dtype),
        "global_steps": steps, "micro_steps": steps * gas, "gradient_accumulation_steps": gas,
        "global_samples": int(m0.get("global_samples") or 0), "skipped_steps": int(m0.get("skipped_steps") or 0),
        "loss_scaler": _loss_scaler(p),
        "lr_scheduler": _jsonable(sched, "lr_scheduler state") if sched is not None else None,
        "optimizer": {"type": str(((m0.get("ds_config") or {}).get("optimizer") or {}).get("type", "torch")),
                      "param_groups": [_jsonable(h, f"optimizer param group {i}") for i, h in enumerate(p.hypers)]},
        "params": params, "client_state": client,
        "converted_from": {"deepspeed": str(m0.get("ds_version")), "path": p.folder.path, "tag": p.folder.tag},
        **({"frozen_excluded": True} if frozen_excluded or p.frozen_excluded else {}),
    }


def _module_name(p: Plan, name: str) -> str | None:
    """The model's name of an entry of DeepSpeed's module state dict (None: AutoEP's alias of its router)."""
    return name if p.autoep is None else p.autoep.model_name(name, set(p.model0["module"]))


def _copy_model_config(p: Plan, out: str) -> None:
    """config.json / generation_config.json found next to the checkpoint (a Trainer's checkpoint-N has them)."""
    for where in (os.path.dirname(p.folder.path), p.folder.path):
        for name in ("config.json", "generation_config.json"):
            src = os.path.join(where, name)
            if os.path.isfile(src) and not os.path.exists(os.path.join(out, name)):
                shutil.copyfile(src, os.path.join(out, name))


# ------------------------------------------------------------------------- convert-deepspeed


def convert(src: str, dst: str, tag: str | None = None, progress: bool = True) -> str:
    """``hf-zero convert-deepspeed``: ``src``'s DeepSpeed checkpoint as an hf_zero checkpoint ``dst/<tag>``.

    Written into a hidden ``.<tag>.partial`` folder renamed when whole; ``dst/latest`` moves
    last. Returns the new checkpoint's path.
    """
    from tqdm.auto import tqdm

    p = plan(src, tag)
    client = _jsonable(client_state(p), "client_state")
    final = os.path.join(dst, p.folder.tag)
    if os.path.exists(final):
        raise DeepSpeedCheckpointError(f"{final} already exists; choose another destination or remove it first")
    os.makedirs(dst, exist_ok=True)
    partial = os.path.join(dst, f".{p.folder.tag}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        for r in tqdm(range(p.shares), desc="converting", unit="rank", disable=not progress):
            _write_share(p, r, partial)
        _copy_model_config(p, partial)
        _write_json(os.path.join(partial, "checkpoint.json"), _meta(p, client))
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    tmp = os.path.join(dst, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(p.folder.tag)
    os.replace(tmp, os.path.join(dst, LATEST))
    return final


def weights(src: str, tag: str | None = None, dtype: torch.dtype | None = torch.float32,
            exclude_frozen: bool = False) -> tuple[Plan, list[tuple[str, torch.dtype, tuple[int, ...]]], Any]:
    """The checkpoint's weights one tensor at a time: ``(plan, entries, produce)``, ``entries`` the model's names with
    their dtype and whole shape in the module's order, ``produce(name)`` the whole tensor, assembled from the ranks'
    memory-mapped partitions (an AutoEP expert tensor from its EP ranks' blocks). ``dtype`` for the floating weights
    (None: the dtype the run trained in); tied repeats are left out as ``save_pretrained`` leaves them."""
    p = plan(src, tag)
    table = p.table()
    # an EP rank's block of a fused experts tensor (AutoEP) is a run of whole experts along dim 0: elements
    # [r * n, (r + 1) * n) of the tensor, n the block's elements
    offset = {n: (cut[1] * math.prod(info["shape"]), cut[0]) for n, info in table.items() if (cut := parse_slice_name(n))}
    where: dict[str, list[tuple[Any, int, int, torch.Tensor]]] = {}
    for r in range(p.shares):
        share = read_share(p, r)
        for pc in share.pieces:
            at, name = offset.get(pc.name, (0, pc.name))
            where.setdefault(name, []).append((at + pc.a, at + pc.b, share.masters[pc.flat][pc.at : pc.at + pc.b - pc.a]))
        for name, a, b, values in share.frozen:
            where.setdefault(name, []).append((a, b, values))
    module = p.model0["module"]
    whole = {base_name(n): tuple(info["ep"]["full_shape"]) if "ep" in info else tuple(info["shape"])
             for n, info in table.items()}
    shapes = {**whole, **({} if exclude_frozen else {n: s for n, (s, _) in p.frozen.items()})}
    buffers = dict(p.buffer_names())
    floating = dtype or p.compute_dtype
    model_order = [m for n in module if (m := _module_name(p, n)) is not None]
    entries = []
    for name in model_order + [n for n in shapes if n not in model_order]:
        if name in shapes:
            entries.append((name, floating, tuple(shapes[name])))
        elif name in buffers:
            t = module[buffers[name]]
            entries.append((name, floating if t.is_floating_point() else t.dtype, tuple(t.shape)))

    def produce(name: str) -> torch.Tensor:
        if name in buffers:
            t = module[buffers[name]]
            return t.to(floating) if t.is_floating_point() else t
        shape = shapes[name]
        out = torch.empty(int(np.prod(shape, dtype=np.int64)), dtype=torch.float32)
        covered = 0
        for a, b, values in where.get(name, []):
            out[a:b].copy_(values)
            covered += b - a
        if covered != out.numel():
            raise DeepSpeedCheckpointError(f"{p.folder.path} holds {covered} of the {out.numel()} elements of '{name}'; it is damaged")
        return out.view(shape).to(floating)

    return p, entries, produce


def consolidate(src: str, out_dir: str, tag: str | None = None, max_shard_size: int | str = "5GB",
                progress: bool = True, dtype: torch.dtype | None = torch.float32) -> list[str]:
    """DeepSpeed's ``zero_to_fp32`` without DeepSpeed: the checkpoint's fp32 weights as a ``from_pretrained`` folder
    (``hf-zero consolidate`` and ``hf-zero convert-deepspeed --consolidated`` of a DeepSpeed folder).

    Each tensor is assembled (:func:`weights`), written, and dropped; ``config.json`` is copied when the checkpoint
    has one beside it (a Trainer's ``checkpoint-N`` does), its dtype made the weights'. ``dtype``: the floating
    weights' (None: the dtype the run trained in). Returns the files written.
    """
    from tqdm.auto import tqdm

    from hf_zero.checkpoint.consolidated import write_weights

    p, entries, produce = weights(src, tag, dtype)
    os.makedirs(out_dir, exist_ok=True)
    bar = tqdm(total=len(entries), desc="consolidating", unit="tensor", disable=not progress)
    files = write_weights(out_dir, entries, produce, max_shard_size, writer=True, progress=bar)
    bar.close()
    _copy_model_config(p, out_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    if os.path.isfile(cfg_path):  # the weights are in this dtype now, whatever the run trained in
        with open(cfg_path) as f:
            cfg = json.load(f)
        for key in ("dtype", "torch_dtype"):
            if key in cfg:
                cfg[key] = _dtype_name(dtype or p.compute_dtype)
        _write_json(cfg_path, cfg)
    return files


# --------------------------------------------------------------------- engine.load_checkpoint


def _reason(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _agree(errors: list[str | None]) -> None:
    """Every rank raises the first failing rank's sentence (its own words if every rank found the same)."""
    for r, e in enumerate(errors):
        if e:
            if all(x == e for x in errors):
                raise DeepSpeedCheckpointError(e)
            raise DeepSpeedCheckpointError(f"reading the DeepSpeed checkpoint failed on rank {r}: {e}")


def _rng_snapshot() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _rng_restore(snap: tuple) -> None:
    cpu, cuda, py, npst = snap
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npst)


def load(
    state: TrainState, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
) -> tuple[str, dict, Progress | None]:
    """``engine.load_checkpoint`` on a DeepSpeed folder, at any world size and stage; collective.

    Returns ``(tag folder, client_state, progress)``; the client state is what the script passed to
    DeepSpeed's ``save_checkpoint(client_state=...)``, as read (tensors included); the counters are
    for the engine to take, as ``checkpoint/load.py``'s ``load`` returns them.
    """
    path, client, _, progress = _load(state, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                      load_module_only)
    return path, client, progress


def _load(
    state: TrainState, load_dir: str, tag: str | None, load_optimizer_states: bool, load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str, dict, Plan, Progress | None]:
    import torch.distributed as dist

    from hf_zero.checkpoint.load import load as load_sharded
    from hf_zero.distributed.dist import gather_json

    rank, world = dist.get_rank(), dist.get_world_size()
    zo = state.optimizer
    hint = [list(g) for g in zo.group_names] if zo is not None else None
    p, err, frozen_excluded = None, None, False
    try:
        p = plan(load_dir, tag, hint)
        frozen_excluded = _same_model(p, state.module)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        err = _reason(e)
    _agree(gather_json(err))
    assert p is not None
    root = os.path.dirname(p.folder.path)
    hidden = f".{p.folder.tag}.from-deepspeed.partial"
    tmp = os.path.join(root, hidden)
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            err = (f"cannot write the converted copy next to {p.folder.path} ({e.strerror or e}); convert it once with "
                   f"`hf-zero convert-deepspeed {load_dir} DST` and load DST instead")
    _agree(gather_json(err))
    try:
        for r in range(rank, p.shares, world):
            _write_share(p, r, tmp)
        if rank == 0:
            _write_json(os.path.join(tmp, "checkpoint.json"), _meta(p, {}, frozen_excluded))
    except Exception as e:  # noqa: BLE001
        err = _reason(e)
    try:
        _agree(gather_json(err))
        snap = _rng_snapshot()  # DeepSpeed saved no RNG state: this process's streams stay as they are
        try:
            path, _, progress = load_sharded(
                state, root, hidden, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            )
        finally:
            _rng_restore(snap)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return p.folder.path, client_state(p), p, progress


def _same_model(p: Plan, module: Any) -> bool:
    """Refuse a checkpoint that lacks parameters of this model, naming DeepSpeed's folder (not the converted copy).

    Returns whether it was saved with ``exclude_frozen_parameters=True``: every missing parameter frozen here and no
    frozen value in the checkpoint (the model at hand tells it at ZeRO 1 too, where DeepSpeed's files do not).
    """
    held = {base_name(n) for n in p.trainable} | set(p.frozen) | set(p.shared)
    missing = [(n, q) for n, q in module.named_parameters() if n not in held]
    if not missing:
        return False
    if all(not q.requires_grad for _, q in missing) and not p.frozen:
        return True
    raise DeepSpeedCheckpointError(
        f"{p.folder.path} was saved from a different model: it has no '{missing[0][0]}' "
        f"({len(missing)} of this model's parameters missing); load it into the same architecture"
    )


def resume_trainer(state: TrainState, trainer_scheduler: Any, checkpoint: str) -> Progress | None:
    """``Trainer.train(resume_from_checkpoint=...)`` on a checkpoint transformers wrote under DeepSpeed.

    The engine state comes from ``checkpoint/global_stepN`` (where ``latest`` points); the
    Trainer's scheduler (``trainer_scheduler``) from ``scheduler.pt`` (a scheduler the Trainer made)
    or from DeepSpeed's own (a config ``scheduler`` section), read without running pickled code.
    Returns the counters for the engine to take.
    """
    from hf_zero.distributed import dist as hz_dist

    with hz_dist.peer_failure_guard("load_checkpoint"):
        _, _, p, progress = _load(state, checkpoint, None, True, True, False)
    sched = trainer_scheduler
    if sched is None or sched is state.lr_scheduler:
        return progress
    pt = os.path.join(checkpoint, "scheduler.pt")
    saved = load_pickle(pt) if os.path.isfile(pt) else p.model0.get("lr_scheduler")
    if saved is not None:
        sched.load_state_dict(saved)
    return progress
