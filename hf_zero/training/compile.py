"""``torch.compile`` of a model's blocks, the way the ZeRO engine can live with it.

Compiling the whole model would pull stage 3's gather/free hooks and stage 1-2's gradient hooks
into the graph (or break it at each of them). The engine compiles each block's ``forward``
instead (the units ``find_units`` picks: a transformers model's decoder layers), as FSDP2 users
do with ``fully_shard``: the hooks run around the compiled code, which only sees whole weights,
and every block of one shape shares one compiled graph. Activation checkpointing, when on,
wraps the compiled forward, so the recomputation in backward runs compiled code too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_zero.zero.external import outside_reads_paused
from hf_zero.zero.stage3 import find_units


def compile_blocks(module: torch.nn.Module, backend: str | Any = "inductor", kwargs: Mapping[str, Any] | None = None) -> int:
    """Replace each block's ``forward`` with a ``torch.compile``-d one; returns how many were compiled.

    A block already compiled is left alone, so calling this twice does not compile twice.
    """
    options = dict(kwargs or {})
    count = 0
    for _, block in find_units(module):
        if getattr(block.forward, "_hf_zero_compiled", False):
            continue
        compiled = torch.compile(block.forward, backend=backend, **options)

        def forward(*args: Any, _compiled: Any = compiled, **kw: Any) -> Any:
            # Stage 3 watches the first forwards for weights read outside their block (hf_zero/zero/external.py).
            # Traced under that TorchFunctionMode, dynamo would capture the block again once the watch is over
            # (4 graphs where 1 does): the compiled code runs unwatched, the code around the blocks watched.
            with outside_reads_paused():
                return _compiled(*args, **kw)

        forward._hf_zero_compiled = True  # type: ignore[attr-defined]
        block.forward = forward
        count += 1
    return count
