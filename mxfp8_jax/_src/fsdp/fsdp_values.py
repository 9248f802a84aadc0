"""A parameter as the evaluated loss holds it, and where the islands that read it run.

``fsdp_eval`` evaluates the loss on global arrays; a parameter enters it as one of two values:

- ``UnitValue``: a unit's master rows and MXFP8 planes, split over the FSDP axes by rows, with
  the layout ops the loss applied to it recorded (not run) until the op that reads it;
- ``PlainValue``: a plain parameter, stored split along one axis, with its layout ops recorded
  until it is gathered.

``Islands`` is where the ops that read them run: ``shard_map`` bodies over the FSDP axes of a
``Topology``. ``flatten`` / ``rebuild`` carry these values through a ``jax.checkpoint``, a
``lax.switch`` or a ``custom_vjp`` as the arrays they stand for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from mxfp8_jax._src.fsdp.fsdp_geometry import Gemms, UnitGeometry
from mxfp8_jax._src.fsdp.fsdp_planes import UnitShards
from mxfp8_jax._src.fsdp.fsdp_topology import Topology
from mxfp8_jax._src.fsdp.fsdp_trace import View
from mxfp8_jax._src.fsdp.fsdp_unit import pick_layer


@dataclasses.dataclass(frozen=True, eq=False)
class UnitValue:
    """A unit as the evaluated loss holds it: ``shards``, its master rows and planes as global
    arrays ``[*stack, rows, K]`` split by rows over ``geometry.axes``, the layer axes of enclosing scans
    sliced off; ``ops`` the layout ops applied since the parameter, ``view`` their effect on its
    axes; ``pick`` the layer an index (``w[i]``) chose, one index per leading axis of the leaves,
    picked by the op that reads it."""

    name: str
    geometry: UnitGeometry
    dtype: Any
    shards: UnitShards
    view: View
    ops: tuple = ()
    gemm: Gemms = dataclasses.field(default_factory=Gemms)  # how its GEMMs multiply (``gemm.mxfp8``: in MXFP8)
    pick: tuple = ()  # indices of the leaves' leading layer axes the value reads (``w[i]``)
    sliced: bool = False  # a scan's slice of it (one layer per iteration)
    path: tuple = ()  # the parameter's nnx path (a list's index an int)

    @property
    def leaves(self) -> tuple:
        """The arrays of ``shards``, as ``jax.tree.leaves`` lists them."""
        return tuple(jax.tree.leaves(self.shards))

    def with_leaves(self, leaves) -> UnitValue:
        """The same unit on other arrays (as ``leaves`` lists them: a scan's slices, a layer)."""
        return dataclasses.replace(self, shards=jax.tree.unflatten(jax.tree.structure(self.shards), leaves))

    def shard_specs(self) -> UnitShards:
        """The islands' ``in_specs`` of ``shards``: rows split over the unit's axes."""
        return jax.tree.map(lambda x: PartitionSpec(*(None,) * (x.ndim - 2), self.geometry.axes, None), self.shards)

    @property
    def picked(self) -> tuple[int, ...]:
        """The sizes of the leaves' leading axes that ``pick`` indexes."""
        return tuple(self.shards.master.shape[: len(self.pick)])

    def picked_shards(self) -> UnitShards:
        """The shards of the layer ``pick`` names (a copy of that layer's shards)."""
        return jax.tree.map(lambda a: pick_layer(a, self.pick), self.shards)

    def arrays(self) -> tuple:
        """The arrays it stands for: its leaves, then its pick indices."""
        return (*self.leaves, *self.pick)

    def with_arrays(self, arrays) -> UnitValue:
        """The same unit on ``arrays`` (as ``arrays()`` lists them, e.g. inside a region)."""
        n = len(self.leaves)
        return dataclasses.replace(self.with_leaves(arrays[:n]), pick=tuple(arrays[n:]))

    @property
    def layer(self) -> tuple[str, ...] | None:
        """The element of a list of layers (``nnx.List``, a Python list) the unit belongs to, as
        its path up to and including the list index (an int): ``("blocks", 3, "attn", "q",
        "kernel")`` -> ``("blocks", 3)``. None outside such a list: the unit is in no layer of a
        Python loop over layers."""
        return layer_of(self.path)


def layer_of(path: tuple) -> tuple | None:
    """A parameter's layer of a Python loop over a list of layers (``UnitValue.layer``)."""
    index = next((k for k, key in enumerate(path) if isinstance(key, int)), None)
    return None if index is None else tuple(path[: index + 1])


@dataclasses.dataclass(frozen=True, eq=False)
class PlainValue:
    """A plain parameter: ``array`` (global), split along ``shard_axis`` over the FSDP axes
    (None: whole), read as ``dtype``; ``ops`` the layout ops (casts, broadcasts, reshapes)
    applied since, replayed where it is gathered."""

    name: str
    array: jax.Array
    shard_axis: int | None
    dtype: Any
    ops: tuple = ()
    path: tuple = ()  # the parameter's nnx path (a list's index an int)
    sliced: bool = False  # a scan's slice of it (gathered whole before the loop)
    pick: tuple = ()  # never picked: a plain parameter's index reads it whole

    @property
    def layer(self) -> tuple | None:
        """Its layer of a Python loop over a list of layers (``UnitValue.layer``)."""
        return layer_of(self.path)

    def value(self, whole: jax.Array) -> jax.Array:
        """The parameter whole -> the value the loss reads (its layout ops replayed)."""
        v = whole.astype(self.dtype)
        for prim, params in self.ops:
            v = prim.bind(v, **params)
        return v


Symbolic = (UnitValue, PlainValue)


@dataclasses.dataclass(frozen=True)
class Islands:
    """Where the islands run: over the FSDP axes of ``topology`` (inside a ``shard_map`` manual
    over its tensor-parallel axis, against the context's abstract mesh). ``prefetch``: how many
    layers ahead a unit's forward gather starts (``fsdp_eval``'s ``token``); ``keep_layers``:
    how many of a rematerialised scan's last layers keep every weight their forward gathered
    for their backward (``fsdp_fetch``)."""

    topology: Topology
    prefetch: int = 0
    keep_layers: int = 0

    @property
    def mesh(self):
        return self.topology.mesh

    @property
    def entry(self):
        """The FSDP axes as a ``PartitionSpec`` entry and a collective's ``axis_name`` (one name,
        or names innermost first, as the batch and the units' rows are split)."""
        return self.topology.fsdp_axes

    @property
    def axes(self) -> tuple[str, ...]:
        return self.entry if isinstance(self.entry, tuple) else (self.entry,)

    @property
    def sizes(self) -> dict[str, int]:
        return self.topology.sizes

    def context_mesh(self):
        """The mesh a ``shard_map`` or sharding constraint is written against here: the context's
        abstract mesh inside a partly manual ``shard_map`` (tensor parallelism), else ``mesh``."""
        abstract = jax.sharding.get_abstract_mesh()
        manual = getattr(abstract, "manual_axes", ()) if abstract is not None else ()
        return abstract if manual else self.mesh

    @property
    def owns_all(self) -> bool:
        """Whether the islands are manual over every mesh axis (no tensor parallelism)."""
        return self.topology.tp_axis is None

    def island(self, fn, in_specs, out_specs):
        """``fn`` as a ``shard_map`` manual over the FSDP axes."""
        if self.owns_all:
            return jax.shard_map(fn, mesh=self.context_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)
        return jax.shard_map(
            fn,
            mesh=self.context_mesh(),
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(self.axes),
            check_vma=False,
        )

    def whole(self, x: jax.Array, split: int | None = None) -> jax.Array:
        """``x`` replicated over the islands' axes (XLA all-gathers it where it is split);
        ``split``: the axis ``x`` is split along, along which its cotangent then stays split
        (``split_cotangent``: not gathered whole only to be split again)."""
        replicated = NamedSharding(self.context_mesh(), PartitionSpec())
        if split is None:
            return lax.with_sharding_constraint(x, replicated)
        return self.split_cotangent(x, split, lambda x: lax.with_sharding_constraint(x, replicated))

    def split_cotangent(self, x: jax.Array, axis: int, fn=lambda x: x) -> jax.Array:
        """``fn(x)`` (``fn`` a sharding constraint, or none: ``x`` as it is), its cotangent split
        along ``axis`` over the islands' axes: a whole value read where the batch is split gets a
        partial sum from each device, which XLA:GPU then reduce-scatters (combined with the other
        reduce-scatters there) instead of all-reducing."""
        sharding = NamedSharding(self.context_mesh(), PartitionSpec(*([None] * axis), self.entry))

        @jax.custom_vjp
        def same(x):
            return fn(x)

        same.defvjp(lambda x: (fn(x), None), lambda _, ct: (lax.with_sharding_constraint(ct, sharding),))
        return same(x)


def flatten(values) -> tuple[list, list]:
    """The arrays of ``values`` (a unit's leaves and pick, a plain parameter's array, arrays) in
    one list, and ``(start, count, value)`` to rebuild each from it (``rebuild``)."""
    flat, rebuilt = [], []
    for x in values:
        leaves = x.arrays() if isinstance(x, UnitValue) else (x.array,) if isinstance(x, PlainValue) else (x,)
        rebuilt.append((len(flat), len(leaves), x))
        flat.extend(leaves)
    return flat, rebuilt


def rebuild(x, leaves):
    """``x`` (as ``flatten`` listed it) on ``leaves``."""
    if isinstance(x, UnitValue):
        return x.with_arrays(leaves)
    if isinstance(x, PlainValue):
        return dataclasses.replace(x, array=leaves[0])
    return leaves[0]


def not_a_unit(x, how: str):
    """``x``, which the loss reads as ``how``; a unit cannot be read so (``misused``)."""
    if isinstance(x, UnitValue):
        raise misused(x, how)
    return x


def misused(x, how: str) -> ValueError:
    """The error for a unit the loss reads in a way units are not read (``how``)."""
    return ValueError(
        f"{x.name}: the FSDP plan keeps it as a unit (its shards, gathered for each GEMM or lookup), "
        f"but this loss reads it as {how}; build FSDP with this loss_fn and an example batch "
        f"(FSDP(model, mesh, loss_fn=..., example_batch=...)) so that the plan follows what the loss does"
    )
