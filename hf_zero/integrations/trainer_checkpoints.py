"""What a Trainer's ``checkpoint-<step>`` folder holds under hf_zero, and which of them can be resumed.

hf_zero's Trainer keeps the engine's resume state in the folder's ``zero_state`` (:data:`ZERO_STATE_TAG`); a folder
transformers wrote under DeepSpeed (``global_stepN/``, ``latest``) is read too. Apart from the Trainer's save and load
overrides because resuming (``resume_from_checkpoint=True``) and loading both ask these questions of a folder alone.
"""

from __future__ import annotations

import os

ZERO_STATE_TAG = "zero_state"


def last_complete_checkpoint(folder: str) -> str | None:
    """The newest ``checkpoint-<step>`` with its trainer state and, when hf_zero wrote it, a published resume state."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from hf_zero.checkpoint.format import META

    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        step = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        path = os.path.join(folder, name)
        if name == step or not step.isdigit() or not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
            continue
        if os.path.isdir(os.path.join(path, ZERO_STATE_TAG)) or not saved_by_deepspeed(path):
            if not os.path.isfile(os.path.join(path, ZERO_STATE_TAG, META)):
                continue  # hf_zero's resume state never published: a save cut short
        found.append((int(step), path))
    return max(found)[1] if found else None


def saved_by_deepspeed(checkpoint: str) -> bool:
    """A ``checkpoint-N`` that transformers wrote under DeepSpeed (``global_stepN/`` and ``latest``), not by hf_zero."""
    from hf_zero.checkpoint.deepspeed_read import is_deepspeed_checkpoint

    return not os.path.isdir(os.path.join(checkpoint, ZERO_STATE_TAG)) and is_deepspeed_checkpoint(checkpoint)
