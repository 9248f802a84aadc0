"""QuantizedDBuffer: MXFP8 weights for FSDP as four sharded uint8 planes (docs/design.md §4).

Planes, each a ``DBuffer`` over one mesh (``None`` once released):

- ``rowwise_data``, ``columnwise_data``: E4M3 bytes in the data layout ``L``;
- ``rowwise_scale``: E8M0 bytes in ``L`` with every coordinate divided by 32 (tensor ``[M, K]``
  becomes ``[M, K/32]`` at offset ``o/32``), same placements;
- ``columnwise_scale``: the same division (``[M/32, K]`` at ``o/32``), placements with
  ``BlockAtomic`` mapped to ``RowAtomic`` (one scale row stands for a 32-row data block).

Every tensor is 2-D with M and K multiples of 32 and ``L.block_size == 32``, so each device holds
whole 1x32 and 32x1 blocks: quantizing the local segment equals quantizing globally, with no
cross-device amax. ``quantize`` therefore runs inside ``jax.shard_map`` with no communication.
Each device's local buffer packs different tensor pieces, but the SPMD program is the same on
every device: a static per-shard descriptor table (rows ``(offset, rows, row_len)``), indexed by
the device's shard position, drives ONE ``mxfp8_quantize_segments`` kernel call over the whole
segment (``backend="ffi"``), or the same descriptor logic written as jnp index maps (``"jax"``).

The two directions move independently: the forward pass gathers the rowwise planes, the backward
the columnwise ones (gathering both costs 16.5 bits per element, more than bf16). A direction's
planes share its placements (``rowwise_placements``, ``columnwise_placements``); the two may differ
after ``redistribute``/``allgather`` of one direction only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from mxfp8_jax._src.buffers import checkpoint
from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.buffers.dbuffer import DBuffer
from mxfp8_jax._src.buffers.directions import (
    COLUMNWISE,
    ROWWISE,
    Direction,
    check_mxfp8_layout,
    check_mxfp8_shapes,
    check_placements,
    quantize_program,
    zeros_program,
)
from mxfp8_jax._src.buffers.layout import GlobalLayout, ShardLayout
from mxfp8_jax._src.core import checks
from mxfp8_jax._src.kernels import backend as backends
from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.numerics.format import BLOCK
from mxfp8_jax._src.numerics.tensor import MXFP8Tensor, PaddedMXFP8Tensor
from mxfp8_jax._src.ops.quantize import INPUT_DTYPES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedDBuffer:
    """MXFP8 planes of N packed 2-D tensors over one mesh, as two ``Direction``s.

    ``rowwise`` and ``columnwise`` each hold a data and a scale plane (or neither, released)
    and the placements of their data; ``rowwise_data``, ``rowwise_placements`` and the other
    plane names read them. Invariants (checked by ``_validate``): ``layout`` obeys
    ``check_mxfp8_layout`` and has ``dp_size == mesh.size``; present planes are uint8
    ``DBuffer``s over ``mesh`` with layouts ``layout`` (data), ``rowwise_scale_layout(layout)``,
    ``columnwise_scale_layout(layout)`` and the direction's placements (columnwise scale:
    BlockAtomic mapped to RowAtomic); no placement is ``Partial`` (bytes are not addends).
    """

    rowwise: Direction
    columnwise: Direction
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    layout: GlobalLayout = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        for kind, d in ((ROWWISE, self.rowwise), (COLUMNWISE, self.columnwise)):
            if not isinstance(d, Direction) or d.kind != kind:
                raise TypeError(f"{kind} must be a Direction of kind {kind!r}, got {d!r}")
            placements = check_placements(self.mesh, d.placements, f"{kind}_placements")
            object.__setattr__(self, kind, dataclasses.replace(d, placements=placements))
        self._validate()

    def _validate(self) -> None:
        check_mxfp8_layout(self.layout)
        if self.layout.dp_size != self.mesh.size:
            raise ValueError(
                f"layout.dp_size={self.layout.dp_size} must equal mesh.size={self.mesh.size} "
                f"(one layout segment per device)"
            )
        for d in self.directions:
            if (d.data is None) != (d.scale is None):
                raise ValueError(f"{d.kind} data and scale planes must both be present or both be None")
        for d in self.directions:
            for name, plane, (layout, placements) in zip(
                (f"{d.kind}_data", f"{d.kind}_scale"), (d.data, d.scale), d.geometry(self.layout)
            ):
                if plane is not None:
                    self._check_plane(name, plane, layout, placements)

    def _check_plane(self, name: str, plane, layout: GlobalLayout, placements) -> None:
        if not isinstance(plane, DBuffer):
            raise TypeError(f"{name} must be a DBuffer or None, got {type(plane).__name__}")
        if plane.mesh != self.mesh:
            raise ValueError(
                f"{name} is on another mesh than the buffer: "
                f"{checks.mesh_difference(plane.mesh, self.mesh)} (the plane's vs the buffer's)"
            )
        if plane.layout != layout or plane.placements != placements:
            raise ValueError(
                f"{name} does not match the buffer: need placements {placements} and layout "
                f"{layout}, got placements {plane.placements} and layout {plane.layout}"
            )
        if isinstance(plane.data, jax.Array) and jnp.dtype(plane.data.dtype) != jnp.uint8:
            raise TypeError(f"{name} must hold uint8 bytes, got {jnp.dtype(plane.data.dtype)}")

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def empty(
        cls,
        mesh: Mesh,
        placements: pl.Placements,
        tensor_shapes: Iterable[Sequence[int]],
        *,
        shard_layout: ShardLayout = ShardLayout.PADDED,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> QuantizedDBuffer:
        """Zero-filled planes for 2-D ``tensor_shapes`` (M, K multiples of 32), layout built here.

        The layout has ``dp_size = mesh.size`` and ``block_size = 32``; build the master weights
        on it (``DBuffer.distribute_tensors(..., layout=qbuf.layout)``) so ``quantize`` accepts them.

        Args:
          mesh: the device mesh; the layout has one segment per device.
          placements: the data placements of both directions, one per mesh axis; no ``Partial``,
            and ``BlockAtomic(n)`` needs ``n`` dividing 32.
          tensor_shapes: the ``[M, K]`` shapes of the packed tensors.
          shard_layout: the packing of the layout (``GlobalLayout.build``).
          rowwise, columnwise: allocate that direction's planes; an unselected direction starts
            released.

        Returns:
          The new ``QuantizedDBuffer``, as ``zeros`` gives it over the built layout.
        """
        tensor_shapes = [tuple(s) for s in tensor_shapes]
        check_mxfp8_shapes(tensor_shapes)
        placements = check_placements(mesh, placements, "placements")
        for j, p in enumerate(placements):
            if isinstance(p, pl.BlockAtomic) and BLOCK % p.n:
                raise ValueError(
                    f"placements[{j}]={p}: an MXFP8 buffer's layout has 32-row blocks, so "
                    f"BlockAtomic(n) needs n dividing 32"
                )
        layout = GlobalLayout.build(tensor_shapes, mesh.size, block_size=BLOCK, shard_layout=shard_layout)
        return cls.zeros(mesh, placements, layout, rowwise=rowwise, columnwise=columnwise)

    @classmethod
    def zeros(
        cls,
        mesh: Mesh,
        placements: pl.Placements,
        layout: GlobalLayout,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> QuantizedDBuffer:
        """Zero-filled planes over an existing MXFP8 layout (``check_mxfp8_layout``).

        Args:
          mesh: the device mesh; ``layout.dp_size`` must equal ``mesh.size``.
          placements: the data placements of both directions, one per mesh axis; no ``Partial``.
          layout: the MXFP8 data layout (``block_size == 32``, ``[M, K]`` tensors with M and K
            multiples of 32, segment bounds multiples of 32).
          rowwise, columnwise: allocate that direction's planes; an unselected direction starts
            released.

        Returns:
          The new ``QuantizedDBuffer``, its allocated planes uint8 zeros.
        """
        check_mxfp8_layout(layout)
        placements = check_placements(mesh, placements, "placements")
        released = cls(
            rowwise=Direction(data=None, scale=None, kind=ROWWISE, placements=placements),
            columnwise=Direction(data=None, scale=None, kind=COLUMNWISE, placements=placements),
            mesh=mesh,
            layout=layout,
        )
        return released.reallocate_storage(rowwise=rowwise, columnwise=columnwise)

    @classmethod
    def from_planes(
        cls,
        *,
        rowwise_data: DBuffer | None,
        rowwise_scale: DBuffer | None,
        columnwise_data: DBuffer | None,
        columnwise_scale: DBuffer | None,
        mesh: Mesh,
        layout: GlobalLayout,
        rowwise_placements: pl.Placements,
        columnwise_placements: pl.Placements,
    ) -> QuantizedDBuffer:
        """A buffer from existing planes (``None`` for a released direction), checked against
        ``layout`` and the placements as every buffer is.

        Args:
          rowwise_data, rowwise_scale, columnwise_data, columnwise_scale: uint8 ``DBuffer``s of
            the geometry the class docstring gives, or ``None`` (a direction's two together).
          mesh, layout: the buffer's mesh and MXFP8 data layout.
          rowwise_placements, columnwise_placements: each direction's data placements.

        Returns:
          The ``QuantizedDBuffer``; a plane of the wrong mesh, layout, placements or dtype raises.
        """
        return cls(
            rowwise=Direction(
                data=rowwise_data, scale=rowwise_scale, kind=ROWWISE, placements=tuple(rowwise_placements)
            ),
            columnwise=Direction(
                data=columnwise_data, scale=columnwise_scale, kind=COLUMNWISE, placements=tuple(columnwise_placements)
            ),
            mesh=mesh,
            layout=layout,
        )

    # -- structure -----------------------------------------------------------------------------

    @property
    def directions(self) -> tuple[Direction, Direction]:
        """``(self.rowwise, self.columnwise)``."""
        return self.rowwise, self.columnwise

    @property
    def rowwise_data(self) -> DBuffer | None:
        return self.rowwise.data

    @property
    def rowwise_scale(self) -> DBuffer | None:
        return self.rowwise.scale

    @property
    def columnwise_data(self) -> DBuffer | None:
        return self.columnwise.data

    @property
    def columnwise_scale(self) -> DBuffer | None:
        return self.columnwise.scale

    @property
    def rowwise_placements(self) -> tuple[pl.Placement, ...]:
        return self.rowwise.placements

    @property
    def columnwise_placements(self) -> tuple[pl.Placement, ...]:
        return self.columnwise.placements

    @property
    def placements(self) -> tuple[pl.Placement, ...]:
        """The weight placements, when both directions share them."""
        if self.rowwise_placements != self.columnwise_placements:
            raise ValueError(
                f"the directions have different placements (rowwise {self.rowwise_placements}, "
                f"columnwise {self.columnwise_placements}); read rowwise_placements or "
                f"columnwise_placements"
            )
        return self.rowwise_placements

    @property
    def planes(self) -> tuple[DBuffer | None, DBuffer | None, DBuffer | None, DBuffer | None]:
        """``(rowwise_data, columnwise_data, rowwise_scale, columnwise_scale)``; released are None."""
        return self.rowwise_data, self.columnwise_data, self.rowwise_scale, self.columnwise_scale

    def planes_for(self, *, rowwise: bool, columnwise: bool) -> tuple[DBuffer, ...]:
        """The data and scale planes of the selected directions, in ``planes`` order.

        Args:
          rowwise, columnwise: include that direction's planes; at least one must be selected,
            and a selected direction must be allocated (ValueError otherwise).

        Returns:
          A tuple of ``DBuffer``s: the selected ones of ``(rowwise_data, columnwise_data,
          rowwise_scale, columnwise_scale)``.
        """
        self._require(rowwise, columnwise, "planes_for")
        keep = (rowwise, columnwise, rowwise, columnwise)
        return tuple(p for p, k in zip(self.planes, keep) if k)

    @property
    def is_rowwise_allocated(self) -> bool:
        return self.rowwise.allocated

    @property
    def is_columnwise_allocated(self) -> bool:
        return self.columnwise.allocated

    @property
    def num_tensors(self) -> int:
        return self.layout.num_tensors

    # -- storage lifecycle ---------------------------------------------------------------------

    def release_storage(self, *, rowwise_only: bool = False) -> QuantizedDBuffer:
        """Planes dropped (``None``): all of them, or only the rowwise pair.

        The memory is freed when the last reference to the old arrays dies.

        Args:
          rowwise_only: drop only the rowwise data and scale planes, keeping the columnwise ones.

        Returns:
          A new ``QuantizedDBuffer`` with the dropped planes ``None``; every direction keeps its
          placements.
        """
        columnwise = self.columnwise if rowwise_only else self.columnwise.released()
        return dataclasses.replace(self, rowwise=self.rowwise.released(), columnwise=columnwise)

    def reallocate_storage(self, *, rowwise: bool = True, columnwise: bool = True) -> QuantizedDBuffer:
        """Released planes of the selected directions back, zero-filled (contents undefined until
        re-quantized or re-gathered); allocated planes are kept as they are.

        Args:
          rowwise, columnwise: reallocate that direction's planes if released, at the placements
            the direction kept.

        Returns:
          The buffer with the selected directions allocated; ``self`` when none was released.
        """
        missing = [d for d in self._chosen(rowwise, columnwise) if not d.allocated]
        if not missing:
            return self
        geometries = tuple(g for d in missing for g in d.geometry(self.layout))
        arrays = iter(zeros_program(self.mesh, geometries)())
        return dataclasses.replace(self, **{d.kind: self._filled(d, arrays) for d in missing})

    # -- quantization --------------------------------------------------------------------------

    def quantize(self, main_weight: DBuffer, *, scale_rule: str = "rceil", backend: str = "auto") -> QuantizedDBuffer:
        """Every allocated plane recomputed from ``main_weight``, locally (no communication).

        ``main_weight`` (f32/bf16/f16) must have this buffer's mesh, layout and the placements
        of each allocated direction. Functional form of Megatron's ``quantize_``: returns the new
        buffer; released planes stay released.

        Args:
          main_weight: the master weights, a bf16, fp16 or fp32 ``DBuffer`` with this buffer's
            mesh and layout and the placements of every allocated direction.
          scale_rule: ``"rceil"`` or ``"floor"`` (``ScaleRule``).
          backend: ``"auto"``, ``"ffi"`` or ``"jax"``, as for ``quantize``.

        Returns:
          A new ``QuantizedDBuffer`` whose allocated planes hold the quantized ``main_weight``;
          with every plane released this raises ValueError.
        """
        if not isinstance(main_weight, DBuffer):
            raise TypeError(f"main_weight must be a DBuffer, got {type(main_weight).__name__}")
        rule = fmt.ScaleRule.parse(scale_rule)
        backends.check(backend)
        rowwise, columnwise = self.is_rowwise_allocated, self.is_columnwise_allocated
        if not (rowwise or columnwise):
            raise ValueError("quantize: no plane is allocated; call reallocate_storage() first")
        if main_weight.mesh != self.mesh:
            raise ValueError(
                f"main_weight.mesh must be this buffer's mesh; they differ in "
                f"{checks.mesh_difference(main_weight.mesh, self.mesh)} (main_weight's vs this buffer's)"
            )
        for d in self.directions:
            if d.allocated and main_weight.placements != d.placements:
                raise ValueError(
                    f"main_weight.placements={main_weight.placements} must equal the {d.kind} "
                    f"placements {d.placements} of this buffer (quantize does not communicate)"
                )
        if main_weight.layout != self.layout:
            raise ValueError(
                "main_weight.layout differs from this buffer's layout; build the master weights "
                "with DBuffer.distribute_tensors(..., layout=qbuf.layout) (got "
                f"{main_weight.layout}, need {self.layout})"
            )
        dt = jnp.dtype(main_weight.dtype)
        if dt not in [jnp.dtype(d) for d in INPUT_DTYPES]:
            raise TypeError(f"main_weight has dtype {dt}; MXFP8 quantize takes bfloat16, float16 or float32")
        fn = quantize_program(
            self.mesh,
            main_weight.placements,
            self.layout,
            rule,
            rowwise,
            columnwise,
            backend,
            bool(jax.config.jax_enable_x64),
        )
        outs = iter(fn(main_weight.data))  # rowwise data, scale, then columnwise's, as allocated
        return dataclasses.replace(self, **{d.kind: self._filled(d, outs) for d in self.directions if d.allocated})

    # -- checkpoints ---------------------------------------------------------------------------

    def save(
        self,
        directory,
        master: DBuffer,
        *,
        scale_rule: str = "rceil",
        names: Sequence[str] | None = None,
        metadata=None,
        async_save: bool = False,
        overwrite: bool = False,
    ) -> checkpoint.SaveHandle:
        """Saves the master weights this buffer was quantized from; the planes are not stored,
        ``restore`` recomputes them.

        Args:
          directory: a path that does not exist yet (unless ``overwrite``).
          master: the weights the planes were quantized from (this buffer's mesh and layout).
          scale_rule: the rule the planes were quantized with; stored, with the allocated
            directions, so that ``restore`` quantizes alike.
          names, metadata, async_save, overwrite: as for ``DBuffer.save``.

        Returns:
          A ``SaveHandle``; ``wait()`` on it before relying on an asynchronous save.
        """
        if not isinstance(master, DBuffer):
            raise TypeError(f"master must be a DBuffer, got {type(master).__name__}")
        if master.layout != self.layout or master.mesh != self.mesh:
            raise ValueError(
                "master must have the QuantizedDBuffer's mesh and layout (the weights it was quantized from)"
            )
        rule = fmt.ScaleRule.parse(scale_rule)
        names = checkpoint.tensor_names(names, self.layout.num_tensors)
        meta = dict(
            kind="QuantizedDBuffer",
            scale_rule=rule.value,
            rowwise=self.is_rowwise_allocated,
            columnwise=self.is_columnwise_allocated,
            user=dict(metadata or {}),
        )
        tensors = dict(zip(names, master.logical_tensors()))
        return checkpoint.save_logical(directory, tensors, meta, async_save=async_save, overwrite=overwrite)

    @classmethod
    def restore(
        cls,
        directory,
        mesh: Mesh,
        placements: pl.Placements,
        *,
        names: Sequence[str] | None = None,
        shard_layout: ShardLayout = ShardLayout.PADDED,
        dtype=None,
        backend: str = "auto",
    ) -> tuple[DBuffer, QuantizedDBuffer]:
        """The master weights and their planes, on any mesh and layout.

        Args:
          directory: a checkpoint written by ``QuantizedDBuffer.save``.
          mesh, placements: where the restored buffers live.
          names: the tensor order (exactly the stored names; default the saved order).
          shard_layout: the packing of the new MXFP8 layout (``block_size = 32``).
          dtype: the master's dtype (default: the stored one).
          backend: the quantize backend for the planes.

        Returns:
          ``(master, qbuf)``: the master restored as ``DBuffer.restore`` does, and the planes
          allocated at save time quantized from it with the stored scale rule.
        """
        meta = checkpoint.read_metadata(directory).metadata
        if meta.get("kind") != "QuantizedDBuffer":
            raise ValueError(f"{directory} holds a {meta.get('kind')!r} checkpoint, not a QuantizedDBuffer's")
        master = DBuffer.restore(
            directory, mesh, placements, names=names, shard_layout=shard_layout, block_size=BLOCK, dtype=dtype
        )
        qbuf = cls.zeros(
            mesh, placements, master.layout, rowwise=bool(meta["rowwise"]), columnwise=bool(meta["columnwise"])
        )
        return master, qbuf.quantize(master, scale_rule=meta["scale_rule"], backend=backend)

    # -- reading -------------------------------------------------------------------------------

    def get_tensor_view(self, i: int, *, rowwise: bool | None = None, columnwise: bool | None = None) -> MXFP8Tensor:
        """Tensor ``i`` as a compact, unswizzled ``MXFP8Tensor``.

        A direction is included when selected (``True``), or by default (``None``) when its planes
        are allocated and replicated along the flat dimension (gathered): after
        ``allgather(rowwise=True, columnwise=False)`` the view holds the rowwise planes only.
        A selected direction must be allocated and gathered; at least one must be included.

        Args:
          i: the tensor's index in ``layout``.
          rowwise, columnwise: ``True`` to include that direction, ``False`` to leave it out,
            ``None`` to include it when it is gathered.

        Returns:
          An ``MXFP8Tensor`` of shape ``layout.tensor_shapes[i]`` and nominal dtype bfloat16, with
          E4M3 data ``[M, K]`` and uint8 scales; planes left out are ``None``.
        """
        checks.index(i, self.layout.num_tensors)
        planes = {}
        selected = {ROWWISE: rowwise, COLUMNWISE: columnwise}  # True, False or None (if gathered)
        for d in self.directions:
            kind, sel = d.kind, selected[d.kind]
            gathered = d.data is not None and d.data.num_shards == 1
            if sel and not gathered:
                state = "released" if d.data is None else f"sharded ({d.placements})"
                raise ValueError(
                    f"get_tensor_view({i}, {kind}=True): the {kind} planes are {state}; "
                    f"allgather them first, or use local_tensor_view for one device's rows"
                )
            include = sel is not False and gathered
            data = lax.bitcast_convert_type(d.data.get_tensor(i), jnp.float8_e4m3fn) if include else None
            planes[f"{kind}_data"], planes[f"{kind}_scale"] = data, d.scale.get_tensor(i) if include else None
        if planes["rowwise_data"] is None and planes["columnwise_data"] is None:
            raise ValueError(
                f"get_tensor_view({i}): no allocated plane is gathered (rowwise "
                f"{self.rowwise_placements}, columnwise {self.columnwise_placements}); allgather "
                f"first, or use local_tensor_view for one device's rows"
            )
        return MXFP8Tensor(**planes, shape=self.layout.tensor_shapes[i], dtype=jnp.bfloat16)

    def get_tensor(self, i: int, *, rowwise: bool | None = None, columnwise: bool | None = None) -> PaddedMXFP8Tensor:
        """``get_tensor_view`` with the scales in the padded shapes an MXFP8 GEMM takes
        (``MXFP8Tensor.padded``).

        Args:
          i: the tensor's index in ``layout``.
          rowwise, columnwise: as for ``get_tensor_view``.

        Returns:
          A ``PaddedMXFP8Tensor``: data ``[M, K]`` as is, scales padded with 0 (unswizzled);
          planes left out are ``None``.
        """
        return self.get_tensor_view(i, rowwise=rowwise, columnwise=columnwise).padded()

    def local_tensor_view(self, i: int, device: jax.Device) -> MXFP8Tensor:
        """Host copy of the rows of tensor ``i`` that ``device`` holds, as a compact MXFP8Tensor.

        Shape ``[n_rows, K]`` (``n_rows`` may be 0); scales ``[n_rows, K/32]``/``[n_rows/32, K]``.
        The planes of a released direction are None; with both released this raises.

        Args:
          i: the tensor's index in ``layout``.
          device: a device of the mesh that holds an addressable shard; concrete buffers only
            (not under ``jit``).

        Returns:
          An ``MXFP8Tensor`` of numpy arrays (data ``float8_e4m3fn``, scales uint8), shape
          ``(n_rows, K)``, nominal dtype bfloat16.
        """
        checks.index(i, self.layout.num_tensors)
        if not (self.is_rowwise_allocated or self.is_columnwise_allocated):
            raise ValueError(
                f"local_tensor_view({i}): every plane is released (release_storage); "
                f"reallocate_storage() and quantize first"
            )
        planes = {}
        for name, plane in zip(("rowwise_data", "columnwise_data", "rowwise_scale", "columnwise_scale"), self.planes):
            planes[name] = None if plane is None else plane.local_tensor(i, device)
        for name in ("rowwise_data", "columnwise_data"):
            if planes[name] is not None:
                planes[name] = planes[name].view(jnp.float8_e4m3fn)
        data = next(d for d in (planes["rowwise_data"], planes["columnwise_data"], np.zeros((0,))) if d is not None)
        k = self.layout.tensor_shapes[i][1]
        return MXFP8Tensor(**planes, shape=(data.size // k, k), dtype=jnp.bfloat16)

    # -- movement ------------------------------------------------------------------------------

    def view(self, placements: pl.Placements) -> QuantizedDBuffer:
        """Every plane under ``placements`` without communication (``DBuffer.view`` rules).

        Args:
          placements: the new data placements of both directions, one per mesh axis; no
            ``Partial`` (the columnwise scales take them with ``BlockAtomic`` mapped to
            ``RowAtomic``).

        Returns:
          A new ``QuantizedDBuffer`` with both directions at ``placements``; released planes stay
          ``None``.
        """
        new = check_placements(self.mesh, placements, "placements")
        return self._move(new, rowwise=True, columnwise=True, move=DBuffer.view)

    def redistribute(
        self, placements: pl.Placements, *, rowwise: bool = True, columnwise: bool = True
    ) -> QuantizedDBuffer:
        """The selected directions' planes under ``placements``; the others stay as they are.

        Args:
          placements: the new data placements, one per mesh axis; no ``Partial``.
          rowwise, columnwise: move that direction's planes (with ``DBuffer.redistribute``); at
            least one must be selected, and a selected direction must be allocated.

        Returns:
          A new ``QuantizedDBuffer`` with the selected directions at ``placements``.
        """
        new = check_placements(self.mesh, placements, "placements")
        self._require(rowwise, columnwise, "redistribute")
        return self._move(new, rowwise=rowwise, columnwise=columnwise, move=DBuffer.redistribute)

    def allgather(
        self,
        mesh_axes: str | int | Iterable[str | int] | None = None,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> QuantizedDBuffer:
        """All-gathers the given Shard axes (default: all) of the selected directions' planes.

        One uint8 all-gather per selected plane (data, then scale); unselected planes keep their
        placements and contents.

        Args:
          mesh_axes: the mesh axes to gather, names or indices (``None``: every Shard axis); as
            for ``DBuffer.allgather``, only the outermost Shard axes can be gathered.
          rowwise, columnwise: gather that direction's planes; at least one must be selected, and
            a selected direction must be allocated.

        Returns:
          A new ``QuantizedDBuffer`` whose selected directions have the gathered axes
          ``Replicate``.
        """
        self._require(rowwise, columnwise, "allgather")
        changes = {}
        for d in self._chosen(rowwise, columnwise):
            data, scale = d.data.allgather(mesh_axes), d.scale.allgather(mesh_axes)
            changes[d.kind] = dataclasses.replace(d, data=data, scale=scale, placements=data.placements)
        return dataclasses.replace(self, **changes)

    # -- helpers -------------------------------------------------------------------------------

    def _filled(self, d: Direction, arrays) -> Direction:
        """``d`` with its data and scale planes made from the next two of ``arrays``."""
        (dl, dp), (sl, sp) = d.geometry(self.layout)
        data, scale = DBuffer(next(arrays), self.mesh, dp, dl), DBuffer(next(arrays), self.mesh, sp, sl)
        return dataclasses.replace(d, data=data, scale=scale)

    def _move(self, new, *, rowwise: bool, columnwise: bool, move) -> QuantizedDBuffer:
        """``move`` (``DBuffer.view`` or ``DBuffer.redistribute``) of the selected directions'
        planes to placements ``new``."""
        changes = {}
        for d in self._chosen(rowwise, columnwise):
            (_, data_to), (_, scale_to) = d.geometry(self.layout, new)
            data = None if d.data is None else move(d.data, data_to)
            scale = None if d.scale is None else move(d.scale, scale_to)
            changes[d.kind] = dataclasses.replace(d, data=data, scale=scale, placements=new)
        return dataclasses.replace(self, **changes)

    def _require(self, rowwise: bool, columnwise: bool, what: str) -> None:
        if not (rowwise or columnwise):
            raise ValueError(f"{what}: select at least one of rowwise=True or columnwise=True")
        for d in self._chosen(rowwise, columnwise):
            if not d.allocated:
                raise ValueError(
                    f"{what}: the {d.kind} planes are released; reallocate_storage() first or pass {d.kind}=False"
                )

    def _chosen(self, rowwise: bool, columnwise: bool) -> list[Direction]:
        """The directions selected by the two flags."""
        return [d for d, sel in zip(self.directions, (rowwise, columnwise)) if sel]
