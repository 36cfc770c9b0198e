"""Unknown config keys: which known key one was meant to be, and the sentence that names it.

:mod:`hf_zero.config.parse` decides what an unknown key does (stop the run in a section DeepSpeed closes, stop it on a
near-certain misspelling, else warn); this module only measures spellings against the schema's names and words the
answer. Apart from the walk because it is string distance, not config semantics: its thresholds are tuned on real
configs' keys (tests/test_config_rules.py) and change without touching how a section is read.
"""

from __future__ import annotations

from collections.abc import Iterable

from hf_zero.config.schema import SECTIONS


def _distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) that turn ``a`` into ``b``."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def near_miss(key: str, names: Iterable[str]) -> str | None:
    """The known key ``key`` is a near-certain misspelling of, or None.

    Near-certain means a case or separator slip (``Zero-Optimization``), or one edit for a key of
    up to five letters and two for a longer one (``zero_optimisation``, ``stage3_prefetch_bucket_sise``,
    ``stgae``). Wider than that, real keys of other tools start to match (``_comment`` is three
    edits from ``comet``), and those must pass with a warning, not stop the run.
    """
    plain = key.lower().replace("-", "_").replace(" ", "_")
    scored = sorted((_distance(plain, name.lower()), name) for name in names)
    if not scored:
        return None
    edits, name = scored[0]
    return name if edits <= (1 if len(plain) <= 5 else 2) else None


def suggest(key: str, names: Iterable[str]) -> str | None:
    """The known key to name in "did you mean" where an unknown key is refused anyway (a closed section).

    Wider than :func:`near_miss`, which decides whether to stop a run at all: the closest name when
    it is within a third of the key's length in edits and closer than any other, or else the one
    name that contains the key (``min_loss`` -> ``min_loss_scale``), or the one the key contains.
    """
    names = list(names)
    close = near_miss(key, names)
    if close is not None:
        return close
    plain = key.lower().replace("-", "_").replace(" ", "_")
    scored = sorted((_distance(plain, name.lower()), name) for name in names)
    if scored and scored[0][0] <= len(plain) // 3 and (len(scored) == 1 or scored[1][0] > scored[0][0]):
        return scored[0][1]
    if len(plain) >= 4:  # a shortened key (``topk``), then a key with something added (``stage_3``)
        for within in ([n for n in names if plain in n.lower()], [n for n in names if len(n) >= 4 and n.lower() in plain]):
            if len(within) == 1:
                return within[0]
    return None


def _home(key: str) -> str | None:
    """The one other section DeepSpeed reads ``key`` in ("" for the top level), or None."""
    homes = [path for path, section in SECTIONS.items() if key in section.names()]
    return homes[0] if len(homes) == 1 else None


def read_elsewhere(key: str) -> str:
    """Where DeepSpeed reads an unknown key when it is a key of exactly one other section, for the warning."""
    home = _home(key)
    if home is None:
        return ""
    return " (a top-level key)" if home == "" else f" (a key of {home})"


OWN_CLOSED = ("fp8",)  # closed sections DeepSpeed 0.19.8 does not have


def unknown_in_closed(full: str, key: str, section: str, names: Iterable[str]) -> str:
    """The sentence refusing ``key`` (at JSON path ``full``) in the closed ``section``, which takes ``names``."""
    names = sorted(set(names))
    # hf_zero's own closed sections (fp8) have no DeepSpeed counterpart to cite
    too = ("hf_zero's own section refuses unknown keys" if section in OWN_CLOSED
           else f"DeepSpeed 0.19.8 refuses unknown keys in {section} too")
    close = suggest(key, names)
    if close is not None:
        return f"{full}: unknown key; did you mean {close!r}? ({too})"
    home = _home(key)
    if home is not None:
        where = "a top-level key" if home == "" else f"a key of {home}"
        return f"{full}: unknown key ({key} is {where}; move it there), and {too}"
    listed = f"; {section} takes {', '.join(names)}" if len(names) <= 12 else ""
    return f"{full}: unknown key, and {too}; remove it or correct its name{listed}"
