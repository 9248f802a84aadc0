"""DBuffer on the run's devices: round trips, local rows, transitions, HLO, errors.

With ``n`` devices the meshes are ``(n,)``, ``(2, n/2)``, ``(n/2, 2)`` and ``(2, 2, n/4)``; a
mesh that would have an axis of size 1 is skipped as needing more devices (4 for the 2-D ones,
8 for the 3-D one), since its point is that every axis really splits the data.

Oracles are independent of the code under test: the physical buffer is packed here in numpy from
the layout's offsets and bounds (whose properties test_layout checks), and which slice a device
holds comes from jax's own ``NamedSharding.devices_indices_map``.
"""

import bisect
import itertools
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import mxfp8_jax as mx
from mxfp8_jax import DBuffer, ShardLayout
from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax._src.core import checks

from conftest import as_bytes, need_devices

R, S, B2 = mx.Replicate(), mx.RowAtomic(), mx.BlockAtomic(2)
PSUM, PAVG = mx.Partial("sum"), mx.Partial("avg")

# The meshes, by key: axis names, and the fewest devices that give every axis a size of 2 or more.
MESHES = {"x": (("x",), 2), "ab": (("a", "b"), 4), "ba": (("a", "b"), 4), "abc": (("a", "b", "c"), 8)}
SHAPES = [(6, 4), (2, 6), (4,), (8, 3), (4, 2, 3), (2, 5)]  # dim 0 even: BlockAtomic(2) fits


def mesh_shape(key, n):
    """The mesh ``key`` on ``n`` devices: (n,), (2, n/2), (n/2, 2) or (2, 2, n/4)."""
    return {"x": (n,), "ab": (2, n // 2), "ba": (n // 2, 2), "abc": (2, 2, n // 4)}[key]


def make_mesh(key, devices, axis_type=AxisType.Auto):
    """The mesh ``key`` over the first of ``devices``; skips the test (counted as needing more
    devices) when one of its axes would have size 1."""
    names, fewest = MESHES[key]
    shape = mesh_shape(key, len(devices))
    if min(shape) < 2:
        need_devices(fewest)  # skips: this run has fewer
    used = devices[: int(np.prod(shape))]
    return Mesh(np.array(used).reshape(shape), names, axis_types=(axis_type,) * len(shape))


def rs_placements(ndim):
    """Replicate/Shard lists obeying the suffix rule, Shard kinds alternating."""
    return [(R,) * (ndim - k) + ((S, B2) * ndim)[:k] for k in range(ndim + 1)]


def tensors_for(shapes, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s) * 4, dtype=dtype) for s in shapes]


def physical_oracle(layout, tensors):
    """The stored array, packed element by element from offsets and segment bounds."""
    out = np.zeros(layout.physical_size, dtype=tensors[0].dtype)
    bounds = list(layout.rank_segment_offsets)
    cap = layout.segment_capacity
    for t, off in zip(tensors, layout.tensor_to_offset):
        for j, v in enumerate(t.reshape(-1)):
            p = off + j
            k = bisect.bisect_right(bounds, p) - 1  # last segment starting at or before p
            out[k * cap + p - bounds[k]] = v
    return out


def check_shards(buf, expected_global):
    """Every device's local buffer is the slice of ``expected_global`` jax says it holds."""
    index_map = buf.sharding.devices_indices_map(expected_global.shape)
    assert len(buf.data.addressable_shards) == buf.mesh.size
    for shard in buf.data.addressable_shards:
        np.testing.assert_array_equal(as_bytes(shard.data), as_bytes(expected_global[index_map[shard.device]]))


class _Meshes:
    """``meshes[key]``: the mesh ``key`` over the run's devices (built once), or a skip."""

    def __init__(self, devices):
        self.devices, self._built = devices, {}

    def __getitem__(self, key):
        if key not in self._built:
            self._built[key] = make_mesh(key, self.devices)
        return self._built[key]


@pytest.fixture(scope="module")
def meshes(devices):
    return _Meshes(devices)


# -- round trips ---------------------------------------------------------------------------------


def round_trip_cases():
    """Every Replicate/Shard mix with UNPADDED (fully sharded only on (n/2, 2), which repeats
    (2, n/2)'s axes at other sizes); PADDED fully sharded. Compiles are the cost."""
    for key, (names, _) in MESHES.items():
        mixes = rs_placements(len(names))
        for placements in mixes if key != "ba" else mixes[-1:]:
            yield key, placements, ShardLayout.UNPADDED
        yield key, mixes[-1], ShardLayout.PADDED


@pytest.mark.parametrize("mesh_key, placements, shard_layout", list(round_trip_cases()))
def test_distribute_allgather_get_tensor_round_trip(mesh_key, placements, shard_layout, meshes):
    mesh = meshes[mesh_key]
    tensors = tensors_for(SHAPES, seed=len(mesh.axis_names))
    buf = DBuffer.distribute_tensors(tensors, mesh, placements, shard_layout=shard_layout, block_size=2)
    assert buf.layout.dp_size == mesh.size and buf.layout.shard_layout is shard_layout
    assert buf.data.shape == (buf.layout.physical_size,) and buf.dtype == jnp.bfloat16
    expected = physical_oracle(buf.layout, tensors)
    check_shards(buf, expected)
    full = buf.allgather()
    assert full.placements == (R,) * len(mesh.axis_names)
    np.testing.assert_array_equal(as_bytes(full.data), as_bytes(expected))
    if pl.num_shards(mesh, placements) in (1, mesh.size):
        for got, t in zip(full.get_tensors(), tensors):
            np.testing.assert_array_equal(as_bytes(got), as_bytes(t))
    if pl.num_shards(mesh, placements) == mesh.size:
        np.testing.assert_array_equal(as_bytes(buf.get_tensor(4)), as_bytes(tensors[4]))


@pytest.mark.parametrize("mesh_key, placements", [("x", (S,)), ("ab", (R, S)), ("abc", (R, S, B2))])
@pytest.mark.parametrize("shard_layout", list(ShardLayout))
def test_local_tensor_holds_the_rows_the_layout_says(shard_layout, mesh_key, placements, meshes):
    tensors = tensors_for(SHAPES, seed=7)
    mesh = meshes[mesh_key]
    buf = DBuffer.distribute_tensors(tensors, mesh, placements, shard_layout=shard_layout, block_size=2)
    lay = buf.layout
    cap = lay.segment_capacity
    index_map = buf.sharding.devices_indices_map((lay.physical_size,))
    for dev in mesh.devices.flat:
        sl = index_map[dev][0]
        first, stop = (sl.start or 0) // cap, (sl.stop or lay.physical_size) // cap
        lo, hi = lay.rank_segment_offsets[first], lay.rank_segment_offsets[stop]
        for i, t in enumerate(tensors):
            off, rs = lay.tensor_to_offset[i], int(np.prod(t.shape[1:]))
            a, b = max(off, lo), min(off + t.size, hi)
            rows = t[(a - off) // rs : (b - off) // rs] if a < b else t[:0]
            got = buf.local_tensor(i, dev)
            assert got.shape == rows.shape
            np.testing.assert_array_equal(as_bytes(got), as_bytes(rows))


def test_works_under_jit_and_as_a_pytree(meshes):
    mesh = meshes["ab"]
    tensors = tensors_for(SHAPES, seed=3)
    buf = DBuffer.distribute_tensors(tensors, mesh, (S, S), shard_layout=ShardLayout.UNPADDED, block_size=2)
    assert jax.tree.leaves(buf) == [buf.data]
    same = jax.jit(lambda b: b)(buf)
    assert same.placements == buf.placements and same.layout == buf.layout

    @jax.jit
    def step(b):
        half = b.allgather("a")  # [S, S] -> [R, S]
        return half.redistribute((S, S)), half.get_tensor(4) * 2

    back, t4 = step(buf)
    assert back.placements == (S, S)
    np.testing.assert_array_equal(as_bytes(back.data), as_bytes(buf.data))
    np.testing.assert_array_equal(as_bytes(t4), as_bytes(tensors[4] * 2))

    # packing traced tensors happens in the graph; the result matches host-side packing
    traced = jax.jit(
        lambda ts: DBuffer.distribute_tensors(ts, mesh, (S, S), shard_layout=ShardLayout.UNPADDED, block_size=2)
    )(tensors)
    assert traced.layout == buf.layout
    np.testing.assert_array_equal(as_bytes(traced.data), as_bytes(buf.data))


def test_explicit_axis_mesh(devices):
    mesh = make_mesh("ab", devices, AxisType.Explicit)
    tensors = tensors_for(SHAPES, seed=5)
    buf = DBuffer.distribute_tensors(tensors, mesh, (S, S))
    half = buf.allgather(0)
    assert half.placements == (R, S)
    check_shards(half, physical_oracle(buf.layout, tensors))
    for got, t in zip(half.get_tensors(), tensors):
        np.testing.assert_array_equal(as_bytes(got), as_bytes(t))


def test_empty_and_cast(meshes):
    mesh = meshes["ba"]
    buf = DBuffer.empty(mesh, (R, mx.BlockAtomic(4)), [(8, 4), (4,)], jnp.float32)
    assert buf.layout.block_size == 4  # lcm(block_size=1, BlockAtomic(4))
    assert buf.sharding.is_equivalent_to(NamedSharding(mesh, mx.partition_spec(mesh, buf.placements)), 1)
    assert not np.asarray(buf.data).any()
    tensors = tensors_for(SHAPES, seed=11)
    b16 = DBuffer.distribute_tensors(tensors, mesh, (S, S))
    f32 = b16.cast(jnp.float32)
    assert f32.dtype == jnp.float32 and f32.placements == b16.placements
    assert f32.data.sharding.is_equivalent_to(b16.data.sharding, 1)
    np.testing.assert_array_equal(np.asarray(f32.data), np.asarray(b16.data).astype(np.float32))


# -- transitions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_key", ["x", "ab", "abc"])
def test_shard_replicate_transitions(mesh_key, meshes):
    """Every ordered pair of Replicate/Shard mixes; view too where it is allowed."""
    mesh = meshes[mesh_key]
    ndim = len(mesh.axis_names)
    tensors = tensors_for(SHAPES, seed=1)
    base = DBuffer.distribute_tensors(tensors, mesh, (R,) * ndim, shard_layout=ShardLayout.UNPADDED, block_size=2)
    expected = physical_oracle(base.layout, tensors)
    cache = {}
    for old, new in itertools.permutations(rs_placements(ndim), 2):
        src = cache.setdefault(old, base.redistribute(old))
        out = src.redistribute(new)
        assert out.placements == new
        check_shards(out, expected)
        if sum(map(pl.is_shard, new)) >= sum(map(pl.is_shard, old)):
            viewed = src.view(new)  # Replicate -> Shard keeps a slice: no communication
            check_shards(viewed, expected)


def from_locals(mesh, placements, layout, seed):
    """A buffer whose device at ``pos`` holds its own addends; returns it and its reduced value.

    Addends depend on the device's coordinates along Partial axes and its shard only (so copies
    along Replicate axes agree); they are small integers, so every summation order is exact.
    """
    partial_axes = [j for j, p in enumerate(placements) if isinstance(p, mx.Partial)]
    nshards = pl.num_shards(mesh, placements)
    local_n = layout.physical_size // nshards

    def addend(pcoords, shard):
        rng = np.random.default_rng([seed, shard, *pcoords])
        return rng.integers(-8, 9, local_n).astype(np.float32)

    value = np.zeros(layout.physical_size, np.float32)
    for shard in range(nshards):
        for pcoords in itertools.product(*(range(mesh.devices.shape[j]) for j in partial_axes)):
            value[shard * local_n : (shard + 1) * local_n] += addend(pcoords, shard)
    n_avg = int(np.prod([mesh.devices.shape[j] for j in partial_axes if placements[j].reduce_op == "avg"]))
    value /= n_avg
    sharding = NamedSharding(mesh, mx.partition_spec(mesh, placements))
    arrays = []
    for pos in np.ndindex(*mesh.devices.shape):
        local = addend(tuple(pos[j] for j in partial_axes), pl.shard_index(mesh, placements, pos))
        arrays.append(jax.device_put(local, mesh.devices[pos]))
    data = jax.make_array_from_single_device_arrays((layout.physical_size,), sharding, arrays)
    return DBuffer(data, mesh, placements, layout), value


PARTIAL_CASES = [
    ("x", (PSUM,), (R,), {"all-reduce": 1}),
    ("x", (PSUM,), (S,), {"reduce-scatter": 1}),
    ("ab", (PSUM, S), (R, S), {"all-reduce": 1}),
    ("ab", (PAVG, S), (R, S), {"all-reduce": 1}),
    ("ab", (PSUM, S), (B2, S), {"reduce-scatter": 1}),
    ("ba", (PSUM, B2), (S, S), {"reduce-scatter": 1}),
    ("ba", (PAVG, R), (S, S), {"reduce-scatter": 1}),
    ("abc", (PSUM, R, S), (S, S, S), {"reduce-scatter": 1}),
    ("abc", (R, PSUM, S), (S, S, S), {"reduce-scatter": 1}),
    ("abc", (PSUM, PSUM, S), (S, S, S), {"reduce-scatter": 1}),
    ("abc", (PSUM, PAVG, R), (R, S, S), {"reduce-scatter": 1, "all-reduce": 1}),
    ("abc", (PSUM, S, S), (R, R, R), {"all-reduce": 1, "all-gather": 1}),
]


@pytest.mark.parametrize("mesh_key, old, new, collectives", PARTIAL_CASES)
def test_partial_reductions(mesh_key, old, new, collectives, meshes):
    mesh = meshes[mesh_key]
    layout = mx.GlobalLayout.build(SHAPES, mesh.size, block_size=2, shard_layout=ShardLayout.UNPADDED)
    buf, value = from_locals(mesh, old, layout, seed=len(PARTIAL_CASES))
    compiled = jax.jit(lambda b: b.redistribute(new)).lower(buf).compile()
    assert collective_counts(compiled) == collectives
    out = compiled(buf)
    assert out.placements == new
    check_shards(out, value)


def test_distribute_as_partial_keeps_the_value(meshes):
    mesh = meshes["ab"]
    tensors = tensors_for(SHAPES, seed=2)
    expected = physical_oracle(mx.GlobalLayout.build(SHAPES, mesh.size), tensors)
    psum = DBuffer.distribute_tensors(tensors, mesh, (PSUM, S))
    index_map = psum.sharding.devices_indices_map(expected.shape)
    for shard in psum.data.addressable_shards:  # sum: the first device along "a" holds the data
        a = pl.device_position(mesh, shard.device)[0]
        want = expected[index_map[shard.device]] if a == 0 else np.zeros_like(expected[:1])
        assert (np.asarray(shard.data) == want).all()
    for p in (psum, DBuffer.distribute_tensors(tensors, mesh, (PAVG, S))):
        check_shards(p.redistribute((R, S)), expected)


# -- compiled HLO ---------------------------------------------------------------------------------


def collective_ops(compiled):
    """(kind, outputs) of every collective in a compiled function's HLO."""
    return [(c.op, c.outputs) for c in hlo.collectives(compiled.as_text())]


def collective_counts(compiled):
    return hlo.counts_by_op(compiled.as_text())


# Narrow floats travel bitcast to same-width unsigned ints (XLA:CPU would widen bf16 to f32).
WIRE_TYPE = {jnp.bfloat16: "u16", jnp.float8_e4m3fn: "u8", jnp.uint8: "u8", jnp.float32: "f32"}


@pytest.mark.parametrize(
    "mesh_key, placements, axes, dtype",
    [
        ("x", (S,), "x", jnp.bfloat16),
        ("ab", (S, S), "a", jnp.uint8),
        ("ab", (R, B2), "b", jnp.float8_e4m3fn),
        ("ba", (S, S), ("a", "b"), jnp.bfloat16),
        ("abc", (S, S, S), (0, 1), jnp.float32),
        ("abc", (R, S, S), None, jnp.bfloat16),
    ],
)
def test_allgather_hlo_is_one_all_gather(mesh_key, placements, axes, dtype, meshes):
    mesh = meshes[mesh_key]
    buf = DBuffer.empty(mesh, placements, SHAPES, dtype, shard_layout=ShardLayout.UNPADDED, block_size=2)
    compiled = jax.jit(lambda b: b.allgather(axes)).lower(buf).compile()
    gathered_local = buf.allgather(axes).local_size
    # exactly one collective: an all-gather of the whole local buffer, element width unchanged
    assert collective_ops(compiled) == [("all-gather", ((WIRE_TYPE[dtype], (gathered_local,)),))]
    if dtype != jnp.float32:
        assert "f32[" not in compiled.as_text()  # nothing widened on the way


@pytest.mark.parametrize(
    "mesh_key, old, new",
    [
        ("x", (R,), (S,)),
        ("ab", (R, S), (B2, S)),
        ("ab", (S, S), (B2, B2)),
        ("abc", (R, R, R), (R, B2, S)),
        ("abc", (PSUM, R, S), (PSUM, B2, S)),
    ],
)
def test_view_hlo_has_no_collective(mesh_key, old, new, meshes):
    mesh = meshes[mesh_key]
    layout = mx.GlobalLayout.build(SHAPES, mesh.size, block_size=2)
    buf = DBuffer.zeros(mesh, old, layout, jnp.float32)
    assert collective_ops(jax.jit(lambda b: b.view(new)).lower(buf).compile()) == []
    assert buf.view(new).placements == new


# -- errors ---------------------------------------------------------------------------------------


def test_errors_on_a_flat_mesh(meshes):
    m = meshes["x"]
    n = m.size
    with pytest.raises(ValueError, match=r"tensor_shapes\[1\]=\(\) is 0-D"):
        DBuffer.empty(m, (S,), [(4,), ()], jnp.float32)
    with pytest.raises(ValueError, match=r"dim 0 \(3\) must be divisible by block_size=2"):
        DBuffer.empty(m, (B2,), [(4, 4), (3, 4)], jnp.float32)
    with pytest.raises(ValueError, match=rf"layout.dp_size={n // 2} must equal mesh.size={n}"):
        DBuffer.zeros(m, (S,), mx.GlobalLayout.build(SHAPES, n // 2), jnp.float32)
    with pytest.raises(ValueError, match=r"BlockAtomic\(n=2\).*multiple of 2, got block_size=1"):
        DBuffer.zeros(m, (B2,), mx.GlobalLayout.build([(3, 2)], n), jnp.float32)


def test_errors_on_a_2d_mesh(meshes):
    m24 = meshes["ab"]
    with pytest.raises(ValueError, match=r"must form a suffix"):
        DBuffer.empty(m24, (S, R), SHAPES, jnp.float32)
    with pytest.raises(ValueError, match=r"has 1 entries but the mesh has 2 axes"):
        DBuffer.empty(m24, (S,), SHAPES, jnp.float32)

    tensors = tensors_for(SHAPES)
    buf = DBuffer.distribute_tensors(tensors, m24, (S, S))
    with pytest.raises(ValueError, match=r"view cannot change mesh axis 'a' from RowAtomic\(\) to Replicate\(\)"):
        buf.view((R, S))
    with pytest.raises(ValueError, match=r"view cannot change mesh axis 'a' from Partial"):
        DBuffer.distribute_tensors(tensors, m24, (PSUM, S)).view((R, S))
    with pytest.raises(ValueError, match=r"only the outermost Shard axes can be gathered"):
        buf.allgather("b")
    with pytest.raises(ValueError, match=r"mesh axis 'a' has placement Replicate\(\), not a Shard"):
        buf.allgather("a").allgather("a")
    with pytest.raises(ValueError, match=r"mesh_axes entry 'z' is neither an axis name nor an index"):
        buf.allgather("z")
    with pytest.raises(ValueError, match=r"cannot change mesh axis 'a' from RowAtomic\(\) to Partial"):
        buf.redistribute((PSUM, S))
    with pytest.raises(
        ValueError, match=r"cannot change mesh axis 'a' from Partial\(reduce_op='sum'\) to Partial\(reduce_op='avg'\)"
    ):
        DBuffer.distribute_tensors(tensors, m24, (PSUM, S)).redistribute((PAVG, S))
    with pytest.raises(ValueError, match=r"get_tensor needs a buffer without Partial placements"):
        DBuffer.distribute_tensors(tensors, m24, (PSUM, S)).get_tensor(0)
    with pytest.raises(ValueError, match=r"tensor index 6 must be an int in \[0, 6\)"):
        buf.get_tensor(6)
    with pytest.raises(ValueError, match=r"tensor index True must be an int"):
        buf.get_tensor(True)  # a bool is not an index (it was accepted as 1)
    with pytest.raises(ValueError, match=r"data has shape \(5,\); a DBuffer holds a flat"):
        DBuffer(jnp.zeros(5), m24, (S, S), buf.layout)
    with pytest.raises(ValueError, match=r"data is sharded as .*jax.device_put it there first"):
        DBuffer(jax.device_put(buf.data, NamedSharding(m24, PartitionSpec())), m24, (S, S), buf.layout)
    with pytest.raises(ValueError, match=r"tensor shapes .* differ from layout.tensor_shapes"):
        DBuffer.distribute_tensors(tensors[:2], m24, (S, S), layout=buf.layout)


def test_empty_buffer_is_refused_at_construction(meshes):
    # a layout of no tensor is a valid layout, but a DBuffer of it could never be gathered
    m = meshes["x"]
    with pytest.raises(ValueError, match=r"layout holds no tensor: a DBuffer packs at least one"):
        DBuffer.empty(m, (S,), [], jnp.float32)
    with pytest.raises(ValueError, match=r"layout holds no tensor"):
        DBuffer.distribute_tensors([], m, (S,))
    with pytest.raises(ValueError, match=r"layout holds no tensor"):
        DBuffer.zeros(m, (R,), mx.GlobalLayout.build([], m.size), jnp.float32)


def test_wrong_mesh_errors_say_what_differs(meshes):
    m = meshes["x"]
    n, ids = m.size, [d.id for d in m.devices.flat]
    buf = DBuffer.distribute_tensors(tensors_for(SHAPES), m, (S,))
    # the same names, sizes and types, devices in reverse: the reprs alone look equal
    rev = Mesh(m.devices[::-1], ("x",), axis_types=m.axis_types)
    assert repr(rev) == repr(m)
    moved = jax.device_put(buf.data, NamedSharding(rev, PartitionSpec("x")))
    with pytest.raises(
        ValueError, match=rf"meshes differ in device order: mesh position \(0,\) holds device {ids[-1]} vs {ids[0]}"
    ):
        DBuffer(moved, m, (S,), buf.layout)
    # each difference is named, and only those (any two axis sizes; a size-1 axis is fine here)
    even = m.devices[: 2 * (n // 2)]
    two_rows = Mesh(even.reshape(2, -1), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    one_row = Mesh(even.reshape(1, -1), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    assert checks.mesh_difference(m, m) == ""
    assert checks.mesh_difference(two_rows, one_row) == f"axis sizes (2, {n // 2}) vs (1, {2 * (n // 2)})"
    renamed = Mesh(two_rows.devices, ("a", "c"), axis_types=two_rows.axis_types)
    assert checks.mesh_difference(renamed, two_rows) == "axis names ('a', 'c') vs ('a', 'b')"
    half = Mesh(m.devices[: n // 2], ("x",), axis_types=m.axis_types)
    assert checks.mesh_difference(half, m).startswith(
        f"axis sizes ({n // 2},) vs ({n},); devices (ids [] vs {sorted(ids[n // 2 :])}"
    )


def test_constructor_checks_the_mesh_under_two_processes():
    # two CPU processes of 2 devices: the data is not fully addressable, its sharding is known
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    script = pathlib.Path(__file__).with_name("_dbuffer_two_processes.py")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(port), str(k)], env=env, stdout=subprocess.PIPE, text=True)
        for k in range(2)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for out, p in zip(outs, procs):
        assert p.returncode == 0, out
        assert "ACCEPTED right mesh, fully addressable: False" in out
        assert re.search(r"REFUSED reversed mesh: data is sharded as .*meshes differ in device order", out), out
