"""Loading a resume checkpoint at another tensor- or expert-parallel degree (tp 2 x dp 2 saved, dp 4 resumed, and
back; EP 2 saved, EP 4 or no EP resumed, and back: an EP rank's experts are a dim-0 slice named ``name@ep0of2``).

A checkpoint stores a tensor-parallel slice under a name of its own per rank (``name@tp0of2``, with its dim, degree
and whole shape in the parameter table; ``hf_zero/parallel/tp_split.py``) and a whole parameter under its name. This run
asks the reader for its own names (:func:`hf_zero.parallel.tp_split.checkpoint_name`); where the checkpoint holds that name
under another split, :func:`install` gives the reader a derived value for it: the whole tensor put back from the
saved slices (or read whole), then cut to this rank's slice. Every kind stored for the parameter is derived alike
(the fp32 master, each optimizer state tensor, a frozen value), and its scalar optimizer state (Adam's ``step``)
is the saved one's. A parameter is assembled whole once per kind while the ranges of it are read, so a rank holds
at most one whole parameter beyond its own state.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from hf_zero.checkpoint.format import CheckpointReader
from hf_zero.parallel.tp_split import TPSplit, cut, cut_entry, join_entry, parse_slice_name


def base_name(key: str) -> str:
    """The parameter a stored name is (a slice's ``name@tp0of2`` -> ``name``)."""
    cut = parse_slice_name(key)
    return cut[0] if cut else key


def whole_shapes(params: dict[str, dict]) -> dict[str, tuple[int, ...]]:
    """The whole shape of every parameter of a checkpoint's table, by parameter (not stored) name."""
    return {base_name(k): tuple(c["full_shape"] if (c := cut_entry(v)) else v["shape"]) for k, v in params.items()}


def install(reader: CheckpointReader, saved: dict[str, dict], here: dict[str, TPSplit | None]) -> int:
    """Derive, for each of this rank's stored names ``here`` (name -> its split, None for a whole parameter) that the
    checkpoint's table ``saved`` lacks, its values from how the checkpoint split that parameter; returns how many."""
    pieces: dict[str, list[tuple[int, str]]] = defaultdict(list)  # parameter -> [(tp rank, stored name)] when sliced
    for key in saved:
        cut = parse_slice_name(key)
        if cut:
            pieces[cut[0]].append((cut[1], key))
    kinds: dict[str, set[str]] = defaultdict(set)
    for kind, name in reader.index:
        kinds[name].add(kind)
    count = 0
    for want, split in here.items():
        if want in saved:
            continue
        base = base_name(want)
        sources = [base] if base in saved else [k for _, k in sorted(pieces.get(base, []))]
        if not sources:
            continue  # the name checks have already refused a parameter the checkpoint does not hold
        for kind in set.intersection(*(kinds[s] for s in sources)):
            reader.derived[(kind, want)] = _Derived(reader, kind, sources, saved, split)
            reader.index[(kind, want)] = []  # known to the reader; read() takes the derived value
        if sources[0] in reader.scalars:
            reader.scalars[want] = dict(reader.scalars[sources[0]])
        count += 1
    return count


class _Derived:
    """One kind of one parameter as this rank stores it, from the checkpoint's pieces of it (read when asked)."""

    def __init__(self, reader: CheckpointReader, kind: str, sources: list[str], saved: dict[str, dict],
                 split: TPSplit | None) -> None:
        self.reader, self.kind, self.sources, self.saved, self.split = reader, kind, sources, saved, split

    def value(self) -> torch.Tensor:
        """This rank's values, flattened: the whole parameter put together, then this rank's slice of it."""
        parts = []
        for s in self.sources:
            shape = tuple(self.saved[s]["shape"])
            buf = torch.empty(math.prod(shape), dtype=torch.float32 if self.kind != "frozen" else _dtype(self.saved[s]))
            self.reader.read(self.kind, s, 0, buf.numel(), buf)
            parts.append(buf.view(shape))
        whole = parts[0] if len(parts) == 1 else join_entry(parts, cut_entry(self.saved[self.sources[0]]))
        if self.split is not None:
            s = self.split
            whole = cut(whole, s.dim, s.rank, s.size, s.view)
        return whole.reshape(-1)


def _dtype(entry: dict) -> torch.dtype:
    return getattr(torch, entry.get("dtype", "float32"))
