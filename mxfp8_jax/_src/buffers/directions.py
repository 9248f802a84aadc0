"""MXFP8 planes direction by direction: the geometry a ``QuantizedDBuffer`` keeps (docs/design.md §4).

A direction (rowwise or columnwise) is a pair of uint8 planes over one flat layout ``L``:

- data: E4M3 bytes in ``L`` itself;
- scale: E8M0 bytes in ``L`` with every coordinate divided by 32; rowwise ``[M, K]`` becomes
  ``[M, K/32]`` at ``o/32`` (same placements), columnwise ``[M/32, K]`` at ``o/32`` with
  ``BlockAtomic`` placements mapped to ``RowAtomic`` (one scale row stands for 32 data rows).

Here: those scale layouts and placements; the rules a layout and its placements keep so that
quantizing each device's segment equals quantizing globally (``check_mxfp8_layout``,
``check_placements``); ``Direction``, one direction's planes; and the two SPMD programs that fill
planes: the local quantize (one ``mxfp8_quantize_segments`` call per device, driven by the
layout's per-shard descriptor table, or its jnp reference) and the zero-filled allocation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.buffers import segments
from mxfp8_jax._src.buffers.dbuffer import DBuffer
from mxfp8_jax._src.buffers.layout import GlobalLayout
from mxfp8_jax._src.core import spmd
from mxfp8_jax._src.kernels import backend as backends
from mxfp8_jax._src.kernels import ffi_calls
from mxfp8_jax._src.numerics.format import BLOCK

_TARGET = "mxfp8_quantize_segments"


# ------------------------------------------------------------------------------------------------
# Scale layouts and placements: the data layout with coordinates divided by 32


@functools.cache
def rowwise_scale_layout(layout: GlobalLayout) -> GlobalLayout:
    """``[M, K]`` at ``o`` -> ``[M, K/32]`` at ``o/32``; still 32-row blocks."""
    return _divided(layout, [(m, k // BLOCK) for m, k in layout.tensor_shapes], BLOCK)


@functools.cache
def columnwise_scale_layout(layout: GlobalLayout) -> GlobalLayout:
    """``[M, K]`` at ``o`` -> ``[M/32, K]`` at ``o/32``; one scale row per 32-row block."""
    return _divided(layout, [(m // BLOCK, k) for m, k in layout.tensor_shapes], 1)


def _divided(layout: GlobalLayout, shapes, block_size: int) -> GlobalLayout:
    return GlobalLayout(
        tensor_shapes=tuple(shapes),
        tensor_to_offset=tuple(o // BLOCK for o in layout.tensor_to_offset),
        size=layout.size // BLOCK,
        rank_segment_offsets=tuple(b // BLOCK for b in layout.rank_segment_offsets),
        block_size=block_size,
        shard_layout=layout.shard_layout,
    )


def columnwise_scale_placements(placements: Sequence[pl.Placement]) -> tuple[pl.Placement, ...]:
    """``BlockAtomic(n)`` -> ``RowAtomic()``: a scale row already stands for a 32-row block."""
    return tuple(pl.RowAtomic() if isinstance(p, pl.BlockAtomic) else p for p in placements)


def check_mxfp8_layout(layout: GlobalLayout, argname: str = "layout") -> None:
    """The layout rules under which local quantization equals global quantization."""
    if not isinstance(layout, GlobalLayout):
        raise TypeError(f"{argname} must be a GlobalLayout, got {type(layout).__name__}")
    if layout.block_size != BLOCK:
        raise ValueError(
            f"{argname}.block_size={layout.block_size}: an MXFP8 buffer needs block_size == 32 so "
            f"every device holds whole 32x1 columnwise blocks (BlockAtomic(n) placements need n "
            f"dividing 32)"
        )
    check_mxfp8_shapes(layout.tensor_shapes, f"{argname}.tensor_shapes")
    bad = [b for b in layout.rank_segment_offsets if b % BLOCK]
    if bad:
        raise ValueError(
            f"{argname}.rank_segment_offsets={layout.rank_segment_offsets}: bounds {bad} are not "
            f"multiples of 32, so scale coordinates (divided by 32) would not be whole"
        )


def check_mxfp8_shapes(tensor_shapes, argname: str = "tensor_shapes") -> None:
    for i, s in enumerate(tensor_shapes):
        s = tuple(s)
        if len(s) != 2:
            raise ValueError(f"{argname}[{i}]={s}: a QuantizedDBuffer holds 2-D tensors [M, K]")
        m, k = s
        if m % BLOCK or k % BLOCK:
            raise ValueError(
                f"{argname}[{i}]={s}: M={m} and K={k} must both be multiples of 32 (MXFP8 blocks are "
                f"1x32 rowwise and 32x1 columnwise)"
            )


def check_placements(mesh: Mesh, placements, argname: str) -> tuple[pl.Placement, ...]:
    """``placements`` validated for ``mesh``, none of them ``Partial`` (planes hold bytes)."""
    placements = pl.validate_placements(mesh, placements)
    for j, p in enumerate(placements):
        if pl.is_partial(p):
            raise ValueError(
                f"{argname}[{j}]={p}: MXFP8 planes hold bytes, not addends; reduce the master "
                f"weight before quantizing and use Replicate or a Shard placement"
            )
    return placements


# ------------------------------------------------------------------------------------------------
# One direction's planes


ROWWISE, COLUMNWISE = "rowwise", "columnwise"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Direction:
    """One direction's planes: E4M3 codes (``data``) and E8M0 scales (``scale``), uint8
    ``DBuffer``s, both present or both ``None`` (released); ``placements`` are the data's, kept
    while released. ``kind`` (``"rowwise"`` or ``"columnwise"``) fixes where the scales go."""

    data: DBuffer | None
    scale: DBuffer | None
    kind: str = dataclasses.field(metadata=dict(static=True))
    placements: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def allocated(self) -> bool:
        return self.data is not None and self.scale is not None

    def geometry(self, layout: GlobalLayout, placements=None):
        """``((layout, placements) of data, (layout, placements) of scale)`` over the data layout
        ``layout``, at ``placements`` (default: the direction's own)."""
        p = self.placements if placements is None else placements
        if self.kind == ROWWISE:
            return (layout, p), (rowwise_scale_layout(layout), p)
        return (layout, p), (columnwise_scale_layout(layout), columnwise_scale_placements(p))

    def released(self) -> Direction:
        return dataclasses.replace(self, data=None, scale=None)


# ------------------------------------------------------------------------------------------------
# The programs that fill planes


@functools.cache
def quantize_program(mesh, placements, layout, rule, rowwise, columnwise, backend, x64):
    """The jitted SPMD quantize: local segment -> allocated planes, no collective."""
    table = segments.descriptor_table(mesh, placements, layout)
    axes = pl.shard_axes(mesh, placements)
    desc_dtype = np.int64 if x64 else np.int32  # jax without x64 has no int64 arrays
    local_size = layout.local_size(pl.num_shards(mesh, placements))
    if local_size > np.iinfo(desc_dtype).max:
        raise ValueError(
            f"local buffers of {local_size} elements do not fit int32 descriptors; enable "
            f"jax_enable_x64 for buffers this large"
        )
    table = table.astype(desc_dtype)

    def reference(x, desc):
        return segments.quantize_segments_reference(x, desc, rule, rowwise, columnwise)

    def kernel(x, desc):
        (rq, rs), (cq, cs) = ffi_calls.quantize_segments(
            x, desc, scale_rule=rule.code, rowwise=rowwise, columnwise=columnwise
        )
        return tuple(p for p in (rq, rs, cq, cs) if p is not None)

    def local(x):
        desc = jnp.asarray(table)[spmd.shard_position(mesh, axes)]  # this device's row of the table
        return backends.run(_TARGET, backend, kernel, reference, x, desc)

    spec = pl.partition_spec(mesh, placements)
    n_out = 2 * (int(rowwise) + int(columnwise))
    return jax.jit(spmd.shard_map(local, mesh, spec, (spec,) * n_out))


@functools.cache
def zeros_program(mesh: Mesh, geometries: tuple):
    """One jitted program making zero-filled uint8 planes for ``(layout, placements)`` pairs."""
    shardings = tuple(NamedSharding(mesh, pl.partition_spec(mesh, p)) for _, p in geometries)
    sizes = tuple(lay.physical_size for lay, _ in geometries)
    return jax.jit(lambda: tuple(jnp.zeros((n,), jnp.uint8) for n in sizes), out_shardings=shardings)
