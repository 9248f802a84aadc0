"""Transformer Engine interop: ``MXFP8Tensor`` <-> TE JAX's ``ScaledTensor2x`` / ``ScaledTensor1x``.

TE is an optional extra (``pip install 'mxfp8-jax[te]'``, CUDA hosts); it is imported only when
a conversion is asked for, and its absence is reported then, as an ``ImportError``.

What TE JAX (2.20) holds for ``ScalingMode.MXFP8_1D_SCALING``, and so what we hand it:

- ``data``: ``float8_e4m3fn`` with ``data_layout`` ``"N"`` for both planes (``"NN"``): the
  columnwise data has the same shape as the rowwise data, not transposed -- exactly our planes.
- ``scale_inv``: ``float8_e8m0fnu`` holding the same E8M0 bytes as our ``uint8`` scales (a
  bitcast), COMPACT: ``ScaledTensor1x`` checks that its scales have the unpadded shape
  (``get_scale_shape(..., is_padded=False)``). TE pads them (bytes 0x00, i.e. 2^-127) to
  ``[ceil128(M), ceil4(K/32)]`` / ``[ceil4(M/32), ceil128(K)]`` and swizzles them only inside
  its GEMM, as ``pad_rowwise_scale`` / ``pad_columnwise_scale`` / ``swizzle_scale`` do here.
- shapes: TE keeps the logical N-D shape and a ``flatten_axis`` (rows = product of the axes
  before it). We use ``flatten_axis = ndim - 1``, which is our ``[M, K]`` view. The scales are
  then ``[*lead, K/32]`` (rowwise) and ``[*lead[:-1], lead[-1]/32, K]`` (columnwise), so for an
  N-D tensor with a columnwise plane TE needs ``shape[-2] % 32 == 0``; ``flatten=True`` hands
  TE the 2-D view ``[M, K]`` instead, which always works.

Both directions only reshape and bitcast: round trips are exact, and both work under ``jit``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.numerics.format import BLOCK
from mxfp8_jax._src.numerics.tensor import MXFP8Tensor, MXFP8Tensor2D


def _te_quantize():
    """TE JAX's ``quantize`` package, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("transformer_engine.jax.quantize")
    # TE's package __init__ files load CUDA libraries; where that fails they raise ImportError,
    # RuntimeError, FileNotFoundError or AssertionError. All mean "TE JAX is not usable here".
    except Exception as e:
        raise ImportError(
            "mx.to_te/mx.from_te need Transformer Engine for JAX, the optional [te] extra "
            "(pip install 'mxfp8-jax[te]', on a CUDA host); importing "
            f"transformer_engine.jax.quantize failed with {type(e).__name__}: {e}"
        ) from e


def _te_scale_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """TE's compact (rowwise, columnwise) scale shapes for data ``shape``, flatten_axis = ndim-1."""
    *lead, k = shape
    return (*lead, k // BLOCK), (*lead[:-1], lead[-1] // BLOCK, k)


def to_te(t: MXFP8Tensor, *, dq_dtype: DTypeLike | None = None, flatten: bool = False) -> Any:
    """``t`` as TE JAX's ``ScaledTensor2x`` (both planes) or ``ScaledTensor1x`` (one plane).

    Args:
      t: the tensor; its planes must satisfy ``MXFP8Tensor.validate``.
      dq_dtype: the dtype TE dequantizes to (default ``t.dtype``).
      flatten: give TE the 2-D view ``[M, K]`` rather than the logical shape ``t.shape``.

    Returns:
      A ``ScaledTensor2x`` when ``t`` holds both planes, else a ``ScaledTensor1x`` of the plane it
      holds: scaling mode ``MXFP8_1D_SCALING``, data shape ``t.shape`` (``t.matrix_shape`` with
      ``flatten=True``), ``flatten_axis=-1``.

    The data arrays are reshaped views of ``t``'s planes and the scales are the same bytes as
    ``float8_e8m0fnu``, compact (see the module docstring); nothing is copied or padded.
    """
    if isinstance(t, MXFP8Tensor2D):
        raise TypeError(
            "t is an MXFP8Tensor2D (32x32 blocks): Transformer Engine's 2-D block recipe exists for PyTorch "
            "only, and its JAX API has no 32x32 MXFP8 scaling mode. to_te(t.view()) gives TE the same values "
            "as a 1x32 tensor (each tile's scale repeated over its rows and columns)"
        )
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"t must be an MXFP8Tensor, got {type(t).__name__}")
    t.validate()
    if not t.planes:
        raise ValueError("t holds no plane (rowwise and columnwise are both None)")
    shape = t.matrix_shape if flatten else tuple(t.shape)
    if t.has_columnwise and len(shape) > 2 and shape[-2] % BLOCK:
        raise ValueError(
            f"t.shape={tuple(t.shape)}: TE keeps the N-D shape and puts columnwise blocks along "
            f"axis -2, so shape[-2]={shape[-2]} must be a multiple of 32; pass flatten=True to "
            f"give TE the 2-D view {t.matrix_shape}"
        )
    te = _te_quantize()
    row_scale_shape, col_scale_shape = _te_scale_shapes(shape)
    common = dict(
        scaling_mode=te.ScalingMode.MXFP8_1D_SCALING,
        dq_dtype=jnp.dtype(t.dtype if dq_dtype is None else dq_dtype),
        flatten_axis=-1,
    )
    row = col = None
    if t.has_rowwise:
        row = (
            t.rowwise_data.reshape(shape),
            fmt.e8m0_view(t.rowwise_scale).reshape(row_scale_shape),
        )
    if t.has_columnwise:
        col = (
            t.columnwise_data.reshape(shape),
            fmt.e8m0_view(t.columnwise_scale).reshape(col_scale_shape),
        )
    if row is not None and col is not None:
        return te.ScaledTensorFactory.create_2x(*row, *col, data_layout="NN", **common)
    data, scale = row if row is not None else col
    return te.ScaledTensorFactory.create_1x(data, scale, is_colwise=row is None, data_layout="N", **common)


def from_te(scaled: Any, *, shape: Sequence[int] | None = None) -> MXFP8Tensor:
    """An ``MXFP8Tensor`` holding the planes of TE JAX's ``ScaledTensor2x``/``ScaledTensor1x``.

    Args:
      scaled: a TE MXFP8 (``MXFP8_1D_SCALING``, E4M3 data, layout ``"N"``) scaled tensor. Its
        2-D view is rows = product of the axes before its ``flatten_axis``, columns = the rest.
      shape: the logical shape to record; its ``[prod(shape[:-1]), shape[-1]]`` view must be
        that 2-D view. Default: TE's data shape when ``flatten_axis`` is its last axis (TE's
        default), else the 2-D view itself.

    Returns:
      A validated ``MXFP8Tensor`` holding the planes ``scaled`` holds (the others ``None``), with
      that ``shape``.

    The nominal ``dtype`` is TE's ``dq_dtype``. The planes are reshaped and the scales bitcast
    to ``uint8``; nothing else changes, so ``from_te(to_te(t)) == t`` byte for byte.
    """
    te = _te_quantize()
    if isinstance(scaled, te.ScaledTensor2x):
        parts = (scaled.rowwise_tensor, scaled.colwise_tensor)
    elif isinstance(scaled, te.GroupedScaledTensor1x):
        raise TypeError("scaled is a GroupedScaledTensor1x; only ungrouped TE tensors convert")
    elif isinstance(scaled, te.ScaledTensor1x):
        parts = (scaled,)
    else:
        raise TypeError(f"scaled must be TE JAX's ScaledTensor2x or ScaledTensor1x, got {type(scaled).__name__}")
    planes, views, dq_dtypes = {}, set(), set()
    for part in parts:
        name = "columnwise" if part.is_colwise else "rowwise"
        if name in planes:
            raise ValueError(f"scaled holds two {name} tensors")
        rows, cols = _check_te_part(te, part, name)
        views.add((tuple(part.data.shape), part.flatten_axis))
        dq_dtypes.add(jnp.dtype(part.dq_dtype))
        scale_shape = (rows, cols // BLOCK) if name == "rowwise" else (rows // BLOCK, cols)
        scale = part.scale_inv
        if jnp.dtype(scale.dtype) != jnp.uint8:
            scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        planes[name] = (part.data.reshape(rows, cols), scale.reshape(scale_shape))
    if len(views) != 1 or len(dq_dtypes) != 1:
        raise ValueError(
            f"scaled's rowwise and columnwise tensors disagree: (data shape, flatten_axis) "
            f"{sorted(views)}, dq_dtype {sorted(map(str, dq_dtypes))}"
        )
    ((data_shape, flatten_axis),) = views
    rows, cols = math.prod(data_shape[:flatten_axis]), math.prod(data_shape[flatten_axis:])
    if shape is None:
        shape = data_shape if flatten_axis == len(data_shape) - 1 else (rows, cols)
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2 or (math.prod(shape[:-1]), shape[-1]) != (rows, cols):
        raise ValueError(
            f"shape={shape} must have the 2-D view [prod(shape[:-1]), shape[-1]] == "
            f"{(rows, cols)}, "
            f"the rows and columns of scaled (data {data_shape}, flatten_axis {flatten_axis})"
        )
    row = planes.get("rowwise", (None, None))
    col = planes.get("columnwise", (None, None))
    (dtype,) = dq_dtypes
    return MXFP8Tensor(
        rowwise_data=row[0],
        rowwise_scale=row[1],
        columnwise_data=col[0],
        columnwise_scale=col[1],
        shape=shape,
        dtype=dtype,
    ).validate()


def _check_te_part(te, part, name: str) -> tuple[int, int]:
    """Checks one TE ``ScaledTensor1x`` is MXFP8 as we store it; returns its 2-D view."""
    if part.scaling_mode != te.ScalingMode.MXFP8_1D_SCALING:
        raise ValueError(f"scaled's {name} tensor has scaling_mode {part.scaling_mode}; need MXFP8_1D_SCALING")
    if jnp.dtype(part.data.dtype) != jnp.float8_e4m3fn:
        raise ValueError(f"scaled's {name} data is {jnp.dtype(part.data.dtype)}; MXFP8Tensor holds float8_e4m3fn")
    if part.data_layout != "N":
        raise ValueError(f"scaled's {name} data_layout is {part.data_layout!r}; MXFP8 uses 'N'")
    if jnp.dtype(part.scale_inv.dtype) not in (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8)):
        raise ValueError(f"scaled's {name} scale_inv is {jnp.dtype(part.scale_inv.dtype)}; need float8_e8m0fnu")
    shape, fa = tuple(part.data.shape), part.flatten_axis
    rows, cols = math.prod(shape[:fa]), math.prod(shape[fa:])
    want = rows * cols // BLOCK
    if math.prod(part.scale_inv.shape) != want:
        raise ValueError(
            f"scaled's {name} scale_inv has shape {tuple(part.scale_inv.shape)}; need the compact "
            f"(unpadded) {want} scales of data {shape}"
        )
    return rows, cols
