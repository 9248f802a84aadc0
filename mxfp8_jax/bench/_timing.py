"""Shared benchmark plumbing: device-synchronised timing, tables, JSON."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence

import jax


def time_fn(fn: Callable, *args, warmup: int = 2, iters: int = 10, min_time: float = 0.0) -> float:
    """Median seconds per call of an already-jitted ``fn``, synchronised with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence], console=None) -> None:
    """A table with rich when available, plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich comes with flax
        print(title)
        print(" | ".join(header))
        for r in rows:
            print(" | ".join(str(c) for c in r))
        return
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*(str(c) for c in r))
    (console or Console()).print(table)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


def environment() -> dict:
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }
