"""Partitioning rules for the kernels' custom calls: a sharded input stays sharded under ``jit``
(docs/design.md §7, "Partitioning rules").

XLA cannot see into a custom call, so without a rule it replicates every operand (an all-gather
of the whole input onto each device) and runs the full kernel everywhere. Each kernel here works
row by row on a 2-D view, so a rule can keep most shardings: ``Dims`` names every axis of every
operand and result by the logical dimension it spans (``"m"`` rows, ``"k"`` the last axis,
``"m/32"``/``"k/32"`` their block counts for scales, ``"0"`` an unrequested zero-size plane) and
says which dimensions must be cut in whole 32-blocks (``blocked``) or not at all
(``replicated``). From it come

- the Shardy rule (``sdy_rule``): a blocked dimension is the compound factor (blocks, 32) and its
  scale axis the blocks factor alone, so propagation moves a sharding between data and scales
  consistently and never splits a block; the 32 and every ``replicated`` dimension are
  need-replication factors;
- the partitioner's choice (``choose``), used by both the GSPMD callbacks and the final
  partitioning under Shardy: for each dimension of the first operand, the longest prefix of its
  mesh axes that divides it evenly and, where it is blocked, leaves whole blocks on each shard;
  anything else is resharded to replicated. Results and the other operands follow that choice.
  The shardings arrive undecoded and ``named`` reads them against the mesh: one that no
  ``PartitionSpec`` can write (a part of a mesh axis) counts as replicated.

The per-shard body is the plain custom call on the local shapes: it produces exactly the bytes
of the corresponding rows and columns of the unsharded call (rowwise blocks lie along ``k``,
columnwise blocks along 32 consecutive rows, both wholly inside one shard by construction).

Inside ``shard_map`` the caller already works per device; the rule steps aside there
(``manual_axes``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.experimental.custom_partitioning import CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mxfp8_jax._src.numerics.format import BLOCK

EMPTY = "0"  # the label of a zero-size unrequested plane's one axis


@dataclasses.dataclass(frozen=True)
class Dims:
    """Logical dimensions of a custom call's operands and results (see the module docstring)."""

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    blocked: frozenset[str] = frozenset()
    replicated: frozenset[str] = frozenset()


def _base(label: str) -> str:
    return label.removesuffix("/32")


def sdy_rule(dims: Dims, shape: tuple[int, ...]) -> SdyShardingRule:
    """The Shardy rule of ``dims`` for a first operand of ``shape`` (the module docstring)."""
    sizes = dict(zip(dims.operands[0], shape))
    labels = {d for arr in dims.operands + dims.results for d in arr}
    # a blocked dimension with a scale axis is (blocks, 32); one of a single block cannot be cut
    # (nor written as a compound: Shardy refuses a factor of size 1 in one) and one without a
    # scale axis (k of a columnwise-only quantize, whose kernel still wants whole blocks of k)
    # is checked by ``choose`` alone
    single = {d for d in dims.blocked if sizes.get(d) == BLOCK}
    compound = {d for d in dims.blocked if f"{d}/32" in labels} - single
    empties = iter(range(len(dims.operands) + len(dims.results)))

    def factor(label: str):
        if label == EMPTY:
            return f"e{next(empties)}"
        if label.endswith("/32"):
            return f"{_base(label)}_blocks" if _base(label) in single else _base(label)
        return CompoundFactor(label, f"{label}_in_block") if label in compound else label

    operands = tuple(tuple(factor(d) for d in arr) for arr in dims.operands)
    results = tuple(tuple(factor(d) for d in arr) for arr in dims.results)
    order = []  # factors in order of first use: the rule lists special factors in that order
    for arr in operands + results:
        for f in arr:
            for name in (f,) if isinstance(f, str) else f:
                if name not in order:
                    order.append(name)
    special = set(dims.replicated) | single | {f"{d}_in_block" for d in compound}
    return SdyShardingRule(
        operands,
        results,
        need_replication_factors=tuple(f for f in order if f in special),
        **{f"{d}_in_block": BLOCK for d in compound},
    )


def _shape(ir_type) -> tuple[int, ...]:
    """The shape of an operand's MLIR type (what a callable Shardy rule is handed)."""
    if hasattr(ir_type, "shape"):
        return tuple(ir_type.shape)
    from jax.interpreters.mlir import ir

    return tuple(ir.RankedTensorType(ir_type).shape)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def choose(dims: Dims, mesh, shape: tuple[int, ...], sharding) -> dict[str, tuple[str, ...]]:
    """Mesh axes kept on each logical dimension, from the first operand's ``sharding``."""
    kept = {}
    spec = sharding.spec if isinstance(sharding, NamedSharding) else ()
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    for label, size, entry in zip(dims.operands[0], shape, spec):
        axes = () if label in dims.replicated else _axes(entry)
        while axes:
            n = math.prod(mesh.shape[a] for a in axes)
            if size % n == 0 and (label not in dims.blocked or (size // n) % BLOCK == 0):
                break
            axes = axes[:-1]
        kept[_base(label)] = axes
    return kept


def _sharding(mesh, arr: tuple[str, ...], kept) -> NamedSharding:
    return NamedSharding(mesh, P(*(None if d == EMPTY else _entry(kept.get(_base(d), ())) for d in arr)))


def named(mesh, sharding, shape: tuple[int, ...]) -> NamedSharding | None:
    """``sharding`` as a ``NamedSharding`` over ``mesh``, or None where the mesh's axes cannot
    name it (Shardy may propagate a sub-axis, e.g. 2 of an axis of 4, onto a dimension of 2
    blocks: a cut that whole blocks allow but a ``PartitionSpec`` cannot write)."""
    if isinstance(sharding, NamedSharding):
        return sharding
    local = sharding.shard_shape(shape)
    counts = [size // n if n else 1 for size, n in zip(shape, local)]

    def search(dim, free):
        if dim == len(shape):
            yield ()
            return
        for axes in _ordered_products(free, counts[dim], mesh.shape):
            rest = tuple(a for a in free if a not in axes)
            for tail in search(dim + 1, rest):
                yield (_entry(axes),) + tail

    for spec in search(0, tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)):
        candidate = NamedSharding(mesh, P(*spec))
        if candidate.is_equivalent_to(sharding, len(shape)):
            return candidate
    return None


def _ordered_products(free, count, sizes):
    """Ordered tuples of distinct axes from ``free`` whose sizes multiply to ``count``."""
    if count == 1:
        yield ()
        return
    for i, a in enumerate(free):
        if count % sizes[a] == 0:
            for rest in _ordered_products(free[:i] + free[i + 1 :], count // sizes[a], sizes):
                yield (a,) + rest


def _shardings(dims: Dims, mesh, arg_shapes):
    x = arg_shapes[0]
    sharding = named(mesh, x.sharding, x.shape)
    kept = {} if sharding is None else choose(dims, mesh, x.shape, sharding)
    args = tuple(_sharding(mesh, arr, kept) for arr in dims.operands)
    results = tuple(_sharding(mesh, arr, kept) for arr in dims.results)
    return args, results


def manual_axes() -> frozenset:
    """The manual mesh axes of the code being traced (non-empty inside ``shard_map``)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


class Partitioned:
    """``body`` (arrays -> tuple of arrays, the plain custom call) with the rule of ``dims``.

    Make one per static configuration (cache it): jax keeps a callback per instance.
    """

    def __init__(self, body: Callable, dims: Dims):
        self.body, self.dims = body, dims
        self._fn = custom_partitioning(body)
        self._fn.def_partition(
            partition=self.partition,
            infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: self.shardings(mesh, arg_shapes)[1],
            sharding_rule=lambda mesh, operands, results: sdy_rule(dims, _shape(operands[0])),
            decode_shardings=False,  # decoded by ``named``, which also handles what no spec names
        )

    def shardings(self, mesh, arg_shapes) -> tuple[tuple[NamedSharding, ...], tuple[NamedSharding, ...]]:
        """(operand shardings, result shardings) the call runs with, for operands ``arg_shapes``
        (``ShapeDtypeStruct``s carrying the shardings propagation gave them)."""
        return _shardings(self.dims, mesh, arg_shapes)

    def partition(self, mesh, arg_shapes, result_shape=None):
        """The partitioner's callback: the mesh, the per-shard body and the chosen shardings."""
        args, results = self.shardings(mesh, arg_shapes)
        return mesh, self.body, results, args

    def __call__(self, *args):
        if manual_axes():  # inside shard_map: already per device
            return self.body(*args)
        return self._fn(*args)
