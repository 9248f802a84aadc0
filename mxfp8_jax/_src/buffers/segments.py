"""The packed-segment quantize in pure JAX: the reference of the ``mxfp8_quantize_segments`` kernel.

One device's flat segment ``x [S]`` holds pieces of several tensors; a descriptor table
``desc [P, 3]`` of rows ``(offset, rows, row_len)`` (sorted by offset; unused rows start at
``S``) says where each piece sits: an ``[rows, row_len]`` matrix at element ``offset``. Rowwise
and columnwise scales of a piece start at element ``offset / 32`` of the scale segments (scale
layouts are the data layout with every coordinate divided by 32); bytes no piece covers are 0.
``descriptor_table`` builds the table of every shard of a layout under its placements; that is
what ``QuantizedDBuffer.quantize`` runs the kernel (or this reference) with.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.buffers.layout import GlobalLayout
from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.numerics.format import BLOCK


def quantize_segments_reference(x, desc, rule: fmt.ScaleRule, rowwise: bool, columnwise: bool):
    """Pure-JAX ``mxfp8_quantize_segments``: the kernel's descriptor logic as integer index maps.

    ``desc`` rows are sorted by offset. Every piece starts on a multiple of 32 and has rows of a
    multiple of 32 elements, so the segment's flat 32-element blocks are exactly the pieces'
    rowwise blocks, in scale order. Columnwise block ``p`` (scale position, offset/32 + R*K + c
    within its piece) gathers elements ``o + (32R + i)K + c``, i < 32. Uncovered bytes are 0.
    """
    n = x.shape[0]
    off, rows, k = desc[:, 0], desc[:, 1], desc[:, 2]
    as_u8 = lambda q: lax.bitcast_convert_type(q, jnp.uint8)

    def piece_of(pos, scale):  # (piece start, row length, covered) at element / scale positions
        d = BLOCK if scale else 1
        # index of the last piece starting at or before each position (rows sorted by offset;
        # unused rows start at n, past the end, and drop out of the scatter)
        starts = jnp.zeros(pos.shape, jnp.int32).at[off // d].add(1, mode="drop")
        j = jnp.clip(jnp.cumsum(starts) - 1, 0, desc.shape[0] - 1)
        o, kk = off[j], k[j]
        return o, kk, (pos >= o // d) & (pos < (o + rows[j] * kk) // d)

    e = jnp.arange(n, dtype=desc.dtype)
    o, kk, covered = piece_of(e, False)
    nb = n // BLOCK
    blocks = []  # every requested block as one row of 32, quantized in one pass
    if rowwise:
        blocks.append(x.reshape(nb, BLOCK))
    if columnwise:
        p = jnp.arange(nb, dtype=desc.dtype)
        po, pk, pcov = piece_of(p, True)
        local = p - po // BLOCK
        first = po + (local // pk) * BLOCK * pk + local % pk
        members = first[:, None] + jnp.arange(BLOCK, dtype=desc.dtype)[None, :] * pk[:, None]
        blocks.append(x[jnp.where(pcov[:, None], members, 0)])
    q, s = fmt.quantize_rowwise(jnp.concatenate(blocks) if len(blocks) > 1 else blocks[0], rule)
    q = as_u8(q).reshape(-1, BLOCK * nb)
    s = s.reshape(-1, nb)
    planes = []
    if rowwise:
        planes += [jnp.where(covered, q[0], 0), jnp.where(covered[::BLOCK], s[0], 0)]
    if columnwise:
        # element e = o + rK + c sits at index r % 32 of columnwise block o/32 + (r // 32)K + c
        r, c = (e - o) // kk, (e - o) % kk
        at = (o // BLOCK + (r // BLOCK) * kk + c) * BLOCK + r % BLOCK
        planes += [jnp.where(covered, q[-1][jnp.where(covered, at, 0)], 0), jnp.where(pcov, s[-1], 0)]
    return tuple(planes)


# ------------------------------------------------------------------------------------------------
# The descriptor table of a layout's shards


@functools.cache
def descriptor_table(mesh: Mesh, placements: tuple, layout: GlobalLayout) -> np.ndarray:
    """``[num_shards, P, 3]`` int64: per shard, rows ``(offset, rows, row_len)`` of its pieces.

    Offsets count from the start of the shard's local buffer (its segments back to back, each
    ``layout.segment_capacity`` long); rows are sorted by offset. Shards with fewer pieces are
    padded with unused rows ``(local_size, 0, 32)`` (past every piece, so the order holds).
    """
    n_shards = pl.num_shards(mesh, placements)
    local_size = layout.local_size(n_shards)
    shards = []
    for s in range(n_shards):
        rows = []
        for j, k in enumerate(pl.segments_of_shard(mesh, placements, s)):
            for i in range(layout.num_tensors):
                part = layout.overlap(i, k)
                if part is not None:
                    (a, b), row = part, layout.row_size(i)
                    rows.append((layout.local_offset(a, k, j), (b - a) // row, row))
        shards.append(sorted(rows))
    p = max(1, max(len(r) for r in shards))
    table = np.tile(np.array([local_size, 0, BLOCK], np.int64), (n_shards, p, 1))
    for s, rows in enumerate(shards):
        if rows:
            table[s, : len(rows)] = rows
    table.setflags(write=False)
    return table
