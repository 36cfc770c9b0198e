"""Peak bytes of live CPU tensor storages inside a block, measured as they are created and freed.

Every tensor an operator returns is looked at; each new storage is watched with a weak
reference (torch keeps a storage's Python object alive exactly as long as the storage), and at
each new allocation the live total is recomputed from the watched storages' *current* sizes,
so buffers emptied with ``untyped_storage().resize_(0)`` (how stage 3 frees gathered units) stop
counting the moment they are emptied, not when they die.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    """``with PeakBytes() as m: ...`` then ``m.peak``: the most storage bytes alive at once, net of the start."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.peak = 0

    def _total(self) -> int:
        total = 0
        for key, ref in list(self.live.items()):
            st = ref()
            if st is None:
                del self.live[key]
            else:
                total += st.nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                st = t.untyped_storage()
                key = id(st)
                if key not in self.live or self.live[key]() is not st:
                    self.live[key] = weakref.ref(st)
                    grew = True
        if grew or func is torch.ops.aten.resize_.default:
            self.peak = max(self.peak, self._total())
        return out
