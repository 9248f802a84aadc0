"""Thin ``jax.ffi.ffi_call`` wrappers, one per FFI target of the extension.

They declare each target's results and attributes and nothing else: validation, defaults and
the choice between kernel and reference live in the callers (``backend.run``). E4M3 codes are
declared ``float8_e4m3fn`` results, which the kernels write directly (a uint8 result bitcast
afterwards would be a separate pass over the plane on XLA:CPU); scales are ``uint8``. The one
exception is ``mxfp8_quantize_segments``, whose flat planes are stored as bytes in uint8
DBuffers. A plane that was not asked for is a zero-size ``uint8[0]`` result and comes back as
None.

Each call carries a partitioning rule (``kernel_sharding``; docs/design.md §7), so that under
``jit`` a sharded input is quantized where it lies instead of being all-gathered, and a vmap rule
(custom partitioning has no batching rule of its own). One partitioned call is built per static
configuration and cached.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mxfp8_jax._src.kernels import kernel_sharding
from mxfp8_jax._src.numerics.format import BLOCK

_EMPTY = jax.ShapeDtypeStruct((0,), jnp.uint8)


def _quantize_dims(rowwise: bool, columnwise: bool) -> kernel_sharding.Dims:
    e = (kernel_sharding.EMPTY,)
    return kernel_sharding.Dims(
        operands=(("m", "k"),),
        results=(
            ("m", "k") if rowwise else e,
            ("m", "k/32") if rowwise else e,
            ("m", "k") if columnwise else e,
            ("m/32", "k") if columnwise else e,
        ),
        # rowwise blocks run along k, columnwise blocks along 32 rows; the kernel takes whole
        # blocks of k in every mode
        blocked=frozenset({"k", "m"} if columnwise else {"k"}),
    )


@functools.cache
def _quantize_call(scale_rule: int, rowwise: bool, columnwise: bool) -> kernel_sharding.Partitioned:
    """The partitioned ``mxfp8_quantize`` call of one configuration."""

    def body(x2d):
        m, k = x2d.shape
        u8, e4m3 = jnp.uint8, jnp.float8_e4m3fn
        shapes = (
            jax.ShapeDtypeStruct((m, k), e4m3) if rowwise else _EMPTY,
            jax.ShapeDtypeStruct((m, k // BLOCK), u8) if rowwise else _EMPTY,
            jax.ShapeDtypeStruct((m, k), e4m3) if columnwise else _EMPTY,
            jax.ShapeDtypeStruct((m // BLOCK, k), u8) if columnwise else _EMPTY,
        )
        return tuple(
            jax.ffi.ffi_call("mxfp8_quantize", shapes)(
                x2d,
                scale_rule=np.int32(scale_rule),
                rowwise=np.bool_(rowwise),
                columnwise=np.bool_(columnwise),
            )
        )

    return kernel_sharding.Partitioned(body, _quantize_dims(rowwise, columnwise))


@functools.cache
def _quantize_fn(scale_rule: int, rowwise: bool, columnwise: bool):
    """``_quantize_call`` with its vmap rule (custom partitioning has none of its own)."""
    fn = jax.custom_batching.custom_vmap(_quantize_call(scale_rule, rowwise, columnwise))

    @fn.def_vmap
    def _batched(axis_size, in_batched, x):
        # the [B, M, K] batch is one [B*M, K] call: rows are independent, and a columnwise block
        # (32 rows, M a multiple of 32) never straddles two examples
        b, m, k = x.shape
        flat = fn(x.reshape(b * m, k))
        out = tuple(p if p.size == 0 else p.reshape(b, -1, p.shape[-1]) for p in flat)
        return out, tuple(p.size != 0 for p in flat)

    return fn


def quantize(x2d: jax.Array, *, scale_rule: int, rowwise: bool, columnwise: bool):
    """``mxfp8_quantize``: (row_q, row_s, col_q, col_s); codes as float8_e4m3fn, scales as
    uint8; unrequested planes are None.

    The kernel writes E4M3 codes straight into float8_e4m3fn results: a uint8 result bitcast
    afterwards is a separate pass over the plane on XLA:CPU (a loop fusion, not a free view).
    Under ``jit`` a sharded ``x2d`` stays sharded (``kernel_sharding``): rows freely, and ``K``
    (rowwise) or ``M`` (columnwise) where every shard holds whole 32-blocks.
    """
    rq, rs, cq, cs = _quantize_fn(int(scale_rule), bool(rowwise), bool(columnwise))(x2d)
    return (rq, rs) if rowwise else (None, None), (cq, cs) if columnwise else (None, None)


@functools.cache
def _quantize_tiles_call(scale_rule: int) -> kernel_sharding.Partitioned:
    """The partitioned ``mxfp8_quantize_tiles`` call of one scale rule."""

    def body(x2d):
        m, k = x2d.shape
        shapes = (
            jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m // BLOCK, k // BLOCK), jnp.uint8),
        )
        return tuple(jax.ffi.ffi_call("mxfp8_quantize_tiles", shapes)(x2d, scale_rule=np.int32(scale_rule)))

    # a tile is 32 rows by 32 columns: both axes stay cut in whole tiles, and the scales
    # [M/32, K/32] follow the data along each
    dims = kernel_sharding.Dims(
        operands=(("m", "k"),), results=(("m", "k"), ("m/32", "k/32")), blocked=frozenset({"m", "k"})
    )
    return kernel_sharding.Partitioned(body, dims)


@functools.cache
def _quantize_tiles_fn(scale_rule: int):
    """``_quantize_tiles_call`` with its vmap rule (custom partitioning has none of its own)."""
    fn = jax.custom_batching.custom_vmap(_quantize_tiles_call(scale_rule))

    @fn.def_vmap
    def _batched(axis_size, in_batched, x):
        # the [B, M, K] batch is one [B*M, K] call: M is a multiple of 32, so no tile straddles
        # two examples, and example b's tiles are rows [b*M/32, (b+1)*M/32) of the scales
        b, m, k = x.shape
        q, s = fn(x.reshape(b * m, k))
        return (q.reshape(b, m, k), s.reshape(b, m // BLOCK, k // BLOCK)), (True, True)

    return fn


def quantize_tiles(x2d: jax.Array, *, scale_rule: int):
    """``mxfp8_quantize_tiles``: ``x2d [M, K]`` (both multiples of 32) -> ``(q [M, K]
    float8_e4m3fn, s [M/32, K/32] uint8)``, one scale per 32x32 tile.

    Under ``jit`` a sharded ``x2d`` stays sharded (``kernel_sharding``) along either axis where
    every shard holds whole 32x32 tiles; the scales follow.
    """
    return tuple(_quantize_tiles_fn(int(scale_rule))(x2d))


@functools.cache
def _segments_call(scale_rule: int, rowwise: bool, columnwise: bool) -> kernel_sharding.Partitioned:
    """The partitioned ``mxfp8_quantize_segments`` call of one configuration."""

    def body(x, desc):
        (s,) = x.shape
        u8 = jnp.uint8
        data, scale = jax.ShapeDtypeStruct((s,), u8), jax.ShapeDtypeStruct((s // BLOCK,), u8)
        shapes = (
            data if rowwise else _EMPTY,
            scale if rowwise else _EMPTY,
            data if columnwise else _EMPTY,
            scale if columnwise else _EMPTY,
        )
        return tuple(
            jax.ffi.ffi_call("mxfp8_quantize_segments", shapes)(
                x,
                desc,
                scale_rule=np.int32(scale_rule),
                rowwise=np.bool_(rowwise),
                columnwise=np.bool_(columnwise),
            )
        )

    # The descriptor addresses the whole segment (offsets into x, a columnwise block spanning
    # 32 rows of a piece anywhere in it): no cut of x is valid for a static rule, so everything
    # is replicated. QuantizedDBuffer calls it per device inside shard_map, where no rule applies.
    e = (kernel_sharding.EMPTY,)
    dims = kernel_sharding.Dims(
        operands=(("s",), ("p", "c")),
        results=(
            ("s",) if rowwise else e,
            ("s/32",) if rowwise else e,
            ("s",) if columnwise else e,
            ("s/32",) if columnwise else e,
        ),
        blocked=frozenset({"s"}) if rowwise or columnwise else frozenset(),
        replicated=frozenset({"s", "p", "c"}),
    )
    return kernel_sharding.Partitioned(body, dims)


def quantize_segments(x: jax.Array, desc: jax.Array, *, scale_rule: int, rowwise: bool, columnwise: bool):
    """``mxfp8_quantize_segments``: the planes of one packed flat segment ``x [S]``.

    ``desc [P, 3]`` rows ``(offset, rows, row_len)`` say where each tensor piece sits (int64, or
    int32 when jax runs without x64).
    Returns ``(row_q [S], row_s [S/32]), (col_q [S], col_s [S/32])`` as uint8; unrequested
    planes are None. Under ``jit`` a sharded segment is replicated (see ``_segments_fn``).
    """
    rq, rs, cq, cs = _segments_call(int(scale_rule), bool(rowwise), bool(columnwise))(x, desc)
    return (rq, rs) if rowwise else (None, None), (cq, cs) if columnwise else (None, None)


def _norm_shapes(r: int, h: int, columnwise: bool):
    u8, e4m3 = jnp.uint8, jnp.float8_e4m3fn  # codes as E4M3 (see quantize), scales as bytes
    return (
        jax.ShapeDtypeStruct((r, h), jnp.bfloat16),
        jax.ShapeDtypeStruct((r, h), e4m3),
        jax.ShapeDtypeStruct((r, h // BLOCK), u8),
        jax.ShapeDtypeStruct((r, h), e4m3) if columnwise else _EMPTY,
        jax.ShapeDtypeStruct((r // BLOCK, h), u8) if columnwise else _EMPTY,
    )


def _norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule):
    return dict(
        eps=np.float32(eps),
        weight_offset=np.float32(weight_offset),
        quantize_from_fp32=np.bool_(quantize_from_fp32),
        columnwise=np.bool_(columnwise),
        scale_rule=np.int32(scale_rule),
    )


@functools.cache
def _rmsnorm_call(
    eps: float, weight_offset: float, quantize_from_fp32: bool, columnwise: bool, scale_rule: int
) -> kernel_sharding.Partitioned:
    """The partitioned ``mxfp8_rmsnorm_quantize`` call of one configuration."""
    attrs = _norm_attrs(eps, weight_offset, quantize_from_fp32, columnwise, scale_rule)

    def body(x, gamma):
        r, h = x.shape
        return tuple(jax.ffi.ffi_call("mxfp8_rmsnorm_quantize", _norm_shapes(r, h, columnwise))(x, gamma, **attrs))

    e = (kernel_sharding.EMPTY,)
    dims = kernel_sharding.Dims(
        operands=(("m", "k"), ("k",)),
        results=(
            ("m", "k"),
            ("m", "k"),
            ("m", "k/32"),
            ("m", "k") if columnwise else e,
            ("m/32", "k") if columnwise else e,
        ),
        # the norm reduces over the whole row: k is never cut; rows are, in whole columnwise
        # blocks when those are asked for
        blocked=frozenset({"k", "m"} if columnwise else {"k"}),
        replicated=frozenset({"k"}),
    )
    return kernel_sharding.Partitioned(body, dims)


@functools.cache
def _rmsnorm_fn(*config):
    """``_rmsnorm_call`` with its vmap rule (custom partitioning has none of its own)."""
    fn = jax.custom_batching.custom_vmap(_rmsnorm_call(*config))

    @fn.def_vmap
    def _batched(axis_size, in_batched, x, gamma):
        x_batched, gamma_batched = in_batched
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size,) + x.shape)
        if gamma_batched:  # one gamma per example: one call per example
            out = jax.lax.map(lambda xg: fn(*xg), (x, gamma))
        else:  # one gamma: the batch is one call over B*R rows (columnwise: R % 32 == 0)
            b, r, h = x.shape
            flat = fn(x.reshape(b * r, h), gamma)
            out = tuple(p if p.size == 0 else p.reshape(b, -1, p.shape[-1]) for p in flat)
        return out, tuple(p.size != 0 for p in out)

    return fn


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
    Under ``jit`` rows stay sharded (in whole 32-row blocks for columnwise); ``H`` is replicated.
    """
    fn = _rmsnorm_fn(float(eps), float(weight_offset), bool(quantize_from_fp32), bool(columnwise), int(scale_rule))
    normed, rq, rs, cq, cs = fn(x, gamma)
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
