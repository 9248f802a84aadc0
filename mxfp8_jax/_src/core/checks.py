"""Argument checks shared by the public API: one rule, one message, wherever it applies."""

from __future__ import annotations

import numbers

import numpy as np


def positive_int(value, name: str) -> int:
    """``value`` as an int when it is a positive integer (Python or NumPy; not a bool, not a
    float, even an integral one); otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def int_tuple(value, name: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints when it is a sequence of integers (Python or NumPy; no bool,
    no float, even an integral one); otherwise a TypeError naming ``name``."""
    try:
        items = tuple(value)
    except TypeError:
        items = None
    if items is None or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in items):
        raise TypeError(f"{name}={value!r} must be a tuple of ints")
    return tuple(int(d) for d in items)


def index(i, n: int, name: str = "tensor index") -> int:
    """``i`` as an int in ``[0, n)`` (Python or NumPy integer, not a bool)."""
    if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
        raise ValueError(f"{name} {i!r} must be an int in [0, {n})")
    return int(i)


def mesh_difference(got, want) -> str:
    """What tells mesh ``got`` from mesh ``want`` apart (axis names, sizes, types, devices and
    their order), for errors where the two reprs would look alike; ``""`` when they are equal."""
    diffs = []
    if tuple(got.axis_names) != tuple(want.axis_names):
        diffs.append(f"axis names {tuple(got.axis_names)} vs {tuple(want.axis_names)}")
    if got.devices.shape != want.devices.shape:
        diffs.append(f"axis sizes {got.devices.shape} vs {want.devices.shape}")
    got_types, want_types = getattr(got, "axis_types", None), getattr(want, "axis_types", None)
    if got_types != want_types:
        diffs.append(f"axis types {got_types} vs {want_types}")
    a = [d.id for d in got.devices.reshape(-1)]
    b = [d.id for d in want.devices.reshape(-1)]
    if sorted(a) != sorted(b):
        diffs.append(f"devices (ids {sorted(set(a) - set(b))} vs {sorted(set(b) - set(a))} are in one only)")
    elif a != b:
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        pos = tuple(int(i) for i in np.unravel_index(k, got.devices.shape))
        order = f" (ids in mesh order {a} vs {b})" if len(a) <= 16 else ""
        diffs.append(f"device order: mesh position {pos} holds device {a[k]} vs {b[k]}{order}")
    if not diffs and got != want:
        diffs.append(f"{got!r} vs {want!r}")
    return "; ".join(diffs)
