"""Loads the compiled XLA FFI extension(s) and registers their targets with jax.

The extension is optional: without it the package imports, says so once, and only the pure-JAX
paths (``backend="jax"``) work. Each platform lives in its own module (``_mxfp8_cpu``,
``_mxfp8_cuda``, ``_mxfp8_rocm``) so that a GPU part that cannot load on this machine (no driver,
no ROCm runtime) never stops the CPU part from loading.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings

import jax
import numpy as np

from mxfp8_jax._src import vma

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
        f"{name} needs the compiled mxfp8_jax extension for platform {platform!r}, which is not "
        f"available ({why}). Use backend='jax' for the pure-JAX path."
    )


def default_platform() -> str:
    return jax.default_backend()


def extension_platform(platform: str) -> str:
    """The extension's platform name (``'cpu'``, ``'cuda'``, ``'rocm'``) for a jax platform name:
    jax calls CUDA and ROCm devices alike ``'gpu'``."""
    if platform == "gpu":
        return gpu_platform() or "cuda"
    return platform


def gpu_platform() -> str | None:
    """'cuda' or 'rocm' when jax's default device is a GPU, else None."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform not in ("gpu", "cuda", "rocm"):
        return None
    version = str(getattr(dev.client, "platform_version", "")).lower()
    return "rocm" if ("rocm" in version or "hip" in version) else "cuda"


# ------------------------------------------------------------------------------------------------
# the CPU kernels' instruction set


def _cpu_module():
    require("mxfp8_quantize", "cpu")
    return importlib.import_module("mxfp8_jax._mxfp8_cpu")


def cpu_isa() -> str:
    """The instruction set the CPU kernels run: ``'avx512'``, ``'avx2'`` or ``'baseline'``. By
    default the best this CPU supports; every path gives the same bytes."""
    return _cpu_module().isa()


def cpu_isas() -> tuple[str, ...]:
    """The instruction sets this CPU can run the kernels with, lowest first."""
    return tuple(_cpu_module().isas())


def set_cpu_isa(isa: str) -> None:
    """Runs the CPU kernels with ``isa`` from the next call on (compiled functions included: the
    kernel reads the choice each time it runs). For comparisons; see :func:`use_cpu_isa`."""
    _cpu_module().set_isa(isa)


@contextlib.contextmanager
def use_cpu_isa(isa: str):
    """Context manager: the CPU kernels run with ``isa`` inside, and with the previous choice
    again after. The choice is process-wide, not per thread."""
    before = cpu_isa()
    set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(before)


# ------------------------------------------------------------------------------------------------
# thin ffi_call wrappers (validation and policy live in the callers)

import jax.numpy as jnp  # noqa: E402

_EMPTY = jax.ShapeDtypeStruct((0,), jnp.uint8)


def quantize(x2d: jax.Array, *, scale_rule: int, rowwise: bool, columnwise: bool):
    """``mxfp8_quantize``: (row_q, row_s, col_q, col_s); codes as float8_e4m3fn, scales as
    uint8; unrequested planes are None.

    The kernel writes E4M3 codes straight into float8_e4m3fn results: a uint8 result bitcast
    afterwards is a separate pass over the plane on XLA:CPU (a loop fusion, not a free view).
    """
    m, k = x2d.shape
    u8, e4m3 = jnp.uint8, jnp.float8_e4m3fn
    shapes = (
        jax.ShapeDtypeStruct((m, k), e4m3) if rowwise else _EMPTY,
        jax.ShapeDtypeStruct((m, k // 32), u8) if rowwise else _EMPTY,
        jax.ShapeDtypeStruct((m, k), e4m3) if columnwise else _EMPTY,
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
    if not any(target in regs for regs in loaded.values()):
        return reference(*args)
    # Under shard_map(check_vma=True) both branches must give the same types: each result is
    # typed as varying along every axis its inputs vary along.
    axes = vma.union(*args)
    kernel_, reference_ = (lambda *a: vma.vary_tree(kernel(*a), axes)), (lambda *a: vma.vary_tree(reference(*a), axes))
    branches = {p: kernel_ for p, regs in loaded.items() if target in regs}
    return jax.lax.platform_dependent(*args, default=reference_, **branches)


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


def _norm_shapes(r: int, h: int, columnwise: bool):
    u8, e4m3 = jnp.uint8, jnp.float8_e4m3fn  # codes as E4M3 (see quantize), scales as bytes
    return (
        jax.ShapeDtypeStruct((r, h), jnp.bfloat16),
        jax.ShapeDtypeStruct((r, h), e4m3),
        jax.ShapeDtypeStruct((r, h // 32), u8),
        jax.ShapeDtypeStruct((r, h), e4m3) if columnwise else _EMPTY,
        jax.ShapeDtypeStruct((r // 32, h), u8) if columnwise else _EMPTY,
    )


def _norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule):
    return dict(
        eps=np.float32(eps),
        weight_offset=np.float32(weight_offset),
        quantize_from_fp32=np.bool_(quantize_from_fp32),
        columnwise=np.bool_(columnwise),
        scale_rule=np.int32(scale_rule),
    )


def rmsnorm_quantize(
    x: jax.Array, gamma: jax.Array, *, eps: float, weight_offset: float,
    quantize_from_fp32: bool, columnwise: bool, scale_rule: int,
):
    """``mxfp8_rmsnorm_quantize``: ``x [R, H]`` bf16, ``gamma [H]`` bf16 ->
    ``(normed, row_q, row_s, col_q, col_s)`` (uint8 planes; the columnwise ones None unless asked).
    """
    r, h = x.shape
    normed, rq, rs, cq, cs = jax.ffi.ffi_call(
        "mxfp8_rmsnorm_quantize", _norm_shapes(r, h, columnwise), vmap_method="sequential"
    )(x, gamma, **_norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule))
    return normed, rq, rs, (cq if columnwise else None), (cs if columnwise else None)


def allgather_rmsnorm_quantize(
    x: jax.Array, gamma: jax.Array, where: jax.Array, *, rows: int, op_id: int,
    group_size: int, row_counts: tuple[int, ...], eps: float, weight_offset: float,
    quantize_from_fp32: bool, columnwise: bool, scale_rule: int, timeout_ms: int,
):
    """``mxfp8_allgather_rmsnorm_quantize`` (one device's call; see xla_ffi/cpu/allgather.cc,
    and xla_ffi/cuda/handlers.cc for the experimental GPU handler):
    ``x [rows_max, H]``, ``gamma [H]`` bf16, ``where = (rank, group, rendezvous id)`` int32 ->
    ``(normed, row_q, row_s, col_q, col_s, residual)`` for the group's ``rows`` gathered rows.
    """
    h = x.shape[1]
    shapes = _norm_shapes(rows, h, columnwise) + (jax.ShapeDtypeStruct((rows, h), jnp.bfloat16),)
    normed, rq, rs, cq, cs, residual = jax.ffi.ffi_call(
        "mxfp8_allgather_rmsnorm_quantize", shapes
    )(
        x, gamma, where,
        op_id=np.int64(op_id),
        group_size=np.int64(group_size),
        row_counts=np.asarray(row_counts, dtype=np.int64),
        timeout_ms=np.int64(timeout_ms),
        **_norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule),
    )
    return normed, rq, rs, (cq if columnwise else None), (cs if columnwise else None), residual
