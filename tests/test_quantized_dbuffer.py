"""QuantizedDBuffer on the run's devices: local quantize == global quantize, byte for byte.

With ``n`` devices the meshes are ``(n,)``, ``(2, n/2)`` and ``(n/2, 2)``; the 2-D ones need 4
devices (with 2, one axis would have size 1 and split nothing).

Oracle: each logical tensor quantized whole on the host by tests/numpy_oracle.py (written from the
design doc, sharing no code with the package), i.e. what ``mx.quantize`` gives on one device. The sharded
buffer is quantized locally (each device its own segment), gathered, and every tensor's planes
compared with the oracle's bytes; the FFI and pure-JAX paths must agree on every stored byte.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import mxfp8_jax as mx
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax._src.kernels import _ffi

import numpy_oracle
from conftest import PLATFORM, as_bytes, device_count, need_devices

pytestmark = pytest.mark.multidevice  # every test quantizes a buffer on a mesh of the run's devices

PLANE_NAMES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")  # MXFP8Tensor
BUFFER_PLANES = ("rowwise_data", "columnwise_data", "rowwise_scale", "columnwise_scale")  # .planes
HAS_KERNEL = _ffi.has_target("mxfp8_quantize_segments", PLATFORM)  # on the test devices' platform
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason=f"the compiled {PLATFORM} extension is not installed")
BACKEND = "ffi" if HAS_KERNEL else "jax"

# mesh shape on n devices, axis names, placements: one Shard axis ("n": (n,)); [Replicate, Shard]
# ("2xh": (2, n/2), each device holds two consecutive layout segments); [Shard, Shard] with the
# innermost axis the major shard index ("hx2": (n/2, 2)).
MESHES = {
    "n": (lambda n: (n,), ("x",), (mx.BlockAtomic(32),)),
    "2xh": (lambda n: (2, n // 2), ("a", "b"), (mx.Replicate(), mx.BlockAtomic(32))),
    "hx2": (lambda n: (n // 2, 2), ("a", "b"), (mx.RowAtomic(), mx.BlockAtomic(32))),
}
LAYOUTS = (mx.ShardLayout.PADDED, mx.ShardLayout.UNPADDED)
# PADDED leaves ranks empty from 4 ranks up (6 of 8); (96, 160) is cut across ranks (but for
# UNPADDED on 2), (256, 64) too on UNPADDED layouts of 4 ranks or more.
SHAPES = [(256, 64), (32, 96), (64, 32), (96, 160)]


@functools.cache
def _mesh_of(key, n):
    shape_of, names, placements = MESHES[key]
    shape = shape_of(n)
    return jax.make_mesh(shape, names, devices=need_devices(int(np.prod(shape)))), placements


def fits(key, n):
    """Whether the mesh ``key`` has every axis of size 2 or more on ``n`` devices."""
    return min(MESHES[key][0](n)) >= 2


def mesh_of(key):
    """(mesh, placements) of ``key`` on the run's devices; a 2-D mesh needs 4 (no axis of size 1)."""
    n = device_count()
    if not fits(key, n):
        need_devices(len(MESHES[key][0](1)) * 2)  # skips: 2 devices for a 1-D mesh, 4 for a 2-D one
    return _mesh_of(key, n)


def oracle(x, rule="rceil") -> mx.MXFP8Tensor:
    """One whole tensor quantized on the host by the independent numpy oracle (no shared code)."""
    planes = numpy_oracle.quantize(np.asarray(x), rule)
    e4m3 = lambda q: q.view(ml_dtypes.float8_e4m3fn)
    return mx.MXFP8Tensor(
        e4m3(planes["rowwise_data"]),
        planes["rowwise_scale"],
        e4m3(planes["columnwise_data"]),
        planes["columnwise_scale"],
        shape=tuple(x.shape),
    )


def make_tensors(shapes, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    out = []
    for m, k in shapes:
        # per-row magnitudes over many binades, a few zeros and NaNs
        x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-20, 20, (m, 1)))
        x[rng.random((m, k)) < 0.01] = 0.0
        x[rng.random((m, k)) < 0.002] = np.nan
        out.append(jnp.asarray(x.astype(np.float32)).astype(dtype))
    return out


@functools.cache  # buffers are immutable; sharing them lets tests share compiled programs
def _build(mesh_key, layout_kind, shapes, seed, dtype):
    mesh, placements = mesh_of(mesh_key)
    q = mx.QuantizedDBuffer.empty(mesh, placements, shapes, shard_layout=layout_kind)
    tensors = make_tensors(shapes, seed, dtype)
    w = mx.DBuffer.distribute_tensors(tensors, mesh, placements, layout=q.layout, dtype=dtype)
    return q, w, tensors


def build(mesh_key, layout_kind, shapes, seed=0, dtype=jnp.float32):
    """(empty QuantizedDBuffer, master weights on its layout, the logical tensors)."""
    return _build(mesh_key, layout_kind, tuple(map(tuple, shapes)), seed, jnp.dtype(dtype))


def assert_same_tensor(got: mx.MXFP8Tensor, want: mx.MXFP8Tensor, what=""):
    for name in PLANE_NAMES:
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), f"{what} {name}: presence differs"
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {name}: {g.shape} vs {w.shape}"
            np.testing.assert_array_equal(as_bytes(g), as_bytes(w), err_msg=f"{what} {name}")


@jax.jit
def views(q):
    """Every tensor's ``get_tensor_view`` (one compiled program per buffer structure)."""
    return [q.get_tensor_view(i) for i in range(q.num_tensors)]


def assert_gathered_matches(q, tensors, rule="rceil"):
    for i, (view, t) in enumerate(zip(views(q.allgather()), tensors)):
        assert_same_tensor(view, oracle(t, rule), f"tensor {i}")


def hlo_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def plane_bytes(q):
    return [None if p is None else as_bytes(p.data) for p in q.planes]


# ------------------------------------------------------------------------------------------------
# local quantize == global quantize


@pytest.mark.parametrize("layout_kind", LAYOUTS, ids=lambda k: k.value)
@pytest.mark.parametrize("mesh_key", list(MESHES))
def test_quantize_matches_single_device(mesh_key, layout_kind):
    q, w, tensors = build(mesh_key, layout_kind, SHAPES)
    qq = q.quantize(w, backend=BACKEND)
    assert_gathered_matches(qq, tensors)
    # each device's planes are the quantized rows of its own master shard
    i = 3  # (96, 160): mostly cut across ranks, and on 4 or more some ranks hold none of it
    for dev in q.mesh.devices.flat:
        rows = w.local_tensor(i, dev)
        got = qq.local_tensor_view(i, dev)
        assert got.shape == rows.shape
        if rows.shape[0]:
            assert_same_tensor(got, oracle(rows), f"tensor {i} on {dev}")


@needs_kernel
def test_pure_jax_path_writes_the_same_bytes_without_collectives():
    # [Replicate, Shard]: each local buffer holds two UNPADDED segments of unequal fill.
    q, w, tensors = build("2xh", mx.ShardLayout.UNPADDED, SHAPES, dtype=jnp.bfloat16)
    compiled = jax.jit(lambda q, w: q.quantize(w, scale_rule="floor", backend="jax")).lower(q, w).compile()
    assert hlo.collectives(compiled.as_text()) == []
    qj = compiled(q, w)
    qf = q.quantize(w, scale_rule="floor", backend="ffi")
    for name, got, want in zip(BUFFER_PLANES, plane_bytes(qj), plane_bytes(qf)):  # padding included
        np.testing.assert_array_equal(got, want, err_msg=f"jax vs ffi: {name}")
    assert_gathered_matches(qj, tensors, "floor")


@needs_kernel
@settings(max_examples=4)
@given(
    mesh_key=st.sampled_from([k for k in MESHES if fits(k, device_count())] or ["n"]),  # the meshes this run has
    layout_kind=st.sampled_from(LAYOUTS),
    shapes=st.lists(
        st.tuples(st.sampled_from([32, 64, 96, 160, 256]), st.sampled_from([32, 64, 96])),
        min_size=1,
        max_size=4,
    ),
    rule=st.sampled_from(["rceil", "floor"]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_quantize_property(mesh_key, layout_kind, shapes, rule, dtype):
    q, w, tensors = build(mesh_key, layout_kind, shapes, dtype=dtype)
    assert_gathered_matches(q.quantize(w, scale_rule=rule, backend="ffi"), tensors, rule)


def test_quantize_under_jit_and_released_planes():
    q, w, tensors = build("2xh", mx.ShardLayout.UNPADDED, SHAPES)
    with pytest.raises(ValueError, match="no plane is allocated"):
        jax.jit(lambda q, w: q.quantize(w))(q.release_storage(), w)
    out = jax.jit(lambda q, w: q.quantize(w))(q.release_storage(rowwise_only=True), w)
    assert not out.is_rowwise_allocated and out.is_columnwise_allocated
    for got, t in zip(views(out.allgather(columnwise=True, rowwise=False)), tensors):
        want = oracle(t)
        assert got.rowwise_data is None and got.rowwise_scale is None
        np.testing.assert_array_equal(as_bytes(got.columnwise_data), as_bytes(want.columnwise_data))
        np.testing.assert_array_equal(as_bytes(got.columnwise_scale), as_bytes(want.columnwise_scale))


# ------------------------------------------------------------------------------------------------
# compiled HLO: what moves


@needs_kernel
def test_quantize_hlo_is_one_local_kernel_call():
    q, w, _ = build("hx2", mx.ShardLayout.PADDED, SHAPES)
    text = hlo_text(lambda q, w: q.quantize(w, backend="ffi"), q, w)
    assert hlo.collectives(text) == []
    assert text.count('custom_call_target="mxfp8_quantize_segments"') == 1


@pytest.mark.parametrize("mesh_key", ["n", "hx2"])
def test_allgather_moves_only_selected_planes(mesh_key):
    q, w, _ = build(mesh_key, mx.ShardLayout.UNPADDED, SHAPES)
    q = q.quantize(w)
    n = q.layout.physical_size
    axes = q.mesh.axis_names[-1:] if mesh_key == "n" else q.mesh.axis_names
    for rowwise, columnwise in ((True, False), (False, True), (True, True)):
        fn = lambda q: q.allgather(axes, rowwise=rowwise, columnwise=columnwise)
        gathers = [c for c in hlo.collectives(hlo_text(fn, q)) if c.op == "all-gather"]
        assert {c.dtypes for c in gathers} == {("u8",)}, gathers
        sizes = sorted(c.outputs[0][1][0] for c in gathers)
        assert sizes == sorted([n, n // 32] * (int(rowwise) + int(columnwise))), (sizes, n)
        out = fn(q)
        kept = "columnwise" if not columnwise else "rowwise" if not rowwise else None
        if kept:  # the planes not selected stay sharded and untouched
            assert getattr(out, f"{kept}_placements") == q.placements
            for kind in ("data", "scale"):
                a, b = getattr(out, f"{kept}_{kind}"), getattr(q, f"{kept}_{kind}")
                assert a.placements == b.placements
                np.testing.assert_array_equal(as_bytes(a.data), as_bytes(b.data))
    # measured against a bf16 buffer of the same tensors on the same layout, gathered the same
    # way: one direction's planes move (1 + 1/32) / 2 of its bytes
    bf16 = mx.DBuffer.zeros(q.mesh, q.placements, q.layout, jnp.bfloat16)
    bf16_bytes = hlo.bytes_by_op(hlo_text(lambda b: b.allgather(axes), bf16))["all-gather"]
    one_plane = hlo.bytes_by_op(hlo_text(lambda q: q.allgather(axes, columnwise=False), q))["all-gather"]
    assert one_plane / bf16_bytes == (1 + 1 / 32) / 2


# ------------------------------------------------------------------------------------------------
# storage lifecycle and plane access


def test_release_reallocate_and_planes():
    mesh, placements = mesh_of("n")
    q = mx.QuantizedDBuffer.empty(mesh, placements, [(64, 64)])
    assert q.is_rowwise_allocated and q.is_columnwise_allocated
    assert all(isinstance(p, mx.DBuffer) for p in q.planes)
    assert [p.dtype for p in q.planes] == [jnp.uint8] * 4
    rd, cd, rs, cs = q.planes
    assert q.planes_for(rowwise=True, columnwise=False) == (rd, rs)
    assert q.planes_for(rowwise=False, columnwise=True) == (cd, cs)
    assert q.planes_for(rowwise=True, columnwise=True) == (rd, cd, rs, cs)
    assert rs.data.shape[0] == cs.data.shape[0] == rd.data.shape[0] // 32
    assert cs.placements == (mx.RowAtomic(),) and rs.placements == (mx.BlockAtomic(32),)

    r = q.release_storage(rowwise_only=True)
    assert not r.is_rowwise_allocated and r.is_columnwise_allocated
    assert r.rowwise_data is None and r.rowwise_scale is None and r.columnwise_data is cd
    with pytest.raises(ValueError, match="rowwise planes are released"):
        r.planes_for(rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="rowwise planes are released"):
        r.allgather()
    none = q.release_storage()
    assert none.planes == (None, None, None, None)
    assert not none.is_rowwise_allocated and not none.is_columnwise_allocated
    back = none.reallocate_storage()
    assert back.is_rowwise_allocated and back.is_columnwise_allocated
    for p, old in zip(back.planes, q.planes):
        assert p.placements == old.placements and p.layout == old.layout
        assert not as_bytes(p.data).any()
    assert r.reallocate_storage().columnwise_data is cd  # allocated planes are kept


def test_update_mxfp8_tensor_with_views():
    q, w, tensors = build("n", mx.ShardLayout.PADDED, SHAPES)
    both = views(q.quantize(w).allgather())[1]
    row_only = q.release_storage().reallocate_storage(columnwise=False).quantize(w)
    src = views(row_only.allgather(columnwise=False))[1]
    assert src.columnwise_data is None
    # gathering the rowwise planes keeps the columnwise ones already on dst
    kept = mx.update_mxfp8_tensor(src, both, rowwise=True, columnwise=False)
    assert kept.columnwise_data is both.columnwise_data
    assert_same_tensor(kept, oracle(tensors[1]))
    # a selected plane absent from src is cleared
    cleared = mx.update_mxfp8_tensor(src, both, rowwise=True, columnwise=True)
    assert cleared.columnwise_data is None and cleared.columnwise_scale is None
    assert cleared.rowwise_data is src.rowwise_data


def test_get_tensor_pads_scales_for_te():
    q, w, tensors = build("n", mx.ShardLayout.UNPADDED, SHAPES)
    full = q.quantize(w).allgather()
    t, view = jax.jit(lambda f: (f.get_tensor(3), f.get_tensor_view(3)))(full)  # (96, 160)
    assert t.rowwise_scale.shape == (128, 8)  # [ceil128(96), ceil4(160/32)]
    assert t.columnwise_scale.shape == (4, 256)  # [ceil4(96/32), ceil128(160)]
    rs, cs = np.asarray(t.rowwise_scale), np.asarray(t.columnwise_scale)
    np.testing.assert_array_equal(rs[:96, :5], np.asarray(view.rowwise_scale))
    np.testing.assert_array_equal(cs[:3, :160], np.asarray(view.columnwise_scale))
    assert not rs[96:].any() and not rs[:, 5:].any() and not cs[3:].any() and not cs[:, 160:].any()
    np.testing.assert_array_equal(as_bytes(t.rowwise_data), as_bytes(view.rowwise_data))
    np.testing.assert_array_equal(as_bytes(t.columnwise_data), as_bytes(view.columnwise_data))


def test_get_tensor_view_needs_a_gathered_buffer():
    q, w, _ = build("n", mx.ShardLayout.PADDED, SHAPES)
    with pytest.raises(ValueError, match="no allocated plane is gathered"):
        q.quantize(w).get_tensor_view(0)
    with pytest.raises(ValueError, match="tensor index 4"):
        q.get_tensor_view(4)


# ------------------------------------------------------------------------------------------------
# view and redistribute


def test_view_and_redistribute_round_trips():
    q, w, tensors = build("2xh", mx.ShardLayout.UNPADDED, SHAPES)
    mesh = q.mesh
    sharded_pl = (mx.RowAtomic(), mx.BlockAtomic(32))
    qs = q.redistribute(sharded_pl).quantize(w.redistribute(sharded_pl))  # [Shard, Shard]
    assert qs.placements == sharded_pl
    # Shard -> Replicate on one axis, and back by a local slice
    coarse = qs.redistribute((mx.Replicate(), mx.BlockAtomic(32)))
    assert coarse.columnwise_scale.placements == (mx.Replicate(), mx.RowAtomic())
    back = coarse.redistribute(sharded_pl)
    for a, b in zip(plane_bytes(back), plane_bytes(qs)):
        np.testing.assert_array_equal(a, b)
    # view: Replicate -> Shard needs no data movement and gives the same shards
    full = qs.allgather()
    viewed = full.view(sharded_pl)
    for a, b in zip(viewed.planes, qs.planes):
        assert a.placements == b.placements
        np.testing.assert_array_equal(as_bytes(a.data), as_bytes(b.data))
    assert hlo.collectives(hlo_text(lambda f: f.view(sharded_pl), full)) == []
    with pytest.raises(ValueError, match="view cannot change"):
        qs.view((mx.Replicate(), mx.BlockAtomic(32)))
    # one direction only: the other keeps its placements, and `placements` says they differ
    rep = (mx.Replicate(), mx.Replicate())
    half = qs.redistribute(rep, rowwise=True, columnwise=False)
    assert half.rowwise_placements == rep and half.columnwise_placements == sharded_pl
    assert half.columnwise_data is qs.columnwise_data
    with pytest.raises(ValueError, match="different placements"):
        _ = half.placements
    released = half.release_storage().reallocate_storage(columnwise=False)
    assert released.rowwise_placements == rep  # a direction keeps its placements when released
    assert mesh is half.mesh
    fwd = views(half)  # the gathered rowwise planes only
    both = views(half.redistribute(rep, rowwise=False, columnwise=True))
    for i, t in enumerate(tensors):
        want = oracle(t)
        assert fwd[i].columnwise_data is None
        np.testing.assert_array_equal(as_bytes(fwd[i].rowwise_data), as_bytes(want.rowwise_data))
        np.testing.assert_array_equal(as_bytes(fwd[i].rowwise_scale), as_bytes(want.rowwise_scale))
        assert_same_tensor(both[i], want, f"tensor {i}")
    with pytest.raises(ValueError, match="columnwise planes are sharded"):
        half.get_tensor_view(0, columnwise=True)


# ------------------------------------------------------------------------------------------------
# errors


def test_bad_shapes_and_layouts():
    mesh, placements = mesh_of("n")
    with pytest.raises(ValueError, match=r"M=48 and K=64 must both be multiples of 32"):
        mx.QuantizedDBuffer.empty(mesh, placements, [(64, 64), (48, 64)])
    with pytest.raises(ValueError, match=r"K=40"):
        mx.QuantizedDBuffer.empty(mesh, placements, [(64, 40)])
    with pytest.raises(ValueError, match="2-D tensors"):
        mx.QuantizedDBuffer.empty(mesh, placements, [(64, 32, 32)])
    layout64 = mx.GlobalLayout.build([(64, 64)], mesh.size, block_size=64)
    with pytest.raises(ValueError, match="block_size=64: an MXFP8 buffer needs block_size == 32"):
        mx.QuantizedDBuffer.zeros(mesh, placements, layout64)
    with pytest.raises(ValueError, match="BlockAtomic\\(n\\) needs n dividing 32"):
        mx.QuantizedDBuffer.empty(mesh, (mx.BlockAtomic(64),), [(64, 64)])
    with pytest.raises(ValueError, match=r"placements\[0\]=Partial.*bytes, not addends"):
        mx.QuantizedDBuffer.empty(mesh, (mx.Partial("sum"),), [(64, 64)])


def test_master_weight_must_match():
    q, w, tensors = build("n", mx.ShardLayout.PADDED, [(64, 64), (32, 96)])
    mesh, placements = mesh_of("n")
    devs = list(mesh.devices.flat)
    other_mesh = Mesh(np.array(devs[::-1]), ("x",), axis_types=mesh.axis_types)
    w_mesh = mx.DBuffer.distribute_tensors(tensors, other_mesh, placements, layout=q.layout)
    # the two meshes print alike; the error says where they differ
    order = rf"device order: mesh position \(0,\) holds device {devs[-1].id} vs {devs[0].id}"
    with pytest.raises(ValueError, match=rf"main_weight.mesh .*{order}"):
        q.quantize(w_mesh)
    plane = mx.DBuffer.zeros(other_mesh, q.rowwise_data.placements, q.rowwise_data.layout, jnp.uint8)
    with pytest.raises(ValueError, match=r"rowwise_data is on another mesh than the buffer: device order"):
        dataclasses.replace(q, rowwise=dataclasses.replace(q.rowwise, data=plane))
    with pytest.raises(ValueError, match=r"rowwise_data is on another mesh than the buffer: device order"):
        mx.QuantizedDBuffer.from_planes(**{**planes_of(q), "rowwise_data": plane})
    with pytest.raises(ValueError, match="main_weight.placements"):
        q.quantize(w.redistribute((mx.Replicate(),)))
    w_layout = mx.DBuffer.distribute_tensors(
        tensors, mesh, placements, shard_layout=mx.ShardLayout.UNPADDED, block_size=32
    )
    with pytest.raises(ValueError, match="main_weight.layout differs"):
        q.quantize(w_layout)
    with pytest.raises(TypeError, match="main_weight has dtype int32"):
        q.quantize(mx.DBuffer(w.data.astype(jnp.int32), w.mesh, w.placements, w.layout))
    with pytest.raises(TypeError, match="main_weight must be a DBuffer"):
        q.quantize(tensors[0])
    with pytest.raises(ValueError, match="scale_rule='nearest'"):
        q.quantize(w, scale_rule="nearest")


def planes_of(q):
    names = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale", "mesh", "layout")
    return {n: getattr(q, n) for n in names} | dict(
        rowwise_placements=q.rowwise_placements, columnwise_placements=q.columnwise_placements
    )


def test_from_planes_rebuilds_the_buffer():
    q, _, _ = build("n", mx.ShardLayout.PADDED, [(64, 64), (32, 96)])
    again = mx.QuantizedDBuffer.from_planes(**planes_of(q))
    assert again == q
    half = q.release_storage(rowwise_only=True)
    assert mx.QuantizedDBuffer.from_planes(**planes_of(half)) == half
    with pytest.raises(ValueError, match="rowwise data and scale planes must both be present"):
        mx.QuantizedDBuffer.from_planes(**{**planes_of(q), "rowwise_scale": None})


def test_local_tensor_view_of_a_released_buffer_raises():
    q, _, _ = build("n", mx.ShardLayout.PADDED, [(64, 64)])
    dev = q.mesh.devices.flat[0]
    with pytest.raises(ValueError, match=r"local_tensor_view\(0\): every plane is released"):
        q.release_storage().local_tensor_view(0, dev)
    # one direction released: the other one's rows, the released planes None
    half = q.release_storage(rowwise_only=True).local_tensor_view(0, dev)
    assert half.rowwise_data is None and half.columnwise_data is not None
