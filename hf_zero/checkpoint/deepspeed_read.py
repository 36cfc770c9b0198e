"""Reading DeepSpeed's checkpoint folders without DeepSpeed and without running code from a pickle.

A DeepSpeed ``save_checkpoint(save_dir)`` writes ``save_dir/<tag>/`` (and ``save_dir/latest``):

    mp_rank_00_model_states.pt                     ZeRO 0-2: the module's state dict, counters,
                                                   scheduler, client state, and (ZeRO 1-2) the
                                                   names and shapes of the flattened parameters
    zero_pp_rank_R_mp_rank_00_model_states.pt      ZeRO 3: the same per rank (parameters empty)
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  ZeRO 1-3 (and bf16): rank R's fp32 partition
                                                   and its optimizer state

These are pickles. They are read with ``torch.load(..., weights_only=True)``, whose unpickler
builds only tensors and plain containers; the few DeepSpeed classes the files name (its loss
scaler, its ZeRO-stage enum, the fragment addresses of ``param_slice_mappings``) are given as
the plain attribute holders below, registered under DeepSpeed's names, so nothing from the file
runs and DeepSpeed need not be installed. Any other global is named in a refusal and never
loaded. The files are memory-mapped, so a rank reads only the bytes it uses.

DeepSpeed's AutoEP (the ``expert_parallel`` section) adds ``layer_<L>_expert_<X>_mp_rank_00_model_states.pt``, one
per expert, at ZeRO 1-2: copies of the experts' weights the optimizer files hold as masters, listed here and not read
(``deepspeed_autoep.py`` maps the rest).

Layouts hf_zero cannot take are refused in one sentence naming them: tensor or pipeline
parallelism (``mp_rank_01…``, ``layer_*`` files), DeepSpeed's own MoE layers' files and per-EP-rank
optimizer files (``expp_rank_*``, ZeRO 0 with experts), NVMe offload swap folders, universal
checkpoints, and a folder missing one of its rank files.
"""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_zero.errors import CheckpointError

LATEST = "latest"


class DeepSpeedCheckpointError(CheckpointError):
    """A DeepSpeed checkpoint folder that cannot be read, or holds a layout hf_zero does not take."""


# ----------------------------------------------------------------- stand-ins for DeepSpeed's classes


class LossScalerState:
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler``'s saved attributes (``cur_scale``, ``dynamic``)."""


class DynamicLossScalerState(LossScalerState):
    """``DynamicLossScaler``'s saved attributes (``cur_scale``, ``cur_iter``, ``cur_hysteresis``, ...)."""


class ZeroStage(int):
    """``deepspeed.runtime.zero.config.ZeroStageEnum``: pickled as the enum called with its value."""


class FragmentAddress:
    """``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``); read, not used."""


STAND_INS: list[tuple[type, str]] = [
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_pickle(path: str) -> Any:
    """One DeepSpeed ``.pt`` file, memory-mapped, through torch's restricted unpickler and the stand-ins."""
    try:
        with torch.serialization.safe_globals(STAND_INS):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # a legacy (non-zip) file
    except Exception as e:
        # torch's restricted unpickler raises pickle's UnpicklingError; hf_zero imports no pickle module
        if type(e).__name__ == "UnpicklingError":
            raise DeepSpeedCheckpointError(_refusal(path, str(e))) from None
        if isinstance(e, (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError)):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DeepSpeedCheckpointError(f"{path} cannot be read as a torch checkpoint ({first}); the file is damaged") from None
        raise


def _refusal(path: str, message: str) -> str:
    found = re.search(r"GLOBAL (\S+)", message) or re.search(r"unrecognized function (\S+)", message)
    what = f"the pickled global '{found.group(1)}'" if found else "a pickled object torch's safe loader refuses"
    known = ", ".join(name for _, name in STAND_INS)
    return (f"{path} holds {what}, which hf_zero does not load because unpickling it could run code from the file; "
            f"only tensors, plain containers and DeepSpeed's own state classes ({known}) are read")


# ----------------------------------------------------------------------------------- the folder

_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


@dataclass
class Folder:
    """The files of one DeepSpeed checkpoint tag, by data-parallel rank."""

    path: str
    tag: str
    model_files: list[str]  # one (ZeRO 0-2) or one per rank (ZeRO 3)
    optim_files: list[str] = field(default_factory=list)  # one per rank (ZeRO 1-3, bf16), none for ZeRO 0
    optim_pattern: str = ""  # the optimizer-state file name with "{}" for the rank
    expert_files: list[str] = field(default_factory=list)  # MoE layers' per-expert weights (AutoEP's: not read)


def resolve(load_dir: str, tag: str | None) -> tuple[str, str]:
    """``(folder, tag)``: ``tag`` inside ``load_dir``, the tag ``latest`` names, or ``load_dir`` itself if it is one."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
        elif _has_model_states(load_dir):
            return os.path.normpath(load_dir), os.path.basename(os.path.normpath(load_dir))
        else:
            raise DeepSpeedCheckpointError(f"{load_dir} has no '{LATEST}' file; pass tag= (--tag) naming the checkpoint folder")
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag:
        raise DeepSpeedCheckpointError(f"{load_dir}: the tag {tag!r} is not a plain folder name inside {load_dir}")
    return os.path.join(load_dir, tag), tag


def _has_model_states(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(_MODEL.match(n) or _MODEL3.match(n) for n in names)


def is_deepspeed_checkpoint(load_dir: str, tag: str | None = None) -> bool:
    """Whether ``load_dir`` (at ``tag``, or where ``latest`` points) is a DeepSpeed checkpoint, not an hf_zero one."""
    try:
        path, _ = resolve(load_dir, tag)
    except CheckpointError:
        return False
    return not os.path.isfile(os.path.join(path, "checkpoint.json")) and _has_model_states(path)


def find(load_dir: str, tag: str | None) -> Folder:
    """The folder's files, or a one-sentence refusal of a layout hf_zero does not take."""
    path, tag = resolve(load_dir, tag)
    if not os.path.isdir(path):
        raise DeepSpeedCheckpointError(f"{path} does not exist (the tag {tag!r} names no folder in {load_dir})")
    names = sorted(os.listdir(path))
    for n in names:
        full = os.path.join(path, n)
        if n == "offloaded_tensors":
            raise DeepSpeedCheckpointError(
                f"{path} holds an NVMe offload swap folder ('{n}'), whose optimizer state lives outside the checkpoint "
                "files; hf_zero does not read it — resume it in DeepSpeed and save without NVMe offload, then convert"
            )
        if n == "zero" and os.path.isdir(full):
            raise DeepSpeedCheckpointError(
                f"{path} is a DeepSpeed universal checkpoint ('{n}/' folder); convert the original checkpoint it was made from"
            )
        if n.startswith("layer_") and not _EXPERT.match(n):
            raise DeepSpeedCheckpointError(
                f"{path} holds pipeline-parallel layer files ('{n}'); hf_zero converts data-parallel ZeRO checkpoints only"
            )
        if n.startswith("expp_rank_"):
            raise DeepSpeedCheckpointError(
                f"{path} holds mixture-of-experts files ('{n}': optimizer state per EP rank, which DeepSpeed writes at ZeRO "
                "stage 0), which hf_zero does not convert; it converts AutoEP checkpoints of ZeRO stages 1-3"
            )
        if n.startswith("expert_"):
            raise DeepSpeedCheckpointError(f"{path} holds mixture-of-experts files ('{n}'), which hf_zero does not convert")
        m = _MODEL.match(n) or _MODEL3.match(n) or _OPTIM.match(n) or _EXPERT.match(n)
        if m and int(m.groups()[-1]) != 0:
            raise DeepSpeedCheckpointError(
                f"{path} holds tensor/model-parallel rank files ('{n}'); hf_zero converts data-parallel ZeRO checkpoints "
                "only (model-parallel rank 00)"
            )
    model0 = [n for n in names if _MODEL.match(n)]
    model3 = {int(_MODEL3.match(n).group(1)): n for n in names if _MODEL3.match(n)}  # type: ignore[union-attr]
    optim = {int(_OPTIM.match(n).group(1)): n for n in names if _OPTIM.match(n)}  # type: ignore[union-attr]
    if not model0 and not model3:
        raise DeepSpeedCheckpointError(f"{path} has no DeepSpeed model-states file (mp_rank_00_model_states.pt); it is not a DeepSpeed checkpoint")
    model_files = [os.path.join(path, model0[0])] if model0 else _contiguous(path, model3, "zero_pp_rank_{}_mp_rank_00_model_states.pt")
    optim_files = _contiguous(path, optim, _optim_pattern(optim)) if optim else []
    pattern = _optim_pattern(optim) if optim else ""
    experts = [os.path.join(path, n) for n in names if _EXPERT.match(n)]
    return Folder(path, tag, model_files, optim_files, pattern, experts)


def _optim_pattern(found: dict[int, str]) -> str:
    any_name = next(iter(found.values()))
    prefix = any_name[: any_name.index("zero_pp_rank_")]
    return prefix + "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _contiguous(path: str, by_rank: dict[int, str], pattern: str) -> list[str]:
    for r in range(max(by_rank) + 1):
        if r not in by_rank:
            raise DeepSpeedCheckpointError(f"{path} is incomplete: {pattern.format(r)} is missing")
    return [os.path.join(path, by_rank[r]) for r in range(len(by_rank))]


def expect_ranks(folder: Folder, world: int) -> None:
    """Refuse a folder whose rank files do not match the data-parallel world that saved it."""
    checks = [(folder.optim_files, folder.optim_pattern)]
    if len(folder.model_files) > 1:
        checks.append((folder.model_files, "zero_pp_rank_{}_mp_rank_00_model_states.pt"))
    for files, pattern in checks:
        if files and len(files) < world:
            raise DeepSpeedCheckpointError(f"{folder.path} is incomplete: {pattern.format(len(files))} is missing "
                                           f"(it was saved by {world} data-parallel ranks)")
        if len(files) > world:
            raise DeepSpeedCheckpointError(
                f"{folder.path} has {len(files)} rank files like {pattern.format(0)} but was saved by {world} "
                "data-parallel ranks; files from another save are mixed in"
            )
