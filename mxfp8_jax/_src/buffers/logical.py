"""Logical tensors <-> a flat buffer, on the devices.

One jitted ``shard_map`` program each way (``_to_logical_fn``, ``_to_flat_fn``): one all-to-all
per sharded tensor (an all-gather per replicated one) over the Shard axes, and static
per-shard slices, so no value passes through a host and no device holds the whole buffer.
Floats move as their bits (same-width unsigned ints): exact for every payload (XLA:CPU computes
bf16 concatenations in f32, which canonicalizes NaN payloads), and therefore not differentiable:
these are for checkpoints and initialization, not for use inside a differentiated step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.buffers.layout import GlobalLayout
from mxfp8_jax._src.core import spmd
from mxfp8_jax._src.core.tracing import is_traced


def check_static(mesh: Mesh, placements, layout: GlobalLayout) -> None:
    if not isinstance(layout, GlobalLayout):
        raise TypeError(f"layout must be a GlobalLayout, got {type(layout).__name__}")
    if layout.num_tensors == 0:
        raise ValueError(
            "layout holds no tensor: a DBuffer packs at least one (an empty flat buffer has "
            "nothing to shard, and XLA cannot gather zero-size shards)"
        )
    if layout.dp_size != mesh.size:
        raise ValueError(
            f"layout.dp_size={layout.dp_size} must equal mesh.size={mesh.size}: DBuffer layouts "
            f"have one segment per device"
        )
    pl.check_layout_fits(placements, layout.block_size)


def logical_sharding(mesh: Mesh, placements: pl.Placements, shape: Sequence[int]) -> NamedSharding:
    """The sharding of a logical tensor beside a buffer over ``mesh``/``placements``.

    Axis 0 split over the buffer's Shard axes (in the flat buffer's order, so each device gets
    a contiguous run of rows) when their product divides ``shape[0]``; otherwise, and for
    unsharded placements, replicated over the mesh (jax arrays have no uneven shardings).
    """
    shape = tuple(int(d) for d in shape)
    axes = pl.partition_spec(mesh, pl.validate_placements(mesh, placements))[0]
    n = pl.num_shards(mesh, placements)
    if axes is None or not shape or shape[0] % n:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(axes, *([None] * (len(shape) - 1))))


def unpack_logical(data: jax.Array, mesh: Mesh, placements: pl.Placements, layout: GlobalLayout) -> list[jax.Array]:
    """The tensors of the flat buffer ``data`` (``layout`` under ``placements``, no Partial
    axis) as global arrays with ``logical_sharding``, moved device to device.

    Exact: the bytes of every tensor equal those of a gather and static slices
    (``DBuffer.get_tensors``).
    """
    return list(_to_logical_fn(mesh, tuple(placements), layout, jnp.dtype(data.dtype))(data))


def pack_logical(
    tensors: Sequence, mesh: Mesh, placements: pl.Placements, layout: GlobalLayout, dtype: DTypeLike
) -> jax.Array:
    """The flat physical buffer of ``layout`` under ``placements`` (no Partial) from ``tensors``.

    ``tensors`` (in layout order, shapes ``layout.tensor_shapes``) may be global ``jax.Array``s
    with any sharding over ``mesh``'s devices, fully addressable arrays elsewhere, or host
    arrays; each is cast to ``dtype`` on the devices. In a multi-process run every process makes
    the call with its global arrays (host arrays: the same value everywhere); nothing is fetched
    to a host. The result is sharded as ``NamedSharding(mesh, partition_spec(mesh, placements))``
    and its padding is zero, as ``DBuffer.distribute_tensors`` packs it.
    """
    placements = pl.validate_placements(mesh, placements)
    for j, p in enumerate(placements):
        if pl.is_partial(p):
            raise ValueError(f"pack_logical: placements[{j}]={p} is Partial; pack under Replicate, then redistribute")
    check_static(mesh, placements, layout)
    tensors = list(tensors)
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"pack_logical: {len(tensors)} tensors for a layout of {layout.num_tensors}")
    for i, (t, shape) in enumerate(zip(tensors, layout.tensor_shapes)):
        if tuple(np.shape(t)) != shape:
            raise ValueError(f"tensors[{i}] has shape {tuple(np.shape(t))}; the layout holds {shape}")
    placed = [_onto_mesh(t, mesh, placements, i) for i, t in enumerate(tensors)]
    return _to_flat_fn(mesh, placements, layout, jnp.dtype(dtype))(*placed)


def is_distributed(t) -> bool:
    """A concrete jax.Array on several devices, or not all on this process's devices."""
    return isinstance(t, jax.Array) and (not t.is_fully_addressable or len(t.sharding.device_set) > 1)


def _onto_mesh(t, mesh: Mesh, placements, i: int) -> jax.Array:
    """``t`` resharded (device to device) to ``logical_sharding``, the ``shard_map``'s input."""
    target = logical_sharding(mesh, placements, np.shape(t))
    if is_traced(t):  # under jit: Explicit mesh axes take jax.reshard, Auto ones a constraint
        if any(a == jax.sharding.AxisType.Explicit for a in mesh.axis_types):
            return jax.reshard(t, target)
        return lax.with_sharding_constraint(t, target)
    if not isinstance(t, jax.Array):
        return jax.device_put(np.asarray(t), target)  # host value: each device takes its slice
    if t.sharding == target:  # the same mesh object too: shard_map takes no other
        return t
    if t.is_fully_addressable or t.sharding.device_set == target.device_set:
        # device to device: a compiled reshard (jax >= 0.11's device_put may go through the host)
        return _resharder(target)(t)
    raise ValueError(
        f"tensors[{i}] spans non-addressable devices outside the mesh {dict(mesh.shape)}; put it "
        f"on the mesh's devices first (jax.jit with out_shardings over that mesh)"
    )


@functools.lru_cache(maxsize=64)
def _resharder(target: NamedSharding):
    """A compiled identity whose output has ``target``'s sharding: moves an array device to device."""
    return jax.jit(lambda a: a, out_shardings=target)


def _bits_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def _to_bits(x):
    b = _bits_dtype(x.dtype)
    return x if b == x.dtype else lax.bitcast_convert_type(x, b)


def _from_bits(x, dtype):
    return x if x.dtype == jnp.dtype(dtype) else lax.bitcast_convert_type(x, dtype)


@dataclasses.dataclass(frozen=True)
class _Runs:
    """Where each tensor's elements sit in each shard's local buffer (static, per geometry).

    ``runs[s][i]``: ``(local_pos, elem, n)`` runs, ``n`` elements of tensor ``i`` (from its
    element ``elem`` on) at ``local_pos`` of shard ``s``; a shard's elements of one tensor are
    one contiguous range ``[first[s][i], first[s][i] + count[s][i])`` of the tensor, stored as
    one run per segment the shard holds.
    """

    runs: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]
    first: tuple[tuple[int, ...], ...]
    count: tuple[tuple[int, ...], ...]

    def widest(self, i: int) -> int:
        return max(1, max(c[i] for c in self.count))

    def local_slices(self, s: int, i: int, e0: int, e1: int) -> list[tuple[int, int]]:
        """``(local_pos, n)`` slices of shard ``s``'s buffer holding tensor elements ``[e0, e1)``."""
        out = []
        for p, e, m in self.runs[s][i]:
            a, b = max(e, e0), min(e + m, e1)
            if a < b:
                out.append((p + a - e, b - a))
        return out

    def overlap(self, s: int, i: int, e0: int, e1: int) -> tuple[int, int]:
        """``(start, n)`` of tensor elements ``[e0, e1)`` within shard ``s``'s range."""
        a, b = max(self.first[s][i], e0), min(self.first[s][i] + self.count[s][i], e1)
        return (a, b - a) if a < b else (a, 0)


@functools.cache
def _runs(mesh: Mesh, placements, layout: GlobalLayout) -> _Runs:
    n = pl.num_shards(mesh, placements)
    runs, first, count = [], [], []
    for s in range(n):
        segs = pl.segments_of_shard(mesh, placements, s)
        per = [[] for _ in range(layout.num_tensors)]
        for j, k in enumerate(segs):
            for i in range(layout.num_tensors):
                part = layout.overlap(i, k)
                if part is not None:
                    a, b = part
                    per[i].append((layout.local_offset(a, k, j), a - layout.tensor_to_offset[i], b - a))
        runs.append(tuple(tuple(r) for r in per))
        first.append(tuple(r[0][1] if r else 0 for r in per))
        count.append(tuple(sum(x[2] for x in r) for r in per))
    return _Runs(tuple(runs), tuple(first), tuple(count))


def _concat(parts, n: int, dtype):
    """``parts`` back to back, zero-padded to ``n`` elements."""
    at = sum(p.shape[0] for p in parts)
    if n > at:
        parts = [*parts, jnp.zeros((n - at,), dtype)]
    if not parts:
        return jnp.zeros((0,), dtype)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _shard_switch(mesh: Mesh, axes, branches):
    """``branches[s]()`` on the devices of shard ``s`` (one static program per shard)."""
    if len(branches) == 1:
        return branches[0]()
    return lax.switch(spmd.shard_position(mesh, axes), branches)


@functools.cache
def _to_logical_fn(mesh: Mesh, placements, layout: GlobalLayout, dtype):
    """Flat buffer -> logical tensors, one ``shard_map``; per tensor ``i`` (``n`` shards):

    - sharded result (``n`` divides dim 0; chunk ``c = numel / n``): shard ``s`` sends shard
      ``d`` the part of its range inside ``[d c, (d+1) c)`` (one all-to-all, each message
      padded to the largest), and ``d`` lays the ``n`` messages out as its rows;
    - replicated result: one all-gather of every shard's range (padded to the widest), laid out.

    Cutting messages out of the local buffer and laying them out are static slices, one
    program per shard (a ``switch`` over its shard index); no device holds more than about one
    tensor beyond its own shard.
    """
    axes = pl.shard_axes(mesh, placements)
    group = spmd.axis_group(axes) if axes else None
    geo, n = _runs(mesh, placements, layout), pl.num_shards(mesh, placements)
    bits = _bits_dtype(dtype)
    out_specs = tuple(logical_sharding(mesh, placements, shp).spec for shp in layout.tensor_shapes)
    plans = []
    for i in range(layout.num_tensors):
        numel = layout.numel(i)
        if out_specs[i] == PartitionSpec():  # every device gets everything
            plans.append((numel, [[(0, numel)] * n], geo.widest(i)))
            continue
        c = numel // n
        # sends[s][d] = (start, count) of tensor elements s sends to d
        sends = [[geo.overlap(s, i, d * c, (d + 1) * c) for d in range(n)] for s in range(n)]
        plans.append((c, sends, max(1, max(m for row in sends for _, m in row))))

    def send_of(s, local):
        out = []
        for i in range(layout.num_tensors):
            chunk, sends, w = plans[i]
            if out_specs[i] == PartitionSpec():
                piece = [local[p : p + m] for p, m in geo.local_slices(s, i, 0, layout.numel(i))]
                out.append(_concat(piece, w, bits))
                continue
            rows = []
            for d in range(n):
                e, m = sends[s][d]
                rows.append(_concat([local[p : p + k] for p, k in geo.local_slices(s, i, e, e + m)], w, bits))
            out.append(jnp.stack(rows))
        return tuple(out)

    def receive_of(d, i, got):
        chunk, sends, w = plans[i]
        return _concat([got[s, : sends[s][d][1]] for s in range(n) if sends[s][d][1]], chunk, bits)

    def local_fn(local):
        sent = _shard_switch(mesh, axes, [functools.partial(send_of, s, local) for s in range(n)])
        outs = []
        for i, shape in enumerate(layout.tensor_shapes):
            chunk, sends, w = plans[i]
            if out_specs[i] == PartitionSpec():
                gathered = sent[i] if group is None else lax.all_gather(sent[i], group, axis=0, tiled=True)
                parts = [gathered[s * w : s * w + geo.count[s][i]] for s in range(n) if geo.count[s][i]]
                outs.append(_concat(parts, layout.numel(i), bits).reshape(shape))
                continue
            got = lax.all_to_all(sent[i], group, 0, 0) if n > 1 else sent[i]
            mine = _shard_switch(mesh, axes, [functools.partial(receive_of, d, i, got) for d in range(n)])
            outs.append(mine.reshape((shape[0] // n, *shape[1:])))
        return tuple(outs)

    fn = spmd.shard_map(local_fn, mesh, pl.partition_spec(mesh, placements), out_specs)
    return jax.jit(lambda data: tuple(_from_bits(t, dtype) for t in fn(_to_bits(data))))


@functools.cache
def _to_flat_fn(mesh: Mesh, placements, layout: GlobalLayout, dtype):
    """Logical tensors -> flat buffer, one ``shard_map`` (inputs resharded to
    ``logical_sharding`` on the way in); per tensor ``i``, each shard ``s`` first collects the
    contiguous range of the tensor it holds (``[first, first + count)``, padded to the widest):

    - sharded input (device ``d`` holds chunk ``[d c, (d+1) c)``): ``d`` sends ``s`` the part of
      its chunk inside ``s``'s range (one all-to-all, messages padded to the largest);
    - replicated input: a dynamic slice at ``s``'s offset;

    then lays its ranges and the zero padding out as its local buffer (static slices, a
    ``switch`` over its shard index).
    """
    axes = pl.shard_axes(mesh, placements)
    group = spmd.axis_group(axes) if axes else None
    geo, n = _runs(mesh, placements, layout), pl.num_shards(mesh, placements)
    bits = _bits_dtype(dtype)
    local_size = layout.local_size(n)
    widths = [geo.widest(i) for i in range(layout.num_tensors)]
    in_specs = tuple(logical_sharding(mesh, placements, shp).spec for shp in layout.tensor_shapes)
    starts = [np.array([geo.first[s][i] for s in range(n)], np.int32) for i in range(layout.num_tensors)]
    plans = []
    for i in range(layout.num_tensors):
        if in_specs[i] == PartitionSpec():
            plans.append(None)
            continue
        c = layout.numel(i) // n
        # sends[d][s] = (start, count) of tensor elements chunk d sends to shard s
        sends = [[geo.overlap(s, i, d * c, (d + 1) * c) for s in range(n)] for d in range(n)]
        plans.append((c, sends, max(1, max(m for row in sends for _, m in row))))

    def send_of(d, i, block):
        c, sends, w = plans[i]
        return jnp.stack([_concat([block[e - d * c : e - d * c + m]], w, bits) for e, m in sends[d]])

    def receive_of(s, i, got):
        c, sends, w = plans[i]
        return _concat([got[d, : sends[d][s][1]] for d in range(n) if sends[d][s][1]], widths[i], bits)

    def assemble(s, ranges):
        parts, at = [], 0
        runs = sorted((p, i, e, m) for i in range(layout.num_tensors) for p, e, m in geo.runs[s][i])
        for p, i, e, m in runs:
            if p > at:
                parts.append(jnp.zeros((p - at,), bits))
            o = e - geo.first[s][i]
            parts.append(ranges[i][o : o + m])
            at = p + m
        return _concat(parts, local_size, bits)

    def local_fn(*blocks):
        ranges = []
        for i, block in enumerate(blocks):
            flat = block.reshape(-1)
            if plans[i] is None:  # whole on every device: cut this shard's range
                flat = _concat([flat], layout.numel(i) + widths[i], bits)
                start = jnp.asarray(starts[i])[spmd.shard_position(mesh, axes)] if axes else starts[i][0]
                ranges.append(lax.dynamic_slice_in_dim(flat, start, widths[i]))
                continue
            sent = _shard_switch(mesh, axes, [functools.partial(send_of, d, i, flat) for d in range(n)])
            got = lax.all_to_all(sent, group, 0, 0) if n > 1 else sent
            ranges.append(_shard_switch(mesh, axes, [functools.partial(receive_of, s, i, got) for s in range(n)]))
        return _shard_switch(mesh, axes, [functools.partial(assemble, s, ranges) for s in range(n)])

    fn = spmd.shard_map(local_fn, mesh, in_specs, pl.partition_spec(mesh, placements))
    return jax.jit(lambda *ts: _from_bits(fn(*(_to_bits(jnp.asarray(t).astype(dtype)) for t in ts)), dtype))
