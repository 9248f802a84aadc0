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
from jax.sharding import Mesh, NamedSharding
from jax.typing import DTypeLike

from mxfp8_jax._src.buffers import checkpoint, logical, transition
from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.buffers.layout import GlobalLayout, ShardLayout
from mxfp8_jax._src.buffers.logical import check_static
from mxfp8_jax._src.core import checks, spmd
from mxfp8_jax._src.core.tracing import is_traced


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
        check_static(self.mesh, self.placements, self.layout)
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
        """A zero-filled buffer with an existing layout.

        Args:
          mesh, placements: where the buffer lives; one placement per mesh axis, Shard placements a
            suffix.
          layout: the packing; ``layout.dp_size == mesh.size``, at least one tensor, and
            ``layout.block_size`` a multiple of every ``BlockAtomic(n)``'s ``n``.
          dtype: the element type of ``data``.

        Returns:
          A ``DBuffer`` whose ``data`` is zeros of shape ``[layout.physical_size]`` and type ``dtype``,
          sharded as ``NamedSharding(mesh, partition_spec(mesh, placements))``.
        """
        placements = pl.validate_placements(mesh, placements)
        check_static(mesh, placements, layout)
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

        Args:
          mesh, placements: where the buffer lives, as in ``DBuffer.zeros``.
          tensor_shapes: at least one shape; each has at least one axis, positive dimensions, and
            ``shape[0]`` a multiple of the layout's block.
          dtype: the element type of ``data``.
          shard_layout: ``ShardLayout.PADDED`` or ``ShardLayout.UNPADDED`` (``GlobalLayout.build``).
          block_size: a positive number of rows per block.

        Returns:
          A zero-filled ``DBuffer`` (``DBuffer.zeros``) over the built layout.
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

        Args:
          tensors: at least one array (host or ``jax.Array``), each with at least one axis; with
            ``layout``, their shapes must equal ``layout.tensor_shapes``.
          mesh, placements: where the buffer lives, as in ``DBuffer.zeros``.
          dtype: the buffer's element type (default ``jnp.result_type`` of ``tensors``).
          shard_layout, block_size: how to build the layout, as in ``DBuffer.empty``; unused when
            ``layout`` is given.
          layout: an existing packing of the tensors (``dp_size == mesh.size``).

        Returns:
          A ``DBuffer`` under ``placements`` whose logical tensors are ``tensors`` cast to ``dtype``.
        """
        tensors = list(tensors)
        shapes = [tuple(np.shape(t)) for t in tensors]
        if layout is None:
            layout = _build_layout(mesh, placements, shapes, shard_layout, block_size)
        elif tuple(shapes) != layout.tensor_shapes:
            raise ValueError(f"tensor shapes {shapes} differ from layout.tensor_shapes {layout.tensor_shapes}")
        placements = pl.validate_placements(mesh, placements)
        check_static(mesh, placements, layout)
        if dtype is None:
            dtype = jnp.result_type(*tensors) if tensors else jnp.float32
        dtype = jnp.dtype(dtype)
        base = tuple(pl.Replicate() if pl.is_partial(p) else p for p in placements)
        if is_traced(*tensors):  # under jit: pack in the graph
            flat = _flat_buffer_traced(layout, [jnp.asarray(t).astype(dtype) for t in tensors], dtype)
            flat = _place(flat, NamedSharding(mesh, pl.partition_spec(mesh, base)))
        elif any(logical.is_distributed(t) for t in tensors):  # sharded arrays: device to device
            flat = logical.pack_logical(tensors, mesh, base, layout, dtype)
        else:  # host values or whole single-device arrays: pack on the host, one transfer
            flat = _flat_buffer(layout, [np.asarray(t).astype(dtype) for t in tensors], dtype, np)
            flat = _place(flat, NamedSharding(mesh, pl.partition_spec(mesh, base)))
        return cls(flat, mesh, base, layout).redistribute(placements)

    # -- logical content and checkpoints -------------------------------------------------------

    def logical_tensors(self) -> list[jax.Array]:
        """Every tensor as a global ``jax.Array`` with ``logical_sharding`` (``unpack_logical``).

        Partial axes are reduced first (the buffer's value). Runs on the devices: no host copy.

        Returns:
          A list with one array per tensor, in layout order: shape ``layout.tensor_shapes[i]``, the
          buffer's dtype, and ``logical_sharding`` over ``mesh`` and the placements with Partial
          axes replaced by ``Replicate``.
        """
        reduced = tuple(pl.Replicate() if pl.is_partial(p) else p for p in self.placements)
        buf = self.redistribute(reduced)
        return logical.unpack_logical(buf.data, buf.mesh, buf.placements, buf.layout)

    def save(
        self,
        directory,
        *,
        names: Sequence[str] | None = None,
        metadata=None,
        async_save: bool = False,
        overwrite: bool = False,
    ) -> checkpoint.SaveHandle:
        """Writes the logical tensors to ``directory`` (``checkpoint.save_logical``).

        The value is saved (Partial axes reduced); the mesh, placements and layout are not.

        Args:
          directory: a path that does not exist yet (unless ``overwrite``).
          names: one name per tensor (default ``"0"``, ``"1"``, ...).
          metadata: JSON-serializable caller metadata, stored under ``"user"`` beside
            ``{"kind": "DBuffer"}``.
          async_save: return once the device buffers are copied out; the files are written in
            the background.
          overwrite: replace an existing checkpoint at ``directory``.

        Returns:
          A ``SaveHandle``; ``wait()`` on it before relying on an asynchronous save.
        """
        names = checkpoint.tensor_names(names, self.layout.num_tensors)
        meta = dict(kind="DBuffer", user=dict(metadata or {}))
        tensors = dict(zip(names, self.logical_tensors()))
        return checkpoint.save_logical(directory, tensors, meta, async_save=async_save, overwrite=overwrite)

    @classmethod
    def restore(
        cls,
        directory,
        mesh: Mesh,
        placements: pl.Placements,
        *,
        names: Sequence[str] | None = None,
        layout: GlobalLayout | None = None,
        shard_layout: ShardLayout = ShardLayout.PADDED,
        block_size: int = 1,
        dtype: DTypeLike | None = None,
    ) -> DBuffer:
        """A buffer over ``mesh``/``placements`` holding a checkpoint's tensors, by name, on any
        mesh and layout.

        Args:
          directory: a checkpoint written by ``DBuffer.save`` (or ``QuantizedDBuffer.save``).
          mesh, placements: where the new buffer lives.
          names: the new buffer's tensor order; exactly the stored names (default: the
            checkpoint's, in saved order).
          layout: the new buffer's packing (``dp_size == mesh.size``); default: built from
            ``shard_layout`` and ``block_size`` as ``DBuffer.empty`` builds it.
          dtype: cast on the devices (default: the stored dtype).

        Returns:
          The ``DBuffer``; its logical tensors equal the saved ones byte for byte.
        """
        info = checkpoint.read_metadata(directory)
        names = info.names if names is None else checkpoint.tensor_names(names, None)
        checkpoint.check_names(info, names, where=checkpoint.as_path(directory))
        shapes = [info[n].shape for n in names]
        stored = {info[n].dtype for n in names}
        if len(stored) > 1:
            raise ValueError(f"the checkpoint's tensors have several dtypes {sorted(d.name for d in stored)}")
        src = stored.pop() if stored else jnp.dtype(jnp.float32)
        placements = pl.validate_placements(mesh, placements)
        if layout is None:
            layout = _build_layout(mesh, placements, shapes, shard_layout, block_size)
        elif tuple(shapes) != layout.tensor_shapes:
            pairs = zip(names, shapes, layout.tensor_shapes)
            bad = [f"{n!r}: stored {s}, layout {ls}" for n, s, ls in pairs if s != ls]
            raise ValueError("layout.tensor_shapes differ from the checkpoint's: " + "; ".join(bad))
        base = tuple(pl.Replicate() if pl.is_partial(p) else p for p in placements)
        targets = {
            n: jax.ShapeDtypeStruct(s, src, sharding=logical.logical_sharding(mesh, base, s))
            for n, s in zip(names, shapes)
        }
        arrays = checkpoint.restore_logical(directory, targets)
        flat = logical.pack_logical([arrays[n] for n in names], mesh, base, layout, src if dtype is None else dtype)
        return cls(flat, mesh, base, layout).redistribute(placements)

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
        """Layout segments held by ``device``, in local-buffer order.

        Args:
          device: a ``jax.Device`` of ``mesh``.

        Returns:
          A ``range`` of segment indices: ``segments_of_shard`` of the shard the device holds.
        """
        pos = pl.device_position(self.mesh, device)
        return pl.segments_of_shard(self.mesh, self.placements, pl.shard_index(self.mesh, self.placements, pos))

    # -- reading -------------------------------------------------------------------------------

    def get_tensor(self, i: int) -> jax.Array:
        """Tensor ``i`` as a logical array: static slices of a replicated buffer.

        A sharded buffer is first all-gathered (one all-gather of the whole buffer); a buffer with
        Partial axes must be reduced first (``redistribute``).

        Args:
          i: the tensor index, in ``[0, layout.num_tensors)``.

        Returns:
          A ``jax.Array`` of shape ``layout.tensor_shapes[i]`` and the buffer's dtype.
        """
        checks.index(i, self.layout.num_tensors)
        self._check_no_partial("get_tensor")
        full = self if self.num_shards == 1 else self.allgather()
        return _unpack_one(self.layout, i, full.data)

    def get_tensors(self) -> list[jax.Array]:
        """Every tensor, as ``get_tensor`` gives it (one gather for all of them).

        Returns:
          A list with one ``jax.Array`` per tensor, in layout order, each of shape
          ``layout.tensor_shapes[i]``.
        """
        self._check_no_partial("get_tensors")
        full = self if self.num_shards == 1 else self.allgather()
        return list(_unpack_all(self.layout, full.data))

    def local_tensor(self, i: int, device: jax.Device) -> np.ndarray:
        """Host copy of the rows of tensor ``i`` held by ``device``: ``[n_rows, *shape[1:]]``.

        The rows are ``layout.rows_in_segments(i, segs.start, segs.stop)`` for
        ``segs = self.segments_of(device)``; under Partial axes they are that device's addends.

        Args:
          i: the tensor index, in ``[0, layout.num_tensors)``.
          device: a ``jax.Device`` of ``mesh`` whose shard is addressable in this process. The
            buffer must be concrete (not traced).

        Returns:
          A ``np.ndarray`` of the buffer's dtype, ``[n_rows, *shape[1:]]`` with ``shape =
          layout.tensor_shapes[i]``; ``n_rows`` is 0 when the device holds none of the tensor.
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
                (a, b), p = part, lay.local_offset(part[0], k, j)
                parts.append(local[p : p + b - a])
        shape = lay.tensor_shapes[i]
        flat = np.concatenate(parts) if parts else np.zeros((0,), local.dtype)
        return flat.reshape((-1, *shape[1:]))

    # -- movement ------------------------------------------------------------------------------

    def allgather(self, mesh_axes: str | int | Iterable[str | int] | None = None) -> DBuffer:
        """Gathers the given Shard axes (names or indices; default all): one all-gather.

        Only the outermost Shard axes can be gathered (the result must keep the suffix rule);
        they become ``Replicate``.

        Args:
          mesh_axes: a mesh axis name or index, or an iterable of them; each must have a Shard
            placement. ``None`` gathers every Shard axis.

        Returns:
          A ``DBuffer`` with the same value, those axes ``Replicate`` and the others unchanged.
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

        Args:
          placements: the target, one per mesh axis (Shard placements a suffix); every
            ``BlockAtomic(n)`` needs ``layout.block_size % n == 0``.

        Returns:
          A ``DBuffer`` with the same mesh, layout and dtype under ``placements`` (``self`` when they
          are the current ones).
        """
        new = pl.validate_placements(self.mesh, placements)
        check_static(self.mesh, new, self.layout)
        if new == self.placements:
            return self
        plan = transition.plan(self.mesh, self.placements, new)
        if plan.is_metadata_only:
            return dataclasses.replace(self, placements=new)
        return DBuffer(transition.compiled(plan)(self.data), self.mesh, new, self.layout)

    def view(self, placements: pl.Placements) -> DBuffer:
        """The same value under ``placements`` without any communication.

        Allowed per axis: unchanged; one Shard kind to another (same split); Replicate -> Shard
        (each device keeps its slice). Anything else raises; use ``redistribute``.

        Args:
          placements: the target, one per mesh axis, each reachable from the current one as above.

        Returns:
          A ``DBuffer`` with the same value under ``placements`` (``redistribute``'s result).
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
        """The buffer converted elementwise to ``dtype`` on every device (no communication).

        Args:
          dtype: the new element type.

        Returns:
          A ``DBuffer`` with the same mesh, placements and layout whose ``data`` is ``dtype``
          (``self`` when the dtype is already ``dtype``).
        """
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


@functools.cache
def _cast(mesh: Mesh, placements, dtype):
    spec = pl.partition_spec(mesh, placements)
    return jax.jit(spmd.shard_map(lambda x: x.astype(dtype), mesh, spec, spec))


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
