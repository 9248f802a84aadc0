"""Changing a flat buffer's placements: what each device does, per mesh axis, to move its local
buffer from old placements to new ones (``DBuffer.redistribute``).

``plan(mesh, old, new)`` decides, axis by axis, which of five moves applies (split a replicated
buffer, reduce-scatter partial addends, reduce them, gather shards, keep the first copy) and
refuses the rest; ``compiled(plan)`` is the one jitted ``shard_map`` program that does them, each
kind of collective once over all its axes and the whole local buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.core import spmd


@dataclasses.dataclass(frozen=True)
class Plan:
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


def plan(mesh: Mesh, old, new) -> Plan:
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
    return Plan(mesh, tuple(old), tuple(new), tuple(split), tuple(rs), tuple(reduce), tuple(gather), tuple(keep_first))


@functools.cache
def compiled(p: Plan):
    """The jitted per-device transition of plan ``p`` (cached: plans are hashable static values)."""
    specs = (pl.partition_spec(p.mesh, p.old), pl.partition_spec(p.mesh, p.new))
    return jax.jit(spmd.shard_map(p.local_fn, p.mesh, *specs))
