"""Argument checks shared by the public API: one rule, one message, wherever it applies."""

from __future__ import annotations

import numbers


def positive_int(value, name: str) -> int:
    """``value`` as an int when it is a positive integer (Python or NumPy; not a bool, not a
    float, even an integral one); otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def index(i, n: int, name: str = "tensor index") -> int:
    """``i`` as an int in ``[0, n)`` (Python or NumPy integer, not a bool)."""
    if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
        raise ValueError(f"{name} {i!r} must be an int in [0, {n})")
    return int(i)
