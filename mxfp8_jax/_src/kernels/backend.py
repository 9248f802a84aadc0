"""Which implementation of an op runs: the pure-JAX reference or a compiled kernel.

``backend`` is one of ``BACKENDS``: ``"jax"`` runs the reference (always available); ``"ffi"``
runs the kernel and raises ``ExtensionMissingError`` when the installed extension has none for
the platform; ``"auto"`` takes the kernel on every lowering platform that has one and the
reference elsewhere (``lax.platform_dependent``), so one jitted function serves CPU and GPU.
Every op chooses through ``run``; the extension check happens there, when the op is traced.
"""

from __future__ import annotations

from collections.abc import Callable

from mxfp8_jax._src.kernels import _ffi

BACKENDS = ("auto", "ffi", "jax")


def check(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return backend


def run(target: str, backend: str, kernel: Callable, reference: Callable, *args):
    """``kernel(*args)`` or ``reference(*args)`` as ``backend`` says, for FFI target ``target``."""
    if backend == "jax":
        return reference(*args)
    if backend == "ffi":
        _ffi.require(target, _ffi.default_platform())
        return kernel(*args)
    return _ffi.platform_dispatch(target, kernel, reference, *args)
