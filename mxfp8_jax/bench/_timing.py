"""Shared benchmark plumbing: device-synchronised timing, tables, JSON."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np


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


_ALLOCATOR = {"reuse_freed_memory": False}


def reuse_freed_memory(enable: bool = True) -> bool:
    """Keeps memory freed by XLA:CPU inside the process (glibc ``mallopt``: mmap and trim
    thresholds at 1 GiB), so that every call's fresh output buffers are not new pages.

    Without it each call of a jitted CPU function maps its large outputs anew and pays a page
    fault per 4 KiB (on a VM, several microseconds each): a 32 MiB copy then runs at under
    1 GB/s and every path measures the kernel's page-fault handler rather than its own work. It
    applies to every path of a benchmark alike. Returns whether it took effect (glibc only).
    """
    if not enable:
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        ok = False
    _ALLOCATOR["reuse_freed_memory"] = ok
    return ok


def add_fresh_pages_flag(parser) -> None:
    """``--fresh-pages``: measure with freed buffers returned to the OS (see reuse_freed_memory)."""
    parser.add_argument(
        "--fresh-pages",
        action="store_true",
        help="let freed XLA:CPU buffers go back to the OS (each call then page-faults "
        "its outputs in); by default they are kept for reuse, for every path alike",
    )


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


def memcpy_seconds(nbytes_moved: int, *, cap: int = 128 << 20, repeats: int = 5) -> float:
    """Seconds a plain memcpy takes to move ``nbytes_moved`` bytes (read + write): ``numpy.copyto``
    between two preallocated, already-touched host buffers of ``nbytes_moved / 2`` bytes, best
    of ``repeats``; above ``cap`` bytes per buffer the time of ``cap`` is scaled linearly.

    It is the copy floor of the benchmarks: the time the bytes a kernel must read and write
    would take at the rate this machine copies memory, measured in the same run (one thread,
    no XLA in between)."""
    half = max(1, nbytes_moved // 2)
    n = min(half, cap)
    src = np.ones(n, np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # touch both buffers first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best * half / n


def cpu_model() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo), or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def environment() -> dict:
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "reuse_freed_memory": _ALLOCATOR["reuse_freed_memory"],
    }


class Memcpy:
    """A plain memcpy between two preallocated host buffers of ``nbytes`` (numpy ``copyto`` of
    contiguous bytes, one thread): the memory-speed floor the CPU benchmarks compare against,
    measured in the same process as the path it is compared with.

    A jitted XLA copy is not such a floor: XLA:CPU's elementwise loops run below memory speed.
    ``rate()`` counts read + written bytes (2 * nbytes) per second.
    """

    def __init__(self, nbytes: int = 64 << 20):
        import numpy as np

        self.nbytes = int(nbytes)
        self._src = np.ones(self.nbytes, np.uint8)  # touched: no page faults while timing
        self._dst = np.zeros(self.nbytes, np.uint8)

    def seconds(self, iters: int = 10, warm: bool = True) -> float:
        """Median seconds of one copy."""
        import numpy as np

        if warm:
            np.copyto(self._dst, self._src)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            np.copyto(self._dst, self._src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def rate(self, iters: int = 10) -> float:
        """Read + write bytes per second."""
        return 2 * self.nbytes / self.seconds(iters)


def interleaved_ratios(fn: Callable, args: Sequence, moved_bytes: int, memcpy: Memcpy, repeats: int, iters: int):
    """Times ``fn(*args)`` and the memcpy call by call in turn, ``repeats`` rounds of ``iters``
    pairs (a shared, noisy machine drifts: a ratio within one round compares like with like).

    Returns (median kernel seconds, median memcpy rate, the per-round ratios of the kernel's
    bytes-moved rate to the memcpy rate, sorted)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    memcpy.seconds(1)
    ts, rates, ratios = [], [], []
    for _ in range(max(1, repeats)):
        tk, tm = [], []
        for _ in range(iters):
            tm.append(memcpy.seconds(1, warm=False))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            tk.append(time.perf_counter() - t0)
        t, rate = statistics.median(tk), 2 * memcpy.nbytes / statistics.median(tm)
        ts.append(t)
        rates.append(rate)
        ratios.append(moved_bytes / t / rate)
    return statistics.median(ts), statistics.median(rates), sorted(ratios)
