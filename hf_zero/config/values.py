"""Value checks for DeepSpeed config keys: each takes ``(value, path)`` and returns the value or raises.

Every check raises one :class:`ConfigError` sentence in the form the whole parser uses,
``path: got X, expected Y``, so a user sees the JSON path, what they wrote and what would do.
The parser (``config/parse.py``) calls these; the tables of which key takes which check are in
``config/schema.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hf_zero.config.schema import ANY, AUTO, SECTION, SWITCH, ConfigError


def show(value: Any) -> str:
    """A value for a message: its Python repr (as optim.py's messages write it), shortened if long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def json_kind(value: Any) -> str:
    """The JSON name of a value's type, for messages about the wrong kind of thing."""
    for types, name in ((bool, "boolean"), (dict, "object"), ((list, tuple), "array"), (str, "string"),
                        ((int, float), "number"), (type(None), "null")):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Bool:
    """A JSON boolean, or the integers 0 and 1, which DeepSpeed reads as false and true (pydantic's and Python's
    truth, e.g. ``"zero_allow_untested_optimizer": 1`` in its own tests); strings such as ``"true"`` and other
    numbers are refused, since there a typo would flip a feature silently."""

    what: str = "true or false"

    def __call__(self, value: Any, path: str) -> bool:
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return value


@dataclass(frozen=True)
class Int:
    """An integer >= ``minimum`` (any integer if None); integral floats such as ``5e8`` pass, as DeepSpeed configs
    write them."""

    minimum: int | None = 0

    @property
    def what(self) -> str:
        if self.minimum is None:
            return "an integer"
        return "a positive integer" if self.minimum == 1 else f"an integer >= {self.minimum}"

    def __call__(self, value: Any, path: str) -> int:
        if (not _is_number(value) or not float(value).is_integer()
                or (self.minimum is not None and value < self.minimum)):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return int(value)


@dataclass(frozen=True)
class Number:
    """A finite number >= ``minimum`` (or > it when ``strict``; any if None), at most ``maximum`` when one is given."""

    minimum: float | None = 0.0
    strict: bool = False
    maximum: float | None = None

    @property
    def what(self) -> str:
        if self.minimum is None:
            return "a number"
        if self.maximum is not None:
            return f"a number from {self.minimum:g} to {self.maximum:g}"
        if self.minimum == 0:
            return "a positive number" if self.strict else "a non-negative number"
        return f"a number {'>' if self.strict else '>='} {self.minimum:g}"

    def __call__(self, value: Any, path: str) -> float:
        low = self.minimum
        if (not _is_number(value) or (low is not None and (value < low or (self.strict and value == low)))
                or (self.maximum is not None and value > self.maximum)):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return float(value)


@dataclass(frozen=True)
class OpenRatio:
    """A number strictly between 0 and 1 (pydantic's ``gt=0.0, lt=1.0``, as DeepSpeed's ``zenflow.topk_ratio``)."""

    what: str = "a number greater than 0 and less than 1"

    def __call__(self, value: Any, path: str) -> float:
        if not _is_number(value) or not 0.0 < value < 1.0:
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return float(value)


@dataclass(frozen=True)
class Text:
    """Any string (a path, a name); ``null`` is handled by the caller's ``nullable``."""

    what: str = "a string"

    def __call__(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        return value


@dataclass(frozen=True)
class OneOf:
    """One of a fixed list; strings match case-insensitively and come back in the canonical spelling."""

    options: tuple

    @property
    def what(self) -> str:
        return "one of " + ", ".join(str(o) for o in self.options)

    def __call__(self, value: Any, path: str) -> Any:
        for option in self.options:
            if isinstance(option, str) and isinstance(value, str) and option.lower() == value.lower():
                return option
            if not isinstance(option, str) and _is_number(value) and value == option:
                return option
        raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")


@dataclass(frozen=True)
class SignalNames:
    """A JSON array of signal names a process can catch (``["SIGTERM", "SIGUSR1"]``); [] turns the watch off."""

    options: tuple[str, ...]

    @property
    def what(self) -> str:
        return 'a list of signal names such as ["SIGTERM", "SIGUSR1"] (any of ' + ", ".join(self.options) + ")"

    def __call__(self, value: Any, path: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: got {show(value)}, expected {self.what}")
        names = []
        for i, item in enumerate(value):
            name = item.upper() if isinstance(item, str) else item
            if isinstance(name, str) and not name.startswith("SIG") and "SIG" + name in self.options:
                raise ConfigError(f"{path}[{i}]: got {show(item)}, expected a signal's full name such as 'SIG{name}'")
            if name in ("SIGKILL", "SIGSTOP"):
                raise ConfigError(f"{path}[{i}]: got {show(item)}, which no process can catch; expected one of "
                                  + ", ".join(self.options))
            if name not in self.options:
                raise ConfigError(f"{path}[{i}]: got {show(item)}, expected one of " + ", ".join(self.options))
            names.append(name)
        return tuple(dict.fromkeys(names))


def asks_for(value: Any, quiet: Any) -> bool:
    """Does ``value`` ask for a feature, given the value (or section kind) that asks for nothing?"""
    if quiet is SWITCH:
        return isinstance(value, dict) and value.get("enabled") is True
    if quiet is SECTION:
        return value is not None and value != {}
    if quiet is ANY:
        return value not in (None, False, {})
    if quiet is None:
        return value is not None
    if isinstance(quiet, str) and isinstance(value, str):
        return value.lower() != quiet.lower()
    return value != quiet


def check_quiet_type(value: Any, quiet: Any, path: str) -> None:
    """An ignored or refused key still has a type: a bool key given ``"false"`` is a mistake worth naming."""
    if quiet is ANY:
        return
    if quiet in (SWITCH, SECTION):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{path}: got {show(value)}, expected an object")
        if quiet is SWITCH and isinstance(value, dict) and "enabled" in value:
            if not isinstance(value["enabled"], bool) and value["enabled"] != AUTO:
                Bool()(value["enabled"], f"{path}.enabled")
    elif isinstance(quiet, bool):
        Bool()(value, path)
    elif isinstance(quiet, (int, float)):
        if not _is_number(value):
            raise ConfigError(f"{path}: got {show(value)}, expected a number")
    elif isinstance(quiet, str) and not isinstance(value, str):
        raise ConfigError(f"{path}: got {show(value)}, expected a string")
