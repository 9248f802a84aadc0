"""Thin ``jax.ffi.ffi_call`` wrappers, one per FFI target of the extension.

They declare each target's results and attributes and nothing else: validation, defaults and
the choice between kernel and reference live in the callers (``backend.run``). E4M3 codes are
declared ``float8_e4m3fn`` results, which the kernels write directly (a uint8 result bitcast
afterwards would be a separate pass over the plane on XLA:CPU); scales are ``uint8``. The one
exception is ``mxfp8_quantize_segments``, whose flat planes are stored as bytes in uint8
DBuffers. A plane that was not asked for is a zero-size ``uint8[0]`` result and comes back as
None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def quantize_segments(x: jax.Array, desc: jax.Array, *, scale_rule: int, rowwise: bool, columnwise: bool):
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
    x: jax.Array,
    gamma: jax.Array,
    *,
    eps: float,
    weight_offset: float,
    quantize_from_fp32: bool,
    columnwise: bool,
    scale_rule: int,
):
    """``mxfp8_rmsnorm_quantize``: ``x [R, H]`` bf16, ``gamma [H]`` bf16 ->
    ``(normed, row_q, row_s, col_q, col_s)`` (codes float8_e4m3fn, scales uint8; the columnwise ones None unless asked).
    """
    r, h = x.shape
    normed, rq, rs, cq, cs = jax.ffi.ffi_call(
        "mxfp8_rmsnorm_quantize", _norm_shapes(r, h, columnwise), vmap_method="sequential"
    )(x, gamma, **_norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule))
    return normed, rq, rs, (cq if columnwise else None), (cs if columnwise else None)


def allgather_rmsnorm_quantize(
    x: jax.Array,
    gamma: jax.Array,
    where: jax.Array,
    *,
    rows: int,
    op_id: int,
    group_size: int,
    row_counts: tuple[int, ...],
    eps: float,
    weight_offset: float,
    quantize_from_fp32: bool,
    columnwise: bool,
    scale_rule: int,
    timeout_ms: int,
):
    """``mxfp8_allgather_rmsnorm_quantize`` (one device's call; see xla_ffi/cpu/allgather.cc,
    and xla_ffi/gpu/handlers.cc for the experimental GPU handler):
    ``x [rows_max, H]``, ``gamma [H]`` bf16, ``where = (rank, group, rendezvous id)`` int32 ->
    ``(normed, row_q, row_s, col_q, col_s, residual)`` for the group's ``rows`` gathered rows.
    Under ``vmap`` the batch runs as a loop of calls (``"sequential"``): every device's k-th
    call meets its peers' k-th under the same op id, in order (see rendezvous.h on repeated keys).
    """
    h = x.shape[1]
    shapes = _norm_shapes(rows, h, columnwise) + (jax.ShapeDtypeStruct((rows, h), jnp.bfloat16),)
    normed, rq, rs, cq, cs, residual = jax.ffi.ffi_call(
        "mxfp8_allgather_rmsnorm_quantize", shapes, vmap_method="sequential"
    )(
        x,
        gamma,
        where,
        op_id=np.int64(op_id),
        group_size=np.int64(group_size),
        row_counts=np.asarray(row_counts, dtype=np.int64),
        timeout_ms=np.int64(timeout_ms),
        **_norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule),
    )
    return normed, rq, rs, (cq if columnwise else None), (cs if columnwise else None), residual
