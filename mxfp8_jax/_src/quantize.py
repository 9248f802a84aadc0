"""``quantize`` / ``dequantize``: argument checks and backend choice over the reference and FFI.

Backends: ``"jax"`` is the pure-JAX reference (``format``), always available; ``"ffi"`` is the
compiled kernel and raises if it is not installed for the platform; ``"auto"`` picks the kernel
per lowering platform where the installed extension has one, and the reference elsewhere
(``lax.platform_dependent``), so one jitted function serves CPU and GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from mxfp8_jax._src import _ffi
from mxfp8_jax._src import format as fmt
from mxfp8_jax._src.tensor import MXFP8Tensor

BACKENDS = ("auto", "ffi", "jax")
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_input(x, *, rowwise: bool, columnwise: bool, argname: str = "x") -> tuple[int, int]:
    """Validates a quantize input; returns its 2-D view ``(M, K)``."""
    dt = jnp.dtype(getattr(x, "dtype", None))
    if dt not in [jnp.dtype(d) for d in INPUT_DTYPES]:
        raise TypeError(
            f"{argname} has dtype {dt}; MXFP8 quantize takes bfloat16, float16 or float32 input"
        )
    if x.ndim < 2:
        raise ValueError(
            f"{argname} has shape {tuple(x.shape)}; MXFP8 quantize needs at least 2-D input "
            f"(N-D input is quantized as its [prod(leading axes), K] view)"
        )
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise=True or columnwise=True is required")
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if k % fmt.BLOCK:
        raise ValueError(
            f"{argname}: K={k} (last axis) must be a multiple of 32 for MXFP8 blocks"
        )
    if columnwise and m % fmt.BLOCK:
        raise ValueError(
            f"{argname}: M={m} (product of the leading axes) must be a multiple of 32 for "
            f"MXFP8 columnwise blocks; pass columnwise=False for a rowwise-only tensor"
        )
    return m, k


def quantize(
    x: jax.Array,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    scale_rule: str = "rceil",
    backend: str = "auto",
) -> MXFP8Tensor:
    """Quantizes ``x`` (bf16/fp16/fp32, ``[..., K]``) to MXFP8.

    Rowwise blocks run along the last axis, columnwise blocks along the rows of the 2-D view
    ``[M, K]`` with ``M = prod(shape[:-1])``. Returns an ``MXFP8Tensor`` holding the requested
    planes; ``shape`` and ``dtype`` record the input.
    """
    # the dtype is checked before jnp.asarray, which would turn float64 into float32 silently
    check_input(x if hasattr(x, "dtype") else jnp.asarray(x), rowwise=rowwise, columnwise=columnwise)
    x = jnp.asarray(x)
    m, k = check_input(x, rowwise=rowwise, columnwise=columnwise)
    rule = fmt.ScaleRule.parse(scale_rule)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "ffi":
        _ffi.require("mxfp8_quantize", _ffi.default_platform())
    rq, rs, cq, cs = _planes(x.reshape(m, k), rowwise=rowwise, columnwise=columnwise, rule=rule, backend=backend)
    return MXFP8Tensor(rq, rs, cq, cs, shape=tuple(x.shape), dtype=x.dtype)


# Compiled once per configuration and shape: an eager call (a notebook cell) runs one executable
# instead of dispatching the reference's few dozen operations one by one; under an outer jit
# it is inlined like any nested jit.
@functools.partial(jax.jit, static_argnames=("rowwise", "columnwise", "rule", "backend"))
def _planes(x2d, *, rowwise: bool, columnwise: bool, rule: fmt.ScaleRule, backend: str):
    def reference(x2d):
        row = fmt.quantize_rowwise(x2d, rule) if rowwise else (None, None)
        col = fmt.quantize_columnwise(x2d, rule) if columnwise else (None, None)
        return row + col

    def kernel(x2d):
        (rq, rs), (cq, cs) = _ffi.quantize(x2d, scale_rule=rule.code, rowwise=rowwise, columnwise=columnwise)
        return rq, rs, cq, cs

    if backend == "jax":
        return reference(x2d)
    if backend == "ffi":
        return kernel(x2d)
    return _ffi.platform_dispatch("mxfp8_quantize", kernel, reference, x2d)


def dequantize(t: MXFP8Tensor, *, columnwise: bool = False, dtype=jnp.bfloat16) -> jax.Array:
    """``fp32(q) * 2^(byte - 127)`` of the rowwise (default) or columnwise plane, as ``dtype``.

    Exact in fp32 (subnormal results included); bf16 output is rounded to nearest even.
    """
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"t must be an MXFP8Tensor, got {type(t).__name__}")
    m, k = t.matrix_shape
    if columnwise:
        if t.columnwise_data is None:
            raise ValueError("t holds no columnwise plane (columnwise=True)")
        data, scale, axis = t.columnwise_data, t.columnwise_scale, 0
    else:
        if t.rowwise_data is None:
            raise ValueError("t holds no rowwise plane (pass columnwise=True for the other one)")
        data, scale, axis = t.rowwise_data, t.rowwise_scale, 1
    # Eager calls run one cached executable; traced calls are inlined as plain operations: a
    # nested jit would let autodiff of a scan hoist its constants out of the loop as full-size
    # buffers (one per constant, the size of the tensor).
    fn = _dequantize if isinstance(data, jax.core.Tracer) else _dequantize_jit
    return fn(data, scale, axis=axis, dtype=jnp.dtype(dtype)).reshape(t.shape)


def _dequantize(data, scale, *, axis: int, dtype):
    bits = fmt.scaled_to_bits(data, jnp.repeat(scale, fmt.BLOCK, axis=axis))
    return fmt.f32_bits_to(bits, dtype)


_dequantize_jit = jax.jit(_dequantize, static_argnames=("axis", "dtype"))
