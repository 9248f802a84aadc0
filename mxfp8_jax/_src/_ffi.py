"""Loads the compiled XLA FFI extension(s) and registers their targets with jax.

The extension is optional: without it the package imports, says so once, and only the pure-JAX
paths (``backend="jax"``) work. Each platform lives in its own module (``_mxfp8_cpu``,
``_mxfp8_cuda``, ``_mxfp8_rocm``) so that a GPU part that cannot load on this machine (no driver,
no ROCm runtime) never stops the CPU part from loading.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import jax
import numpy as np

# platform name as jax spells it for register_ffi_target -> extension module
_MODULES = {"cpu": "_mxfp8_cpu", "cuda": "_mxfp8_cuda", "rocm": "_mxfp8_rocm"}
_FFI_PLATFORM = {"cpu": "cpu", "cuda": "CUDA", "rocm": "ROCM"}


class ExtensionMissingError(RuntimeError):
    """The compiled extension (or the platform part a call needs) is not installed."""


@functools.cache
def _load() -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Imports every platform module present; returns (targets per backend, load errors)."""
    loaded: dict[str, dict[str, object]] = {}
    errors: dict[str, str] = {}
    for backend, module in _MODULES.items():
        try:
            mod = importlib.import_module(f"mxfp8_jax.{module}")
        except ImportError as e:  # not built, or its runtime library is absent
            errors[backend] = str(e)
            continue
        regs = mod.registrations()
        for name, capsule in regs.items():
            jax.ffi.register_ffi_target(name, capsule, platform=_FFI_PLATFORM[backend])
        loaded[backend] = dict(regs)
    if "cpu" not in loaded:
        warnings.warn(
            "mxfp8_jax: the compiled extension is not installed "
            f"({errors.get('cpu', 'unknown reason')}); only backend='jax' is available. "
            "Reinstall with `pip install .` to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
    return loaded, errors


def available_backends() -> tuple[str, ...]:
    """Platforms whose handlers the installed extension carries, e.g. ``('cpu', 'cuda')``."""
    return tuple(_load()[0])


def has_target(name: str, platform: str = "cpu") -> bool:
    return name in _load()[0].get(platform, {})


def require(name: str, platform: str) -> None:
    """Raises a clear error when target ``name`` has no handler for ``platform``."""
    loaded, errors = _load()
    if name in loaded.get(platform, {}):
        return
    why = errors.get(platform, f"the {platform} part does not provide {name!r}")
    raise ExtensionMissingError(
        f"backend='ffi' needs the compiled mxfp8_jax extension for platform {platform!r}, "
        f"which is not available ({why}). Use backend='jax' for the pure-JAX path."
    )


def default_platform() -> str:
    return jax.default_backend()


# ------------------------------------------------------------------------------------------------
# thin ffi_call wrappers (validation and policy live in the callers)

import jax.numpy as jnp  # noqa: E402

_EMPTY = jax.ShapeDtypeStruct((0,), jnp.uint8)


def quantize(x2d: jax.Array, *, scale_rule: int, rowwise: bool, columnwise: bool):
    """``mxfp8_quantize``: (row_q, row_s, col_q, col_s) as uint8; unrequested planes are None."""
    m, k = x2d.shape
    u8 = jnp.uint8
    shapes = (
        jax.ShapeDtypeStruct((m, k), u8) if rowwise else _EMPTY,
        jax.ShapeDtypeStruct((m, k // 32), u8) if rowwise else _EMPTY,
        jax.ShapeDtypeStruct((m, k), u8) if columnwise else _EMPTY,
        jax.ShapeDtypeStruct((m // 32, k), u8) if columnwise else _EMPTY,
    )
    out = jax.ffi.ffi_call("mxfp8_quantize", shapes, vmap_method="broadcast_all")(
        x2d,
        scale_rule=np.int32(scale_rule),
        rowwise=np.bool_(rowwise),
        columnwise=np.bool_(columnwise),
    )
    rq, rs, cq, cs = out
    return (rq, rs) if rowwise else (None, None), (cq, cs) if columnwise else (None, None)


def platform_dispatch(target: str, kernel, reference, *args):
    """``kernel`` on every platform whose handler for ``target`` is installed, else ``reference``.

    Chosen per lowering platform (``lax.platform_dependent``), so a function lowered for several
    platforms picks correctly on each.
    """
    loaded, _ = _load()
    branches = {p: kernel for p, regs in loaded.items() if target in regs}
    if not branches:
        return reference(*args)
    return jax.lax.platform_dependent(*args, default=reference, **branches)


def quantize_segments(
    x: jax.Array, desc: jax.Array, *, scale_rule: int, rowwise: bool, columnwise: bool
):
    """``mxfp8_quantize_segments``: the planes of one packed flat segment ``x [S]``.

    ``desc [P, 3]`` rows ``(offset, rows, row_len)`` say where each tensor piece sits (int64, or
    int32 when jax runs without x64).
    Returns ``(row_q [S], row_s [S/32]), (col_q [S], col_s [S/32])`` as uint8; unrequested
    planes are None.
    """
    (s,) = x.shape
    u8 = jnp.uint8
    data, scale = jax.ShapeDtypeStruct((s,), u8), jax.ShapeDtypeStruct((s // 32,), u8)
    shapes = (
        data if rowwise else _EMPTY,
        scale if rowwise else _EMPTY,
        data if columnwise else _EMPTY,
        scale if columnwise else _EMPTY,
    )
    rq, rs, cq, cs = jax.ffi.ffi_call("mxfp8_quantize_segments", shapes)(
        x,
        desc,
        scale_rule=np.int32(scale_rule),
        rowwise=np.bool_(rowwise),
        columnwise=np.bool_(columnwise),
    )
    return (rq, rs) if rowwise else (None, None), (cq, cs) if columnwise else (None, None)
