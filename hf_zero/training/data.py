"""Batches: the data-parallel sampler the engine's loader uses (with a position a checkpoint can restore), and moving a batch to the device."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


class ResumableDistributedSampler(torch.utils.data.DistributedSampler):
    """``DistributedSampler`` that remembers how far into the epoch this rank has read.

    The position is kept as the number of samples consumed by *all* ranks together, so a
    checkpoint taken at world size N resumes at world size M on the same next sample whenever
    the global count divides by M (rank r reads ``perm[r::world]``, so the first G samples of the
    epoch's permutation are exactly what G/world steps of every rank consumed).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0  # samples this rank has yielded in the current epoch
        self._start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._start = self._start, 0
        self.consumed = start
        for i in indices[start:]:
            self.consumed += 1
            yield i
        self.consumed = 0  # the epoch is over; the next iteration starts a fresh one

    def __len__(self) -> int:
        return self.num_samples - self._start if self._start else self.num_samples

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "global_consumed": int(self.consumed * self.num_replicas), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved epoch at the saved global position (see the class docstring)."""
        self.epoch = int(state["epoch"])
        consumed = int(state["global_consumed"])
        if consumed % self.num_replicas:
            raise ValueError(
                f"the data position saved in the checkpoint ({consumed} samples into epoch {self.epoch}) is not a "
                f"multiple of the new world size {self.num_replicas}; resume on a world size that divides it"
            )
        self._start = consumed // self.num_replicas
        self.consumed = self._start


def to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """A batch on ``device``: tensors nested in tuples, named tuples, lists and mappings moved (floats cast to ``float_dtype`` if given)."""
    if torch.is_tensor(obj):
        if float_dtype is not None and obj.is_floating_point() and obj.dtype != float_dtype:
            return obj.to(device=device, dtype=float_dtype, non_blocking=True)
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device, float_dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, float_dtype) for v in obj)
    if isinstance(obj, Mapping):
        moved = {k: to_device(v, device, float_dtype) for k, v in obj.items()}
        try:
            return type(obj)(moved)
        except Exception:
            return moved
    return obj


class RepeatingLoader:
    """DeepSpeed's ``deepspeed.utils.RepeatingLoader``: iterate ``loader`` forever, starting it again when it ends.

    Pipeline scripts hand ``engine.train_batch`` an iterator that must not run dry
    (``iter(RepeatingLoader(loader))``). As DeepSpeed's, it only calls ``iter(loader)`` again: a sampler's
    epoch is not advanced, so a ``DistributedSampler`` repeats its order unless the script calls ``set_epoch``.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
