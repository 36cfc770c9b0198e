"""The resume checkpoint's old single module, kept for one release: its public names, from their new homes.

The code is split by responsibility: :mod:`hf_zero.checkpoint.format` (the on-disk format and a
reader), :mod:`hf_zero.checkpoint.ranks` (who writes what, agreement across ranks),
:mod:`hf_zero.checkpoint.atomic` (atomic publication, rotation), :mod:`hf_zero.checkpoint.save`,
:mod:`hf_zero.checkpoint.load` and :mod:`hf_zero.checkpoint.optim_state` (optimizer-state
remapping). Import from those.
"""

from __future__ import annotations

from hf_zero.checkpoint.atomic import rotate
from hf_zero.checkpoint.format import FORMAT, LATEST, MAX_FILE_BYTES, CheckpointReader, resolve_tag
from hf_zero.checkpoint.load import load
from hf_zero.checkpoint.save import save
from hf_zero.errors import CheckpointError

__all__ = ["FORMAT", "LATEST", "MAX_FILE_BYTES", "CheckpointError", "CheckpointReader", "load", "resolve_tag", "rotate", "save"]
