"""DBuffer: N tensors packed into one flat sharded ``jax.Array`` (docs/design.md §3).

The one array leaf ``data`` is ``[layout.physical_size]`` with
``NamedSharding(mesh, partition_spec(mesh, placements))``; mesh, placements and layout are
static. Every collective is a single ``lax`` collective over each device's whole local buffer,
inside a ``jax.shard_map`` over the mesh, so the same call works eagerly and under ``jit``.

Where the data lives (``layout.dp_size == mesh.size``): with ``num_shards`` shards, the device at
mesh position ``pos`` holds shard ``s = shard_index(mesh, placements, pos)``, whose local buffer is
the layout segments ``segments_of_shard(mesh, placements, s)`` back to back, each
``layout.segment_capacity`` elements (logical elements first, then padding). Partial axes are
replicated as far as the sharding says; their devices hold different addends.

Meshes: axes of type ``Auto`` or ``Explicit`` (``jax.make_mesh(..., axis_types=...)`` or
``jax.sharding.Mesh(devices, names)``); all data movement goes through ``shard_map``, which
treats both alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from mxfp8_jax._src import checks, spmd
from mxfp8_jax._src import placement as pl
from mxfp8_jax._src.layout import GlobalLayout, ShardLayout
from mxfp8_jax._src.tracing import is_traced


def _shard_map_placements(fn, mesh: Mesh, in_placements, out_placements):
    return spmd.shard_map(fn, mesh, pl.partition_spec(mesh, in_placements), pl.partition_spec(mesh, out_placements))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DBuffer:
    """A flat sharded buffer of packed tensors.

    Invariants (checked on construction): ``placements`` valid for ``mesh`` (one per axis, Shard
    placements a suffix); ``layout.dp_size == mesh.size`` and the layout holds at least one
    tensor; every ``BlockAtomic(n)`` has ``layout.block_size % n == 0``; ``data`` is 1-D of
    length ``layout.physical_size`` and, once concrete, sharded as
    ``NamedSharding(mesh, partition_spec(mesh, placements))`` (in multi-process runs too).
    """

    data: jax.Array
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    placements: tuple[pl.Placement, ...] = dataclasses.field(metadata=dict(static=True))
    layout: GlobalLayout = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        object.__setattr__(self, "placements", pl.validate_placements(self.mesh, self.placements))
        _check_static(self.mesh, self.placements, self.layout)
        data = self.data
        if not isinstance(data, jax.Array):  # placeholders from pytree utilities
            return
        if data.ndim != 1 or data.shape[0] != self.layout.physical_size:
            raise ValueError(
                f"data has shape {tuple(data.shape)}; a DBuffer holds a flat "
                f"[{self.layout.physical_size}] array (layout.physical_size)"
            )
        # Under several processes the data is not fully addressable, but its global sharding
        # (mesh, devices, spec) is known in every process: it is checked the same way.
        if not is_traced(data) and not data.sharding.is_equivalent_to(self.sharding, 1):
            mesh = getattr(data.sharding, "mesh", None)
            differ = checks.mesh_difference(mesh, self.mesh) if isinstance(mesh, Mesh) else ""
            raise ValueError(
                f"data is sharded as {data.sharding}, but placements {self.placements} need "
                f"{self.sharding}"
                + (f" (the meshes differ in {differ})" if differ else "")
                + "; jax.device_put it there first"
            )

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def zeros(cls, mesh: Mesh, placements: pl.Placements, layout: GlobalLayout, dtype: DTypeLike) -> DBuffer:
        """A zero-filled buffer with an existing layout."""
        placements = pl.validate_placements(mesh, placements)
        _check_static(mesh, placements, layout)
        sharding = NamedSharding(mesh, pl.partition_spec(mesh, placements))
        data = _place(jnp.zeros((layout.physical_size,), dtype), sharding)
        return cls(data, mesh, placements, layout)

    @classmethod
    def empty(
        cls,
        mesh: Mesh,
        placements: pl.Placements,
        tensor_shapes: Iterable[Sequence[int]],
        dtype: DTypeLike,
        *,
        shard_layout: ShardLayout = ShardLayout.PADDED,
        block_size: int = 1,
    ) -> DBuffer:
        """A buffer for ``tensor_shapes`` (zero-filled), its layout built for ``mesh.size`` segments.

        The layout's block is ``lcm(block_size, n)`` over the placements' ``BlockAtomic(n)``.
        """
        layout = _build_layout(mesh, placements, tensor_shapes, shard_layout, block_size)
        return cls.zeros(mesh, placements, layout, dtype)

    @classmethod
    def distribute_tensors(
        cls,
        tensors: Sequence[jax.Array],
        mesh: Mesh,
        placements: pl.Placements,
        *,
        dtype: DTypeLike | None = None,
        shard_layout: ShardLayout = ShardLayout.PADDED,
        block_size: int = 1,
        layout: GlobalLayout | None = None,
    ) -> DBuffer:
        """Packs ``tensors`` (cast to ``dtype``, default their common type) and places them.

        The buffer's value is the tensors: under ``Partial("sum")`` the first device along each
        Partial axis holds them and the others zeros; under ``Partial("avg")`` every device does.
        ``layout`` (built with ``dp_size = mesh.size``) overrides ``shard_layout``/``block_size``.

        Where the packing runs: under ``jit``, in the graph; when any tensor is a ``jax.Array``
        spread over several devices or processes (sharded, or spanning non-addressable devices),
        on the devices with ``pack_logical`` (no host copy; every process must make the call);
        otherwise (host arrays, single-device arrays) on the host, then one transfer.
        """
        tensors = list(tensors)
        shapes = [tuple(np.shape(t)) for t in tensors]
        if layout is None:
            layout = _build_layout(mesh, placements, shapes, shard_layout, block_size)
        elif tuple(shapes) != layout.tensor_shapes:
            raise ValueError(f"tensor shapes {shapes} differ from layout.tensor_shapes {layout.tensor_shapes}")
        placements = pl.validate_placements(mesh, placements)
        _check_static(mesh, placements, layout)
        if dtype is None:
            dtype = jnp.result_type(*tensors) if tensors else jnp.float32
        dtype = jnp.dtype(dtype)
        base = tuple(pl.Replicate() if pl.is_partial(p) else p for p in placements)
        if is_traced(*tensors):  # under jit: pack in the graph
            flat = _flat_buffer_traced(layout, [jnp.asarray(t).astype(dtype) for t in tensors], dtype)
            flat = _place(flat, NamedSharding(mesh, pl.partition_spec(mesh, base)))
        elif any(_is_distributed(t) for t in tensors):  # sharded arrays: device to device
            flat = pack_logical(tensors, mesh, base, layout, dtype)
        else:  # host values or whole single-device arrays: pack on the host, one transfer
            flat = _flat_buffer(layout, [np.asarray(t).astype(dtype) for t in tensors], dtype, np)
            flat = _place(flat, NamedSharding(mesh, pl.partition_spec(mesh, base)))
        return cls(flat, mesh, base, layout).redistribute(placements)

    # -- logical content and checkpoints -------------------------------------------------------

    def logical_tensors(self) -> list[jax.Array]:
        """Every tensor as a global ``jax.Array`` with ``logical_sharding`` (``unpack_logical``).

        Partial axes are reduced first (the buffer's value). Runs on the devices: no host copy.
        """
        reduced = tuple(pl.Replicate() if pl.is_partial(p) else p for p in self.placements)
        return unpack_logical(self.redistribute(reduced))

    def save(
        self,
        directory,
        *,
        names: Sequence[str] | None = None,
        metadata=None,
        async_save: bool = False,
        overwrite: bool = False,
    ):
        """Writes the logical tensors to ``directory`` (``checkpoint.save_dbuffer``); returns a
        ``SaveHandle`` (``wait()`` before relying on an asynchronous save)."""
        from mxfp8_jax._src import checkpoint

        return checkpoint.save_dbuffer(
            directory, self, names=names, metadata=metadata, async_save=async_save, overwrite=overwrite
        )

    @classmethod
    def restore(cls, directory, mesh: Mesh, placements: pl.Placements, **kwargs) -> DBuffer:
        """A buffer over ``mesh``/``placements`` holding a checkpoint's tensors
        (``checkpoint.restore_dbuffer``; any mesh and layout)."""
        from mxfp8_jax._src import checkpoint

        return checkpoint.restore_dbuffer(directory, mesh, placements, **kwargs)

    # -- geometry ------------------------------------------------------------------------------

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, pl.partition_spec(self.mesh, self.placements))

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def num_shards(self) -> int:
        return pl.num_shards(self.mesh, self.placements)

    @property
    def local_size(self) -> int:
        """Elements of each device's local buffer."""
        return self.layout.local_size(self.num_shards)

    def segments_of(self, device: jax.Device) -> range:
        """Layout segments held by ``device``, in local-buffer order."""
        pos = pl.device_position(self.mesh, device)
        return pl.segments_of_shard(self.mesh, self.placements, pl.shard_index(self.mesh, self.placements, pos))

    # -- reading -------------------------------------------------------------------------------

    def get_tensor(self, i: int) -> jax.Array:
        """Tensor ``i`` as a logical array: static slices of a replicated buffer.

        A sharded buffer is first all-gathered (one all-gather of the whole buffer); a buffer with
        Partial axes must be reduced first (``redistribute``).
        """
        checks.index(i, self.layout.num_tensors)
        self._check_no_partial("get_tensor")
        full = self if self.num_shards == 1 else self.allgather()
        return _unpack_one(self.layout, i, full.data)

    def get_tensors(self) -> list[jax.Array]:
        """Every tensor, as ``get_tensor`` gives it (one gather for all of them)."""
        self._check_no_partial("get_tensors")
        full = self if self.num_shards == 1 else self.allgather()
        return list(_unpack_all(self.layout, full.data))

    def local_tensor(self, i: int, device: jax.Device) -> np.ndarray:
        """Host copy of the rows of tensor ``i`` held by ``device``: ``[n_rows, *shape[1:]]``.

        The rows are ``layout.rows_in_segments(i, segs.start, segs.stop)`` for
        ``segs = self.segments_of(device)``; under Partial axes they are that device's addends.
        """
        checks.index(i, self.layout.num_tensors)
        if is_traced(self.data):
            raise TypeError("local_tensor inspects concrete device buffers; call it outside jit")
        segs = self.segments_of(device)
        local = next((s.data for s in self.data.addressable_shards if s.device == device), None)
        if local is None:
            raise ValueError(f"device {device} holds no addressable shard of this buffer")
        local = np.asarray(local)
        lay = self.layout
        parts = []
        for j, k in enumerate(segs):
            part = lay.overlap(i, k)
            if part is not None:
                (a, b), p = part, j * lay.segment_capacity + part[0] - lay.rank_segment_offsets[k]
                parts.append(local[p : p + b - a])
        shape = lay.tensor_shapes[i]
        flat = np.concatenate(parts) if parts else np.zeros((0,), local.dtype)
        return flat.reshape((-1, *shape[1:]))

    # -- movement ------------------------------------------------------------------------------

    def allgather(self, mesh_axes: str | int | Iterable[str | int] | None = None) -> DBuffer:
        """Gathers the given Shard axes (names or indices; default all): one all-gather.

        Only the outermost Shard axes can be gathered (the result must keep the suffix rule);
        they become ``Replicate``.
        """
        names = self._axis_names(mesh_axes)
        for n in names:
            p = self.placements[self.mesh.axis_names.index(n)]
            if not pl.is_shard(p):
                raise ValueError(f"allgather: mesh axis {n!r} has placement {p}, not a Shard placement")
        new = tuple(pl.Replicate() if n in names else p for n, p in zip(self.mesh.axis_names, self.placements))
        try:
            pl.validate_placements(self.mesh, new)
        except ValueError:
            raise ValueError(
                f"allgather({list(names)}) on placements {self.placements} would leave {new}; only "
                f"the outermost Shard axes can be gathered (Shard placements must stay a suffix)"
            ) from None
        return self.redistribute(new)

    def redistribute(self, placements: pl.Placements) -> DBuffer:
        """The same value under ``placements``; per mesh axis:

        Shard -> Replicate: all-gather; Partial -> Replicate: psum (pmean for avg);
        Partial -> Shard: psum_scatter; Replicate -> Shard: local slice;
        Replicate -> Partial: local (sum keeps the first device's copy, avg keeps all);
        Shard kinds (RowAtomic/BlockAtomic) change freely. Each kind of collective needed is one
        collective over all its axes and the whole local buffer.
        """
        new = pl.validate_placements(self.mesh, placements)
        _check_static(self.mesh, new, self.layout)
        if new == self.placements:
            return self
        plan = _plan(self.mesh, self.placements, new)
        if plan.is_metadata_only:
            return dataclasses.replace(self, placements=new)
        return DBuffer(_transition(plan)(self.data), self.mesh, new, self.layout)

    def view(self, placements: pl.Placements) -> DBuffer:
        """The same value under ``placements`` without any communication.

        Allowed per axis: unchanged; one Shard kind to another (same split); Replicate -> Shard
        (each device keeps its slice). Anything else raises; use ``redistribute``.
        """
        new = pl.validate_placements(self.mesh, placements)
        for name, old, p in zip(self.mesh.axis_names, self.placements, new):
            if not (
                old == p or (pl.is_shard(old) and pl.is_shard(p)) or (isinstance(old, pl.Replicate) and pl.is_shard(p))
            ):
                raise ValueError(
                    f"view cannot change mesh axis {name!r} from {old} to {p}: that needs "
                    f"communication; use redistribute"
                )
        return self.redistribute(new)

    def cast(self, dtype: DTypeLike) -> DBuffer:
        """The buffer converted elementwise to ``dtype`` on every device (no communication)."""
        if jnp.dtype(dtype) == self.dtype:
            return self
        fn = _cast(self.mesh, self.placements, jnp.dtype(dtype))
        return DBuffer(fn(self.data), self.mesh, self.placements, self.layout)

    # -- helpers -------------------------------------------------------------------------------

    def _check_no_partial(self, what: str) -> None:
        if any(pl.is_partial(p) for p in self.placements):
            raise ValueError(
                f"{what} needs a buffer without Partial placements, got {self.placements}; "
                f"redistribute to Replicate (or Shard) first"
            )

    def _axis_names(self, mesh_axes) -> tuple[str, ...]:
        names = tuple(self.mesh.axis_names)
        if mesh_axes is None:
            return pl.shard_axes(self.mesh, self.placements)
        if isinstance(mesh_axes, (str, int)):
            mesh_axes = (mesh_axes,)
        out = []
        for a in mesh_axes:
            if isinstance(a, (int, np.integer)) and not isinstance(a, bool) and 0 <= a < len(names):
                out.append(names[a])
            elif isinstance(a, str) and a in names:
                out.append(a)
            else:
                raise ValueError(f"mesh_axes entry {a!r} is neither an axis name nor an index of {names}")
        return tuple(n for n in names if n in out)  # mesh order


def _check_static(mesh: Mesh, placements, layout: GlobalLayout) -> None:
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


@functools.cache
def _transition(plan: _Plan):
    """The compiled per-device transition (cached: plans are hashable static values)."""
    return jax.jit(_shard_map_placements(plan.local_fn, plan.mesh, plan.old, plan.new))


@functools.cache
def _cast(mesh: Mesh, placements, dtype):
    return jax.jit(_shard_map_placements(lambda x: x.astype(dtype), mesh, placements, placements))


def _place(x, sharding: NamedSharding) -> jax.Array:
    """``x`` laid out as ``sharding``: a transfer when concrete, a constraint under jit."""
    if is_traced(x):
        return lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def _build_layout(mesh, placements, tensor_shapes, shard_layout, block_size) -> GlobalLayout:
    placements = pl.validate_placements(mesh, placements)
    block_size = checks.positive_int(block_size, "block_size")
    block = math.lcm(block_size, *(p.n for p in placements if isinstance(p, pl.BlockAtomic)))
    return GlobalLayout.build(tensor_shapes, mesh.size, block_size=block, shard_layout=shard_layout)


def _flat_buffer(layout: GlobalLayout, tensors, dtype, xp):
    """The physical flat array (``xp`` is numpy or jax.numpy): each segment's pieces in place,
    zeros elsewhere."""
    flats = [t.reshape(-1) for t in tensors]
    parts, cap = [], layout.segment_capacity
    for k in range(layout.dp_size):
        at = 0
        for i, row, n_rows, off in layout.pieces(k):
            if off > at:
                parts.append(xp.zeros((off - at,), dtype))
            rs = layout.row_size(i)
            parts.append(flats[i][row * rs : (row + n_rows) * rs])
            at = off + n_rows * rs
        if cap > at:
            parts.append(xp.zeros((cap - at,), dtype))
    return xp.concatenate(parts) if parts else xp.zeros((0,), dtype)


_flat_buffer_traced = jax.jit(functools.partial(_flat_buffer, xp=jnp), static_argnums=(0, 2))


def _unpack(layout: GlobalLayout, i: int, data: jax.Array) -> jax.Array:
    """Tensor ``i`` from a replicated physical buffer: its pieces in segment order."""
    parts = []
    for k in range(layout.dp_size):
        part = layout.overlap(i, k)
        if part is not None:
            p = layout.physical_offset(part[0], k)
            parts.append(data[p : p + part[1] - part[0]])
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return flat.reshape(layout.tensor_shapes[i])


_unpack_one = jax.jit(_unpack, static_argnums=(0, 1))


@functools.partial(jax.jit, static_argnums=0)
def _unpack_all(layout: GlobalLayout, data: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(_unpack(layout, i, data) for i in range(layout.num_tensors))


# ------------------------------------------------------------------------------------------------
# Logical tensors <-> flat buffer, on the devices
#
# One jitted ``shard_map`` program each way (``_to_logical_fn``, ``_to_flat_fn``): one all-to-all
# per sharded tensor (an all-gather per replicated one) over the Shard axes, and static
# per-shard slices, so no value passes through a host and no device holds the whole buffer.
# Floats move as their bits (same-width unsigned ints): exact for every payload (XLA:CPU computes
# bf16 concatenations in f32, which canonicalizes NaN payloads), and therefore not differentiable:
# these are for checkpoints and initialization, not for use inside a differentiated step.


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


def unpack_logical(buf: DBuffer) -> list[jax.Array]:
    """``buf``'s tensors as global arrays with ``logical_sharding``, moved device to device.

    ``buf`` must have no Partial axis (``DBuffer.logical_tensors`` reduces them). Exact: the
    bytes of every tensor equal ``get_tensors()``'s.
    """
    buf._check_no_partial("unpack_logical")
    return list(_to_logical_fn(buf.mesh, buf.placements, buf.layout, jnp.dtype(buf.dtype))(buf.data))


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
    _check_static(mesh, placements, layout)
    tensors = list(tensors)
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"pack_logical: {len(tensors)} tensors for a layout of {layout.num_tensors}")
    for i, (t, shape) in enumerate(zip(tensors, layout.tensor_shapes)):
        if tuple(np.shape(t)) != shape:
            raise ValueError(f"tensors[{i}] has shape {tuple(np.shape(t))}; the layout holds {shape}")
    placed = [_onto_mesh(t, mesh, placements, i) for i, t in enumerate(tensors)]
    return _to_flat_fn(mesh, placements, layout, jnp.dtype(dtype))(*placed)


def _is_distributed(t) -> bool:
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
        return jax.device_put(t, target)  # device to device
    raise ValueError(
        f"tensors[{i}] spans non-addressable devices outside the mesh {dict(mesh.shape)}; put it "
        f"on the mesh's devices first (jax.jit with out_shardings over that mesh)"
    )


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
    cap, n = layout.segment_capacity, pl.num_shards(mesh, placements)
    runs, first, count = [], [], []
    for s in range(n):
        segs = pl.segments_of_shard(mesh, placements, s)
        per = [[] for _ in range(layout.num_tensors)]
        for j, k in enumerate(segs):
            for i in range(layout.num_tensors):
                part = layout.overlap(i, k)
                if part is not None:
                    a, b = part
                    local = j * cap + a - layout.rank_segment_offsets[k]
                    per[i].append((local, a - layout.tensor_to_offset[i], b - a))
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


# ------------------------------------------------------------------------------------------------
# Planning a transition between placements


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What each device does to move from old to new placements (axes in mesh order)."""

    mesh: Mesh
    old: tuple[pl.Placement, ...]
    new: tuple[pl.Placement, ...]
    split: tuple[str, ...]  # new Shard axes that were not Shard: local buffer splits over them
    reduce_scatter: tuple[tuple[str, str], ...]  # (axis, op) among ``split`` from Partial
    reduce: tuple[tuple[str, str], ...]  # Partial -> Replicate
    gather: tuple[str, ...]  # Shard -> Replicate
    keep_first: tuple[str, ...]  # Replicate -> Partial("sum")

    @property
    def is_metadata_only(self) -> bool:
        return not (self.split or self.reduce or self.gather or self.keep_first)

    def local_fn(self, x):
        mesh = self.mesh
        if self.split:
            # Shard index digits over the split axes, innermost axis most significant.
            dims = [mesh.shape[n] for n in reversed(self.split)]  # innermost first
            chunk = x.shape[0] // math.prod(dims)
            x = x.reshape(*dims, chunk)
            scattered = dict(self.reduce_scatter)
            digits = tuple(reversed(self.split))
            for d in reversed(range(len(digits))):  # keep this device's Replicate -> Shard digits
                if digits[d] not in scattered:
                    idx = lax.axis_index(digits[d])
                    x = lax.dynamic_index_in_dim(x, idx, axis=d, keepdims=False)
            x = x.reshape(-1)
            if scattered:
                names = [n for n in self.split if n in scattered]
                x = lax.psum_scatter(x, spmd.axis_group(names), scatter_dimension=0, tiled=True)
                x = _avg(x, [n for n in names if scattered[n] == "avg"], mesh)
        if self.reduce:
            names = [n for n, _ in self.reduce]
            x = lax.psum(x, spmd.axis_group(names))
            x = _avg(x, [n for n, op in self.reduce if op == "avg"], mesh)
        if self.gather:
            x = spmd.all_gather_bits(x, spmd.axis_group(self.gather), axis=0)  # pure movement
        if self.keep_first:
            first = functools.reduce(jnp.logical_and, [lax.axis_index(n) == 0 for n in self.keep_first])
            x = jnp.where(first, x, jnp.zeros_like(x))
        return x


def _avg(x, names: list[str], mesh: Mesh):
    if not names:
        return x
    n = math.prod(mesh.shape[a] for a in names)
    return lax.div(x, jnp.asarray(n, x.dtype))


def _plan(mesh: Mesh, old, new) -> _Plan:
    split, rs, reduce, gather, keep_first = [], [], [], [], []
    for name, o, p in zip(mesh.axis_names, old, new):
        if o == p or (pl.is_shard(o) and pl.is_shard(p)):
            continue
        if pl.is_shard(o) and isinstance(p, pl.Replicate):
            gather.append(name)
        elif pl.is_partial(o) and isinstance(p, pl.Replicate):
            reduce.append((name, o.reduce_op))
        elif pl.is_partial(o) and pl.is_shard(p):
            split.append(name)
            rs.append((name, o.reduce_op))
        elif isinstance(o, pl.Replicate) and pl.is_shard(p):
            split.append(name)
        elif isinstance(o, pl.Replicate) and pl.is_partial(p):
            if p.reduce_op == "sum":
                keep_first.append(name)
        else:
            raise ValueError(
                f"redistribute cannot change mesh axis {name!r} from {o} to {p} (supported: "
                f"Shard->Replicate, Partial->Replicate, Partial->Shard, Replicate->Shard, "
                f"Replicate->Partial, Shard kind changes)"
            )
    return _Plan(mesh, tuple(old), tuple(new), tuple(split), tuple(rs), tuple(reduce), tuple(gather), tuple(keep_first))
