"""Per-device (SPMD) plumbing shared by the code that runs inside ``jax.shard_map``.

- ``shard_map``: the one wrapper every module uses. Replication (vma) checking is off: DBuffers
  hold ``Partial`` addends under replicated specs, and per-device results that differ between
  groups are typed by hand where it matters (``vma``), which the checker cannot follow.
- ``axis_group``: the ``axis_name`` of a collective over several mesh axes, innermost first, the
  order in which flat shard indices are counted (``placement``).
- ``shard_position``: that shard index as a traced value, inside the ``shard_map``.
- ``by_row_shards``: row-by-row work with a collective inside a ``shard_map`` that leaves other
  mesh axes automatic, run manual over those too, so that rows they shard stay where they are.
- ``all_gather_bits``: an all-gather that moves floats narrower than 32 bits as same-width
  unsigned ints: XLA:CPU would otherwise widen bf16/fp8 collectives (bf16 -> f32, fp8 -> f16),
  doubling the bytes and risking NaN payloads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map(fn, ...)`` without replication checks (see the module docstring)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def axis_group(names: Sequence[str]):
    """A collective's ``axis_name`` for ``names`` (mesh order): innermost first."""
    names = tuple(reversed(tuple(names)))
    return names[0] if len(names) == 1 else names


def all_gather_bits(x: jax.Array, axis_name, *, axis: int, axis_index_groups=None) -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)``, narrow floats moved as their bits
    (XLA:CPU would otherwise widen a bf16 gather to f32: twice the bytes). Not differentiable
    for narrow floats (a bitcast has no gradient); fp32 and wider take the plain gather."""
    dtype = jnp.dtype(x.dtype)
    gather = lambda a: lax.all_gather(a, axis_name, axis=axis, tiled=True, axis_index_groups=axis_index_groups)
    if not (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4):
        return gather(x)
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * dtype.itemsize}"))
    return lax.bitcast_convert_type(gather(bits), dtype)


def shard_position(mesh: Mesh, axes: Sequence[str]) -> jax.Array:
    """This device's shard index over the Shard axes ``axes`` (mesh order), innermost axis most
    significant; only inside ``shard_map`` over ``mesh``."""
    idx = jnp.int32(0)
    for name in reversed(tuple(axes)):
        idx = idx * mesh.shape[name] + lax.axis_index(name)
    return idx


def by_row_shards(fn: Callable, x: jax.Array, *shared: jax.Array, block: int = 1):
    """``fn(x, *shared)`` for ``fn`` that works row by row: rows ``x [R, ...]`` (and arrays
    ``shared`` that every row uses, e.g. a norm's scale) to a tuple of arrays
    ``[g, r, ...]`` whose axis 1 follows x's rows (``r`` rows, or ``r / 32`` scale rows, per
    ``r`` rows of x), inside a ``shard_map`` manual over some mesh axes.

    Where that ``shard_map`` leaves other mesh axes automatic and they shard ``x``'s rows (an
    FSDP step under tensor parallelism: rows split by batch over the FSDP axes), XLA lowers a
    collective of such an operand by moving their rows as well (a gather over tp would give
    every device the rows of all of them). Here ``fn`` runs in a ``shard_map`` manual over
    those axes too, on the rows each device holds. Where they do not divide the rows into
    whole ``block``-row pieces, ``fn`` runs on ``x`` as it is."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or not mesh.axis_names:
        return fn(x, *shared)
    manual = set(getattr(mesh, "manual_axes", mesh.axis_names))
    auto = [(a, s) for a, s in zip(mesh.axis_names, mesh.axis_sizes) if a not in manual and s > 1]
    split = 1
    for _, s in auto:
        split *= s
    if not auto or x.shape[0] % (split * block):
        return fn(x, *shared)
    names = [a for a, _ in auto]
    entry = names[0] if len(names) == 1 else tuple(names)
    local = jax.ShapeDtypeStruct((x.shape[0] // split, *x.shape[1:]), x.dtype)
    out_shapes = jax.eval_shape(fn, local, *shared)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(P(entry, *(None,) * (x.ndim - 1)), *(P() for _ in shared)),
        out_specs=tuple(P(None, entry, *(None,) * (o.ndim - 2)) for o in out_shapes),
        axis_names=set(names),
        check_vma=False,
    )(x, *shared)
