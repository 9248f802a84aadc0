"""The MXFP8Tensor pytree, plane updates, and TE's physical scale padding/swizzle (docs/design.md
§2); MXFP8Tensor2D, one plane of 32x32 blocks serving both directions.

Planes (each possibly ``None``):

- ``rowwise_data``     float8_e4m3fn [M, K]     blocks of 32 along K
- ``rowwise_scale``    uint8 [M, K/32]          E8M0 bytes
- ``columnwise_data``  float8_e4m3fn [M, K]     blocks of 32 along M (same shape, not transposed)
- ``columnwise_scale`` uint8 [M/32, K]

An N-D tensor ``[..., K]`` is stored as its 2-D view with every leading axis flattened into
rows, ``M = prod(shape[:-1])``; ``shape`` keeps the logical shape for dequantization.
Scales are stored compact and unswizzled; TE padding and the cuBLAS 128x4 swizzle are applied
just before use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.typing import DTypeLike

from mxfp8_jax._src.core.tracing import is_traced
from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.numerics.format import BLOCK


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Tensor:
    """An MXFP8-quantized tensor: up to two planes of E4M3 data with E8M0 block scales.

    Invariants (checked by ``validate``): a plane's data and scale are both present or both
    absent; data is ``float8_e4m3fn [M, K]``; scales are ``uint8`` of shape ``[M, K/32]``
    (rowwise) or ``[M/32, K]`` (columnwise), with ``M = prod(shape[:-1])`` and ``K = shape[-1]``.
    """

    rowwise_data: jax.Array | None
    rowwise_scale: jax.Array | None
    columnwise_data: jax.Array | None
    columnwise_scale: jax.Array | None
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))

    # -- structure ---------------------------------------------------------------------------

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D view ``(M, K)`` that the planes use."""
        return math.prod(self.shape[:-1]), self.shape[-1]

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def planes(self) -> tuple[str, ...]:
        """Names of the planes this tensor holds: a subset of ('rowwise', 'columnwise')."""
        return tuple(n for n, h in (("rowwise", self.has_rowwise), ("columnwise", self.has_columnwise)) if h)

    def validate(self) -> MXFP8Tensor:
        """Checks the class invariants; returns self. Works on tracers (shapes are static).

        Returns:
          ``self``, unchanged; a broken invariant raises ValueError.
        """
        m, k = self.matrix_shape
        specs = {
            "rowwise": (self.rowwise_data, self.rowwise_scale, (m, k // BLOCK)),
            "columnwise": (self.columnwise_data, self.columnwise_scale, (m // BLOCK, k)),
        }
        for name, (data, scale, sshape) in specs.items():
            if (data is None) != (scale is None):
                raise ValueError(f"{name} data and scale must both be present or both be None")
            if data is None:
                continue
            if tuple(data.shape) != (m, k) or jnp.dtype(data.dtype) != jnp.float8_e4m3fn:
                raise ValueError(
                    f"{name}_data must be float8_e4m3fn of shape {(m, k)}, got "
                    f"{jnp.dtype(data.dtype)}{tuple(data.shape)}"
                )
            if tuple(scale.shape) != sshape or jnp.dtype(scale.dtype) != jnp.uint8:
                raise ValueError(
                    f"{name}_scale must be uint8 of shape {sshape}, got {jnp.dtype(scale.dtype)}{tuple(scale.shape)}"
                )
        return self

    # -- values ------------------------------------------------------------------------------

    def dequantize(self, *, columnwise: bool = False, dtype: DTypeLike | None = None) -> jax.Array:
        """``fp32(q) * 2^(byte - 127)`` of one plane, as ``dtype`` (default: the nominal dtype),
        in the logical ``shape``.

        Exact in fp32 (subnormal results included); bf16 output is rounded to nearest even.
        Not differentiable in the planes: ``jax.grad``/``jax.jvp`` with respect to the data
        raises a TypeError, for every backend (docs/design.md §2).

        Args:
          columnwise: dequantize the columnwise plane instead of the rowwise one; the chosen plane
            must be present (ValueError otherwise).
          dtype: a floating-point output type (TypeError otherwise); ``None`` (default) gives
            ``self.dtype``.

        Returns:
          An array of ``dtype`` and shape ``self.shape``.
        """
        self.validate()
        dtype = jnp.dtype(self.dtype if dtype is None else dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"dtype={dtype} must be a floating-point type")
        if columnwise:
            if self.columnwise_data is None:
                raise ValueError("this tensor holds no columnwise plane (columnwise=True)")
            data, scale, axis = self.columnwise_data, self.columnwise_scale, 0
        else:
            if self.rowwise_data is None:
                raise ValueError("this tensor holds no rowwise plane (pass columnwise=True for the other one)")
            data, scale, axis = self.rowwise_data, self.rowwise_scale, 1
        # Eager calls run one cached executable; traced calls are inlined as plain operations:
        # a nested jit would let autodiff of a scan hoist its constants out of the loop as
        # full-size buffers (one per constant, the size of the tensor).
        fn = _dequantize if is_traced(data) else _dequantize_jit
        return fn(data, scale, axis=axis, dtype=dtype).reshape(self.shape)

    def scale_e8m0(self, *, columnwise: bool = False) -> jax.Array:
        """A plane's scales as ``float8_e8m0fnu`` (bitcast view of the uint8 bytes).

        Args:
          columnwise: read the columnwise scales instead of the rowwise ones; the chosen plane
            must be present (ValueError otherwise).

        Returns:
          A ``float8_e8m0fnu`` array: ``[M, K/32]`` rowwise or ``[M/32, K]`` columnwise.
        """
        s = self.columnwise_scale if columnwise else self.rowwise_scale
        if s is None:
            raise ValueError(f"this tensor holds no {'columnwise' if columnwise else 'rowwise'} plane")
        return fmt.e8m0_view(s)

    def padded_scales(self, *, swizzle: bool = False) -> tuple[jax.Array | None, jax.Array | None]:
        """(rowwise, columnwise) scales in TE's physical shapes, optionally swizzled for cuBLAS.

        Args:
          swizzle: also put each padded plane in the cuBLAS 128x4 tile order (``swizzle_scale``),
            which flattens it.

        Returns:
          ``(row, col)``: uint8 rowwise ``[ceil128(M), ceil4(K/32)]`` and columnwise
          ``[ceil4(M/32), ceil128(K)]`` scales padded with 0 (1-D when swizzled), ``None`` for an
          absent plane.
        """
        row = None if self.rowwise_scale is None else pad_rowwise_scale(self.rowwise_scale)
        col = None if self.columnwise_scale is None else pad_columnwise_scale(self.columnwise_scale)
        if swizzle:
            row = None if row is None else swizzle_scale(row)
            col = None if col is None else swizzle_scale(col, columnwise=True)
        return row, col

    def padded(self) -> PaddedMXFP8Tensor:
        """The planes as an MXFP8 GEMM takes them: data as is, scales padded (unswizzled).

        Returns:
          A ``PaddedMXFP8Tensor`` with this tensor's data planes and ``shape``, and the scales of
          ``padded_scales()``; absent planes are ``None``.
        """
        row, col = self.padded_scales()
        return PaddedMXFP8Tensor(
            rowwise_data=self.rowwise_data,
            rowwise_scale=row,
            columnwise_data=self.columnwise_data,
            columnwise_scale=col,
            shape=tuple(self.shape),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Tensor2D:
    """An MXFP8 tensor with 2-D blocks: one plane of E4M3 data and one E8M0 scale per 32x32
    tile of its 2-D view ``[M, K]`` (``M = prod(shape[:-1])``, ``K = shape[-1]``, both
    multiples of 32).

    A tile's scale serves both GEMM directions, so one plane does: the rowwise view (1x32
    blocks along K) and the columnwise view (32x1 blocks along M) are this data with the tile's
    byte repeated over its 32 rows or 32 columns (``view``). Both views dequantize to the same
    values.

    Invariants (checked by ``validate``): data ``float8_e4m3fn [M, K]``, scale ``uint8
    [M/32, K/32]``.
    """

    data: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D view ``(M, K)`` that the plane uses."""
        return math.prod(self.shape[:-1]), self.shape[-1]

    def validate(self) -> MXFP8Tensor2D:
        """Checks the class invariants; returns self. Works on tracers (shapes are static).

        Returns:
          ``self``, unchanged; a broken invariant raises ValueError.
        """
        m, k = self.matrix_shape
        if m % BLOCK or k % BLOCK:
            raise ValueError(f"shape {tuple(self.shape)}: a 32x32-block tensor needs M={m} and K={k} multiples of 32")
        if tuple(self.data.shape) != (m, k) or jnp.dtype(self.data.dtype) != jnp.float8_e4m3fn:
            got = f"{jnp.dtype(self.data.dtype)}{tuple(self.data.shape)}"
            raise ValueError(f"data must be float8_e4m3fn of shape {(m, k)}, got {got}")
        sshape = (m // BLOCK, k // BLOCK)
        if tuple(self.scale.shape) != sshape or jnp.dtype(self.scale.dtype) != jnp.uint8:
            raise ValueError(
                f"scale must be uint8 of shape {sshape}, got {jnp.dtype(self.scale.dtype)}{tuple(self.scale.shape)}"
            )
        return self

    def view(self, *, rowwise: bool = True, columnwise: bool = True) -> MXFP8Tensor:
        """The 1x32 tensor with these values: the plane as the rowwise and/or columnwise data,
        each with the tile scales repeated to that plane's shape.

        Args:
          rowwise: include the rowwise view (blocks of 32 along K).
          columnwise: include the columnwise view (blocks of 32 along M).

        Returns:
          An ``MXFP8Tensor`` of the same ``shape`` and ``dtype`` holding the chosen planes (the
          data array shared by both); at least one must be chosen (ValueError otherwise).
        """
        self.validate()
        if not (rowwise or columnwise):
            raise ValueError("at least one of rowwise=True or columnwise=True is required")
        row = (self.data, fmt.tile_scales(self.scale, columnwise=False)) if rowwise else (None, None)
        col = (self.data, fmt.tile_scales(self.scale, columnwise=True)) if columnwise else (None, None)
        return MXFP8Tensor(*row, *col, shape=tuple(self.shape), dtype=self.dtype)

    def dequantize(self, *, dtype: DTypeLike | None = None) -> jax.Array:
        """``fp32(q) * 2^(byte - 127)`` of the plane with its tile's byte, as ``dtype``, in the
        logical ``shape`` (exact in fp32; bf16 rounded to nearest even; not differentiable).

        Args:
          dtype: a floating-point output type (TypeError otherwise); ``None`` gives
            ``self.dtype``.

        Returns:
          An array of ``dtype`` and shape ``self.shape``.
        """
        return self.view(columnwise=False).dequantize(dtype=dtype)


def _dequantize(data, scale, *, axis: int, dtype):
    return _dequantize_planes(data, scale, axis, dtype)


_dequantize_jit = jax.jit(_dequantize, static_argnames=("axis", "dtype"))


# ------------------------------------------------------------------------------------------------
# gradients: MXFP8 planes carry none (docs/design.md §2)


def not_differentiable(what: str) -> TypeError:
    """The error of ``jax.grad``/``jax.jvp`` through ``what`` (``mx.quantize``, ``mx.dequantize``)."""
    return TypeError(
        f"{what} is not differentiable: MXFP8 rounding has a zero derivative almost everywhere, "
        f"and an E4M3 plane cannot carry a gradient faithfully (its cotangent would keep 3 "
        f"mantissa bits), so no backend defines one (docs/design.md §2). Quantize a constant, "
        f"mx.quantize(jax.lax.stop_gradient(x)); a straight-through estimator is "
        f"x + jax.lax.stop_gradient(mx.dequantize(mx.quantize(jax.lax.stop_gradient(x))) - x); "
        f"or give the surrounding op its own jax.custom_vjp"
    )


def carries_tangent(t) -> bool:
    """Whether a custom_jvp tangent (``symbolic_zeros=True``) can be non-zero."""
    return type(t) is not SymbolicZero and jnp.dtype(t.dtype) != jax.dtypes.float0


def zero_tangent(x):
    """The zero tangent of ``x``: zeros of its dtype, or float0 for integer arrays."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _dequantize_planes(data, scale, axis: int, dtype):
    bits = fmt.scaled_to_bits(data, jnp.repeat(scale, BLOCK, axis=axis))
    return fmt.f32_bits_to(bits, dtype)


@functools.partial(_dequantize_planes.defjvp, symbolic_zeros=True)
def _dequantize_planes_jvp(axis, dtype, primals, tangents):
    if carries_tangent(tangents[0]):
        raise not_differentiable("mx.dequantize")
    out = _dequantize_planes(*primals, axis, dtype)
    return out, zero_tangent(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PaddedMXFP8Tensor:
    """One tensor's planes in the physical shapes of an MXFP8 GEMM (cuBLAS, Transformer Engine):
    data ``[M, K]`` e4m3 as in ``MXFP8Tensor``, scales padded to rowwise
    ``[ceil128(M), ceil4(K/32)]`` and columnwise ``[ceil4(M/32), ceil128(K)]`` with 0 bytes,
    unswizzled (``swizzle_scale`` gives the 128x4 tile order). Absent planes are None."""

    rowwise_data: jax.Array | None
    rowwise_scale: jax.Array | None
    columnwise_data: jax.Array | None
    columnwise_scale: jax.Array | None
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def update_mxfp8_tensor(
    src: MXFP8Tensor, dst: MXFP8Tensor, *, rowwise: bool = True, columnwise: bool = True
) -> MXFP8Tensor:
    """``dst`` with its selected planes taken from ``src``.

    Planes of the direction not selected keep what ``dst`` has; a selected plane absent from
    ``src`` is cleared (``None``) in the result. Neither argument is modified (pytrees are
    immutable); the result is a new tensor.

    Args:
      src: the tensor the selected planes come from; its ``shape`` must equal ``dst.shape``
        (ValueError otherwise).
      dst: the tensor the other planes, ``shape`` and ``dtype`` come from.
      rowwise, columnwise: take that direction's data and scale planes from ``src``.

    Returns:
      A new ``MXFP8Tensor``: ``dst`` with the selected planes replaced.
    """
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"src.shape {src.shape} must equal dst.shape {dst.shape}")
    changes = {}
    if rowwise:
        changes.update(rowwise_data=src.rowwise_data, rowwise_scale=src.rowwise_scale)
    if columnwise:
        changes.update(columnwise_data=src.columnwise_data, columnwise_scale=src.columnwise_scale)
    return dataclasses.replace(dst, **changes)


# ------------------------------------------------------------------------------------------------
# TE physical scale shapes and the cuBLAS swizzle


def pad_rowwise_scale(s: jax.Array) -> jax.Array:
    """Compact rowwise scales ``[M, K/32]`` -> TE's ``[ceil128(M), ceil4(K/32)]``, padding 0.

    Args:
      s: a 2-D uint8 scale plane ``[M, K/32]`` (ValueError if not 2-D, TypeError if not uint8).

    Returns:
      A uint8 ``[ceil128(M), ceil4(K/32)]`` array: ``s`` at the top left, 0 bytes after it.
    """
    _check_scale(s, "s")
    r, c = s.shape
    return jnp.pad(s, ((0, _ceil(r, 128) - r), (0, _ceil(c, 4) - c)))


def pad_columnwise_scale(s: jax.Array) -> jax.Array:
    """Compact columnwise scales ``[M/32, K]`` -> TE's ``[ceil4(M/32), ceil128(K)]``, padding 0.

    Args:
      s: a 2-D uint8 scale plane ``[M/32, K]`` (ValueError if not 2-D, TypeError if not uint8).

    Returns:
      A uint8 ``[ceil4(M/32), ceil128(K)]`` array: ``s`` at the top left, 0 bytes after it.
    """
    _check_scale(s, "s")
    r, c = s.shape
    return jnp.pad(s, ((0, _ceil(r, 4) - r), (0, _ceil(c, 128) - c)))


def swizzle_scale(s_padded: jax.Array, *, columnwise: bool = False) -> jax.Array:
    """cuBLAS 128x4 tile order of a padded scale plane, flattened.

    Rowwise: applied to the padded ``[R, C]`` plane. Columnwise: applied to the transpose of the
    padded ``[C', R']`` plane. ``s.reshape(R//128, 4, 32, C//4, 4).transpose(0, 3, 2, 1, 4)``.

    Args:
      s_padded: a padded 2-D uint8 scale plane (``pad_rowwise_scale``/``pad_columnwise_scale``);
        the view swizzled (``s_padded``, or its transpose when ``columnwise``) needs rows a
        multiple of 128 and columns a multiple of 4 (ValueError otherwise).
      columnwise: swizzle the transpose (a columnwise plane) instead of ``s_padded`` itself.

    Returns:
      A 1-D uint8 array of ``s_padded.size`` bytes in tile order.
    """
    _check_scale(s_padded, "s_padded")
    s = s_padded.T if columnwise else s_padded
    r, c = s.shape
    if r % 128 or c % 4:
        raise ValueError(
            f"s_padded has shape {tuple(s_padded.shape)}; the swizzle needs the TE-padded plane "
            f"(rows a multiple of 128 and columns a multiple of 4 in the "
            f"{'transposed columnwise' if columnwise else 'rowwise'} view): pad it first"
        )
    return s.reshape(r // 128, 4, 32, c // 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1)


def _check_scale(s, name: str) -> None:
    if getattr(s, "ndim", None) != 2:
        raise ValueError(f"{name} must be a 2-D scale plane, got shape {getattr(s, 'shape', None)}")
    if jnp.dtype(s.dtype) != jnp.uint8:
        raise TypeError(f"{name} must be uint8 E8M0 bytes, got {jnp.dtype(s.dtype)}")
