"""Argument checks shared by the FLOPs modules: each names the argument it rejects, so a
bad ``stepwatch.init`` call says which value is wrong."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import SupportsIndex

__all__ = ["choice", "opt_positive_float", "opt_positive_int", "opt_str", "positive_float", "positive_int"]


def positive_int(name: str, value: object) -> int:
    # Int-like values (numpy integers) are accepted; floats, strings and bools are not.
    number = operator.index(value) if isinstance(value, SupportsIndex) else 0
    if isinstance(value, bool) or number <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def opt_positive_int(name: str, value: object) -> int | None:
    return None if value is None else positive_int(name, value)


def positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return number


def opt_positive_float(name: str, value: object) -> float | None:
    return None if value is None else positive_float(name, value)


def opt_str(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or null, got {value!r}")
    return value


def choice(name: str, value: object, allowed: Sequence[str | None]) -> str | None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)!r}, got {value!r}")
    return value if value is None else str(value)
