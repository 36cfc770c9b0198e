"""Writing checkpoints so that one appears whole or not at all, and rotating old ones away.

Every rank writes into ``<save_dir>/.<tag>.partial/``; once every share is there, rank 0 writes
``checkpoint.json`` last, fsyncs, renames the folder to ``<tag>`` (:func:`publish`) and only then
replaces ``latest``. A crash at any point leaves the previous checkpoint and ``latest`` untouched;
the next save into the folder removes what the crash left (:func:`clean_leftovers`).

Rotation (``keep_last=N``, :func:`rotate`): only after the new checkpoint is complete and
``latest`` points at it, all but the N newest checkpoints (by ``global_steps``, then time) are
removed, never the one ``latest`` names. A removed checkpoint is first renamed to a hidden
``.<tag>.deleting``, so a crash halfway through a deletion never leaves a half-deleted folder that
looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from hf_zero.checkpoint.format import FORMAT, LATEST, META, read_latest

_LEFTOVERS = (".partial", ".old", ".deleting")


def partial_dir(save_dir: str, tag: str) -> str:
    """Where the ranks write a checkpoint before it is published."""
    return os.path.join(save_dir, f".{tag}.partial")


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """``obj`` as JSON at ``path``, through a temporary file that is fsynced and renamed over it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def clean_leftovers(save_dir: str) -> None:
    """Remove what a crashed save or rotation left; put back a tag caught between its two renames."""
    for name in os.listdir(save_dir):
        full = os.path.join(save_dir, name)
        if not (name.startswith(".") and name.endswith(_LEFTOVERS) and os.path.isdir(full)):
            continue
        if name.endswith(".old"):
            tag = name[1 : -len(".old")]
            if tag and not os.path.exists(os.path.join(save_dir, tag)):
                os.replace(full, os.path.join(save_dir, tag))  # the crash came before its replacement arrived
                continue
        shutil.rmtree(full, ignore_errors=True)


def publish(save_dir: str, tag: str, save_latest: bool) -> str:
    """Rename the whole ``.<tag>.partial`` to ``<tag>`` (replacing an old one only now), then move ``latest``."""
    partial, final = partial_dir(save_dir, tag), os.path.join(save_dir, tag)
    fsync_dir(partial)
    if os.path.exists(final):  # overwriting a tag: the old one goes only once the new one is whole
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    fsync_dir(save_dir)
    if save_latest:
        tmp = os.path.join(save_dir, f".{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST))
        fsync_dir(save_dir)
    return final


def rotate(save_dir: str, keep_last: int, current: str) -> list[str]:
    """Remove all but the ``keep_last`` newest checkpoints of ``save_dir``; returns the tags removed.

    Never removes ``current`` or the tag ``latest`` names; folders that are not hf_zero
    checkpoints (no readable ``checkpoint.json`` of this format) are not touched.
    """
    found = []
    for name in os.listdir(save_dir):
        meta_path = os.path.join(save_dir, name, META)
        if name.startswith(".") or not os.path.isfile(meta_path):
            continue
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("format") != FORMAT:
                continue
            found.append((int(meta["global_steps"]), os.path.getmtime(meta_path), name))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    found.sort(reverse=True)
    keep = {name for _, _, name in found[:keep_last]} | {current, read_latest(save_dir)}
    removed = []
    for _, _, name in found:
        if name in keep:
            continue
        hidden = os.path.join(save_dir, f".{name}.deleting")
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(os.path.join(save_dir, name), hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(name)
    if removed:
        fsync_dir(save_dir)
    return removed
