"""Placements: the suffix rule, the flat PartitionSpec, and shard indices as jax reads them."""

import itertools

import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src import placement as pl

R, S, B32 = mx.Replicate(), mx.RowAtomic(), mx.BlockAtomic(32)

MESHES = {(8,): ("x",), (2, 4): ("a", "b"), (4, 2): ("a", "b"), (2, 2, 2): ("a", "b", "c")}


def make_mesh(shape, devices):
    return Mesh(np.array(devices).reshape(shape), MESHES[shape])


def suffix_placements(ndim):
    """Every valid list: k trailing Shard axes (alternating kinds), Replicate/Partial before."""
    for k in range(ndim + 1):
        for head in itertools.product([R, mx.Partial("sum")], repeat=ndim - k):
            yield (*head, *([S, B32] * ndim)[:k])


def test_partition_spec_innermost_shard_axis_major(devices):
    m8, m24, m222 = (make_mesh(s, devices) for s in [(8,), (2, 4), (2, 2, 2)])
    assert mx.partition_spec(m8, [S]) == P("x")
    assert mx.partition_spec(m8, [R]) == P(None)
    assert mx.partition_spec(m24, [R, S]) == P("b")
    assert mx.partition_spec(m24, [S, B32]) == P(("b", "a"))
    assert mx.partition_spec(m24, [mx.Partial("avg"), S]) == P("b")
    assert mx.partition_spec(m24, [R, R]) == P(None)
    assert mx.partition_spec(m222, [R, S, S]) == P(("c", "b"))
    assert mx.partition_spec(m222, [S, S, S]) == P(("c", "b", "a"))
    assert pl.num_shards(m222, [R, S, S]) == 4 and pl.num_shards(m24, [R, R]) == 1


@pytest.mark.parametrize("shape", list(MESHES))
def test_shard_index_matches_jax_sharding(shape, devices):
    """The shard a device holds under jax's own reading of the spec is ``shard_index``'s."""
    mesh = make_mesh(shape, devices)
    n = 8 * 3
    for placements in suffix_placements(len(shape)):
        nshards = pl.num_shards(mesh, placements)
        index_map = NamedSharding(mesh, mx.partition_spec(mesh, placements)).devices_indices_map((n,))
        for pos in np.ndindex(*shape):
            dev = mesh.devices[pos]
            start = index_map[dev][0].start or 0
            idx = pl.shard_index(mesh, placements, pos)
            assert start == idx * (n // nshards), (placements, pos)
            assert pl.device_position(mesh, dev) == pos
            g = 8 // nshards
            assert mx.segments_of_shard(mesh, placements, idx) == range(idx * g, idx * g + g)


def test_placements_are_frozen_values():
    assert mx.Partial() == mx.Partial("sum") != mx.Partial("avg")
    assert mx.BlockAtomic(32) == B32 != mx.BlockAtomic(16)
    assert pl.is_shard(S) and pl.is_shard(B32) and not pl.is_shard(R)
    assert not pl.is_shard(mx.Partial())
    assert len({R, mx.Replicate(), S, B32, mx.BlockAtomic(32)}) == 3


def test_errors_name_the_rule(devices):
    mesh = make_mesh((2, 4), devices)
    with pytest.raises(ValueError, match=r"must form a suffix"):
        pl.validate_placements(mesh, [S, R])
    with pytest.raises(ValueError, match=r"must form a suffix"):
        mx.partition_spec(make_mesh((2, 2, 2), devices), [S, R, S])
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
    with pytest.raises(ValueError, match=r"shard index 4 must be in \[0, 4\)"):
        mx.segments_of_shard(mesh, [R, S], 4)
