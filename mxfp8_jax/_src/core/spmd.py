"""Per-device (SPMD) plumbing shared by the code that runs inside ``jax.shard_map``.

- ``shard_map``: the one wrapper every module uses. Replication (vma) checking is off: DBuffers
  hold ``Partial`` addends under replicated specs, and per-device results that differ between
  groups are typed by hand where it matters (``vma``), which the checker cannot follow.
- ``axis_group``: the ``axis_name`` of a collective over several mesh axes, innermost first, the
  order in which flat shard indices are counted (``placement``).
- ``shard_position``: that shard index as a traced value, inside the ``shard_map``.
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
