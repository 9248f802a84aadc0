"""The instruction set the CPU kernels run with: query and choose it (process-wide).

The CPU extension carries baseline x86-64, AVX2 and AVX-512 builds of its band loops and picks
the best the CPU supports; every build gives the same bytes (tests/test_cpu_isa.py runs each
against the oracle). Choosing a lower one is for comparisons and tests.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from mxfp8_jax._src.kernels._ffi import require


def _cpu_module():
    require("mxfp8_quantize", "cpu")  # the CPU extension is installed
    return importlib.import_module("mxfp8_jax._mxfp8_cpu")


def cpu_isa() -> str:
    """The instruction set the CPU kernels run: ``'avx512'``, ``'avx2'`` or ``'baseline'``. By
    default the best this CPU supports; every path gives the same bytes.

    Returns:
      The current choice: ``'avx512'``, ``'avx2'`` or ``'baseline'``.
    """
    return _cpu_module().isa()


def cpu_isas() -> tuple[str, ...]:
    """The instruction sets this CPU can run the kernels with, lowest first.

    Returns:
      The names from ``'baseline'`` up to the best this CPU supports, e.g.
      ``('baseline', 'avx2', 'avx512')``.
    """
    return tuple(_cpu_module().isas())


def set_cpu_isa(isa: str) -> None:
    """Runs the CPU kernels with ``isa`` from the next call on (compiled functions included: the
    kernel reads the choice each time it runs). For comparisons; see :func:`use_cpu_isa`.

    Args:
      isa: ``'baseline'``, ``'avx2'`` or ``'avx512'``, one of :func:`cpu_isas`; another name, or a
        set this CPU does not support, raises a ValueError.
    """
    _cpu_module().set_isa(isa)


@contextlib.contextmanager
def use_cpu_isa(isa: str) -> Iterator[None]:
    """Context manager: the CPU kernels run with ``isa`` inside, and with the previous choice
    again after. The choice is process-wide, not per thread.

    Args:
      isa: the instruction set to run with inside, as :func:`set_cpu_isa` takes it.

    Returns:
      A context manager that yields ``None``.
    """
    before = cpu_isa()
    set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(before)
