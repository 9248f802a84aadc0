"""Placements: the suffix rule, the flat PartitionSpec, and shard indices as jax reads them.

With ``n`` devices the meshes are ``(n,)``, ``(2, n/2)``, ``(n/2, 2)`` and ``(2, 2, n/4)``; where
shard indices are checked, a mesh with an axis of size 1 is skipped as needing more devices (4
for the 2-D ones, 8 for the 3-D one). Specs and error messages do not depend on axis sizes:
those tests take 1-, 2- and 3-axis meshes of any n (``any_meshes``).
"""

import itertools

import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src.buffers import placement as pl

from conftest import need_devices

R, S, B32 = mx.Replicate(), mx.RowAtomic(), mx.BlockAtomic(32)

# axis names, and the fewest devices that give every axis a size of 2 or more
MESHES = {"x": (("x",), 2), "ab": (("a", "b"), 4), "ba": (("a", "b"), 4), "abc": (("a", "b", "c"), 8)}


def mesh_shape(key, n):
    return {"x": (n,), "ab": (2, n // 2), "ba": (n // 2, 2), "abc": (2, 2, n // 4)}[key]


def make_mesh(key, devices):
    """The mesh ``key`` over the first of ``devices``; one that would have an axis of size 1
    skips the test as needing more devices."""
    names, fewest = MESHES[key]
    shape = mesh_shape(key, len(devices))
    if min(shape) < 2:
        need_devices(fewest)  # skips: this run has fewer
    return Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names)


def any_meshes(devices):
    """A 1-, 2- and 3-axis mesh of the run's devices, (n,), (2, n/2) and (2, 1, n/2), whatever
    the sizes (for what does not depend on them)."""
    n = 2 * (len(devices) // 2)
    flat = np.array(devices[:n])
    return (
        Mesh(flat, ("x",)),
        Mesh(flat.reshape(2, n // 2), ("a", "b")),
        Mesh(flat.reshape(2, 1, n // 2), ("a", "b", "c")),
    )


def suffix_placements(ndim):
    """Every valid list: k trailing Shard axes (alternating kinds), Replicate/Partial before."""
    for k in range(ndim + 1):
        for head in itertools.product([R, mx.Partial("sum")], repeat=ndim - k):
            yield (*head, *([S, B32] * ndim)[:k])


def test_partition_spec_innermost_shard_axis_major(devices):
    # the specs name axes whatever their sizes (a size-1 axis too); num_shards multiplies sizes
    m1, m2, m3 = any_meshes(devices)
    assert mx.partition_spec(m1, [S]) == P("x")
    assert mx.partition_spec(m1, [R]) == P(None)
    assert mx.partition_spec(m2, [R, S]) == P("b")
    assert mx.partition_spec(m2, [S, B32]) == P(("b", "a"))
    assert mx.partition_spec(m2, [mx.Partial("avg"), S]) == P("b")
    assert mx.partition_spec(m2, [R, R]) == P(None)
    assert mx.partition_spec(m3, [R, S, S]) == P(("c", "b"))
    assert mx.partition_spec(m3, [S, S, S]) == P(("c", "b", "a"))
    assert pl.num_shards(m3, [R, S, S]) == m3.size // 2 and pl.num_shards(m2, [R, R]) == 1
    assert pl.num_shards(m3, [S, S, S]) == pl.num_shards(m2, [S, S]) == m2.size


@pytest.mark.parametrize("key", list(MESHES))
def test_shard_index_matches_jax_sharding(key, devices):
    """The shard a device holds under jax's own reading of the spec is ``shard_index``'s."""
    mesh = make_mesh(key, devices)
    shape = mesh.devices.shape
    length = mesh.size * 3  # one segment of 3 elements per device
    for placements in suffix_placements(len(shape)):
        nshards = pl.num_shards(mesh, placements)
        index_map = NamedSharding(mesh, mx.partition_spec(mesh, placements)).devices_indices_map((length,))
        for pos in np.ndindex(*shape):
            dev = mesh.devices[pos]
            start = index_map[dev][0].start or 0
            idx = pl.shard_index(mesh, placements, pos)
            assert start == idx * (length // nshards), (placements, pos)
            assert pl.device_position(mesh, dev) == pos
            g = mesh.size // nshards  # segments per shard
            assert mx.segments_of_shard(mesh, placements, idx) == range(idx * g, idx * g + g)


def test_placements_are_frozen_values():
    assert mx.Partial() == mx.Partial("sum") != mx.Partial("avg")
    assert mx.BlockAtomic(32) == B32 != mx.BlockAtomic(16)
    assert pl.is_shard(S) and pl.is_shard(B32) and not pl.is_shard(R)
    assert not pl.is_shard(mx.Partial())
    assert len({R, mx.Replicate(), S, B32, mx.BlockAtomic(32)}) == 3


def test_errors_name_the_rule(devices):
    _, mesh, mesh3 = any_meshes(devices)
    half = mesh.shape["b"]
    with pytest.raises(ValueError, match=r"must form a suffix"):
        pl.validate_placements(mesh, [S, R])
    with pytest.raises(ValueError, match=r"must form a suffix"):
        mx.partition_spec(mesh3, [S, R, S])
    with pytest.raises(ValueError, match=r"has 1 entries but the mesh has 2 axes \('a', 'b'\)"):
        mx.partition_spec(mesh, [S])
    with pytest.raises(TypeError, match=r"placements\[1\]='Shard' is not a placement"):
        pl.validate_placements(mesh, [R, "Shard"])
    with pytest.raises(TypeError, match=r"must be a sequence with one placement per mesh axis"):
        pl.validate_placements(mesh, S)
    with pytest.raises(ValueError, match=r"reduce_op='max'.*one of \('sum', 'avg'\)"):
        mx.Partial("max")
    with pytest.raises(ValueError, match=r"BlockAtomic\(n\)=0 must be a positive int"):
        mx.BlockAtomic(0)
    with pytest.raises(ValueError, match=r"needs a layout whose block_size is a multiple of 32, got block_size=16"):
        pl.check_layout_fits([R, B32], 16)
    with pytest.raises(ValueError, match=rf"shard index {half} must be in \[0, {half}\)"):
        mx.segments_of_shard(mesh, [R, S], half)
