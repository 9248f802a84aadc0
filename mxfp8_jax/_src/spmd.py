"""Per-device (SPMD) plumbing shared by the code that runs inside ``jax.shard_map``.

- ``shard_map``: the one wrapper every module uses. Replication (vma) checking is off: DBuffers
  hold ``Partial`` addends under replicated specs, and per-device results that differ between
  groups are typed by hand where it matters (``vma``), which the checker cannot follow.
- ``axis_group``: the ``axis_name`` of a collective over several mesh axes, innermost first, the
  order in which flat shard indices are counted (``placement``).
- ``shard_position``: that shard index as a traced value, inside the ``shard_map``.
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


def shard_position(mesh: Mesh, axes: Sequence[str]) -> jax.Array:
    """This device's shard index over the Shard axes ``axes`` (mesh order), innermost axis most
    significant; only inside ``shard_map`` over ``mesh``."""
    idx = jnp.int32(0)
    for name in reversed(tuple(axes)):
        idx = idx * mesh.shape[name] + lax.axis_index(name)
    return idx
