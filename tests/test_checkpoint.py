"""Logical checkpoints (mxfp8_jax/_src/buffers/checkpoint.py): exact round trips across meshes and
layouts, mismatches named before any data moves, packing from sharded arrays with no host gather,
and a 2-process x 4-CPU-device save restored in this process on its n devices.

With ``n`` devices, buffers are saved from ``(n,)`` and restored onto ``(n,)``, ``(n/2,)`` and
``(2, n/2)`` (with 2 devices ``(1,)`` and ``(2, 1)``: restoring onto fewer devices, or onto a
2-axis mesh, is the point, not how far each axis splits).
"""

import math

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mxfp8_jax._src.buffers import checkpoint as ck
from mxfp8_jax._src.buffers import placement as pl
from mxfp8_jax._src.buffers.dbuffer import DBuffer
from mxfp8_jax._src.buffers.layout import ShardLayout
from mxfp8_jax._src.buffers.logical import logical_sharding, pack_logical
from mxfp8_jax._src.buffers.quantized import QuantizedDBuffer

from ckpt_values import host_tensor
from conftest import as_bytes

PADDED, UNPADDED = ShardLayout.PADDED, ShardLayout.UNPADDED
ROW = pl.RowAtomic()
SHAPES = [(64, 32), (96, 32), (40, 8)]  # PADDED and UNPADDED flat buffers differ in length
NAMES = ["blocks/0/w", "blocks/1/w", "head/b"]


def _mesh(shape, names, devices):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=devices[:n])


def _mesh_shape(kind, n):
    """A mesh of the run's ``n`` devices: all of them, half of them, or (2, n/2)."""
    return {"all": (n,), "half": (n // 2,), "2d": (2, n // 2)}[kind]


def _tensors(dtype=np.float32):
    return [host_tensor(s, t, dtype) for t, s in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, devices):
    """An UNPADDED f32 DBuffer on all n devices and a PADDED bf16 one, saved."""
    mesh = _mesh((len(devices),), ("x",), devices)
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for key, dtype, layout in (("f32", np.float32, UNPADDED), ("bf16", ml_dtypes.bfloat16, PADDED)):
        buf = DBuffer.distribute_tensors(_tensors(dtype), mesh, [ROW], shard_layout=layout)
        buf.save(root / key, names=NAMES, metadata={"step": 3, "precision": key})
        out[key] = (root / key, buf.layout)
    return out


def test_read_metadata(saved):
    info = ck.read_metadata(saved["bf16"][0])
    assert info.names == tuple(NAMES)
    assert [t.shape for t in info.tensors] == SHAPES
    assert {t.dtype for t in info.tensors} == {np.dtype(ml_dtypes.bfloat16)}
    assert info.metadata == {"kind": "DBuffer", "user": {"step": 3, "precision": "bf16"}}
    assert info.version == ck.VERSION


@pytest.mark.parametrize(
    "key, mesh_kind, placements, layout",
    [
        ("f32", "all", [ROW], UNPADDED),  # n -> n
        ("f32", "all", [ROW], PADDED),  # UNPADDED -> PADDED
        ("f32", "half", [ROW], UNPADDED),  # n -> n/2 (the case that used to zero-fill)
        ("bf16", "half", [ROW], UNPADDED),  # PADDED -> UNPADDED, n -> n/2
        ("bf16", "2d", [pl.Replicate(), ROW], UNPADDED),  # (n,) -> (2, n/2)
        ("f32", "2d", [ROW, ROW], PADDED),
        ("f32", "2d", [pl.Partial("sum"), ROW], PADDED),
    ],
)
def test_dbuffer_round_trip(saved, devices, key, mesh_kind, placements, layout):
    directory, saved_layout = saved[key]
    dtype = np.float32 if key == "f32" else ml_dtypes.bfloat16
    mesh_shape = _mesh_shape(mesh_kind, len(devices))
    mesh = _mesh(mesh_shape, ("a", "b") if len(mesh_shape) == 2 else ("x",), devices)
    got = DBuffer.restore(directory, mesh, placements, shard_layout=layout)
    assert got.placements == tuple(placements) and got.layout.shard_layout is layout
    if mesh_kind != "all" or layout != saved_layout.shard_layout:
        assert got.layout.physical_size != saved_layout.physical_size or got.layout != saved_layout
    # every logical tensor, bit for bit (NaN payloads and subnormals included; get_tensors'
    # differentiable slicing may canonicalize bf16 NaN payloads on CPU); under Partial
    # the value is a sum of addends (arithmetic flushes subnormals), so only the bytes below
    if not any(pl.is_partial(p) for p in placements):
        for t, (g, want) in enumerate(zip(got.logical_tensors(), _tensors(dtype))):
            assert g.dtype == want.dtype
            np.testing.assert_array_equal(as_bytes(g), as_bytes(want), err_msg=NAMES[t])
    # the physical buffer, padding and Partial addends included, equals host packing
    ref = DBuffer.distribute_tensors(_tensors(dtype), mesh, placements, layout=got.layout)
    for s_got, s_ref in zip(got.data.addressable_shards, ref.data.addressable_shards):
        np.testing.assert_array_equal(as_bytes(s_got.data), as_bytes(s_ref.data))


def test_restore_by_name_not_position(saved, devices):
    """Tensors listed in another order (two of them share a shape) land by name."""
    mesh = _mesh((len(devices),), ("x",), devices)
    order = [NAMES[1], NAMES[2], NAMES[0]]
    got = DBuffer.restore(saved["f32"][0], mesh, [ROW], names=order)
    want = dict(zip(NAMES, _tensors()))
    assert got.layout.tensor_shapes == tuple(want[n].shape for n in order)
    for name, g in zip(order, got.get_tensors()):
        np.testing.assert_array_equal(as_bytes(g), as_bytes(want[name]), err_msg=name)


def test_mismatches_name_the_path(saved, devices):
    directory = saved["f32"][0]
    mesh = _mesh((len(devices),), ("x",), devices)
    renamed = [NAMES[0], "blocks/1/weight", NAMES[2]]
    with pytest.raises(
        ValueError, match=r"not in the checkpoint: 'blocks/1/weight'[\s\S]*not in the targets: 'blocks/1/w'"
    ):
        DBuffer.restore(directory, mesh, [ROW], names=renamed)
    with pytest.raises(ValueError, match=r"not in the targets: 'head/b'"):
        DBuffer.restore(directory, mesh, [ROW], names=NAMES[:2])
    # a layout whose tensor order differs (equal shapes swapped in would pass a shape-only check)
    swapped = DBuffer.empty(mesh, [ROW], [SHAPES[2], SHAPES[1], SHAPES[0]], np.float32).layout
    with pytest.raises(ValueError, match=r"'blocks/0/w': stored \(64, 32\), layout \(40, 8\)"):
        DBuffer.restore(directory, mesh, [ROW], names=NAMES, layout=swapped)
    sharding = NamedSharding(mesh, PartitionSpec())
    targets = {n: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding) for n, s in zip(NAMES, SHAPES)}
    with pytest.raises(ValueError, match=r"'head/b': stored shape \(40, 8\), target shape \(8, 40\)"):
        ck.restore_logical(
            directory, {**targets, "head/b": jax.ShapeDtypeStruct((8, 40), np.float32, sharding=sharding)}
        )
    with pytest.raises(ValueError, match=r"'blocks/0/w': stored dtype float32, target dtype bfloat16"):
        ck.restore_logical(
            directory, {**targets, NAMES[0]: jax.ShapeDtypeStruct(SHAPES[0], ml_dtypes.bfloat16, sharding=sharding)}
        )
    with pytest.raises(TypeError, match=r"targets\['head/b'\] must be a jax.ShapeDtypeStruct with a sharding"):
        ck.restore_logical(directory, {**targets, "head/b": jax.ShapeDtypeStruct((40, 8), np.float32)})
    got = ck.restore_logical(directory, targets)  # the right targets still read
    np.testing.assert_array_equal(as_bytes(got["head/b"]), as_bytes(_tensors()[2]))


def test_save_arguments(tmp_path, devices):
    n = len(devices)
    mesh = _mesh((n,), ("x",), devices)
    x = jax.device_put(np.ones((n, 4), np.float32), NamedSharding(mesh, PartitionSpec("x")))
    with pytest.raises(TypeError, match="metadata must be JSON serializable"):
        ck.save_logical(tmp_path / "a", {"w": x}, {"rule": object()})
    with pytest.raises(TypeError, match=r"tensors\['w'\] must be a jax.Array"):
        ck.save_logical(tmp_path / "b", {"w": np.ones(3)})
    buf = DBuffer.empty(mesh, [ROW], [(8, 4)], np.float32)
    with pytest.raises(ValueError, match="names has 2 entries for 1 tensors"):
        buf.save(tmp_path / "c", names=["a", "b"])
    with pytest.raises(ValueError, match="not an mxfp8_jax logical checkpoint"):
        ck.read_metadata(tmp_path)


def test_async_save(tmp_path, devices):
    n = len(devices)
    mesh = _mesh((n,), ("x",), devices)
    buf = DBuffer.distribute_tensors(_tensors(), mesh, [ROW], shard_layout=UNPADDED)
    handle = buf.save(tmp_path / "async", names=NAMES, async_save=True)
    handle.wait()
    assert handle.done
    got = DBuffer.restore(tmp_path / "async", _mesh((n // 2,), ("x",), devices), [ROW])
    for g, want in zip(got.get_tensors(), _tensors()):
        np.testing.assert_array_equal(as_bytes(g), as_bytes(want))


def test_quantized_round_trip(tmp_path, devices):
    """Saved by the master on all n devices UNPADDED; restored onto n/2 PADDED: master exact and
    the planes equal quantizing the originals directly on the new layout."""
    shapes = [(64, 64), (32, 96), (96, 32)]
    master_np = [host_tensor(s, t, np.float32, finite=True) for t, s in enumerate(shapes)]
    names = ["attn/q", "attn/o", "mlp/up"]
    n = len(devices)
    mesh_all = _mesh((n,), ("x",), devices)
    q = QuantizedDBuffer.empty(mesh_all, [ROW], shapes, shard_layout=UNPADDED)
    master = DBuffer.distribute_tensors(master_np, mesh_all, [ROW], layout=q.layout)
    q = q.quantize(master, scale_rule="floor")
    q.save(tmp_path / "q", master, scale_rule="floor", names=names)
    assert ck.read_metadata(tmp_path / "q").metadata["scale_rule"] == "floor"

    mesh_half = _mesh((n // 2,), ("x",), devices)
    m2, q2 = QuantizedDBuffer.restore(tmp_path / "q", mesh_half, [ROW], shard_layout=PADDED)
    assert q2.layout.shard_layout is PADDED and q2.layout.rank_segment_offsets != q.layout.rank_segment_offsets
    for g, want in zip(m2.get_tensors(), master_np):
        np.testing.assert_array_equal(as_bytes(g), as_bytes(want))
    ref_master = DBuffer.distribute_tensors(master_np, mesh_half, [ROW], layout=q2.layout)
    ref = QuantizedDBuffer.zeros(mesh_half, [ROW], q2.layout).quantize(ref_master, scale_rule="floor")
    for p_got, p_ref in zip(q2.planes, ref.planes):
        np.testing.assert_array_equal(as_bytes(p_got.allgather().data), as_bytes(p_ref.allgather().data))
    # the logical MXFP8 tensors are the ones saved (layout independent)
    a, b = q.allgather(), q2.allgather()
    for i in range(len(shapes)):
        va, vb = a.get_tensor_view(i), b.get_tensor_view(i)
        for plane in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
            np.testing.assert_array_equal(as_bytes(getattr(va, plane)), as_bytes(getattr(vb, plane)))


def test_distribute_sharded_arrays_without_host_transfer(devices):
    """Sharded inputs (on another mesh of the same devices) pack device to device: with host
    transfers disallowed, and equal to the host packing of the same values."""
    n = len(devices)
    mesh2d = _mesh((2, n // 2), ("a", "b"), devices)
    values = _tensors()
    specs = [PartitionSpec("a"), PartitionSpec(("a", "b")), PartitionSpec(None, "b")]
    arrays = [jax.device_put(v, NamedSharding(mesh2d, s)) for v, s in zip(values, specs)]
    mesh = _mesh((n,), ("x",), devices)
    for layout in (PADDED, UNPADDED):
        with jax.transfer_guard("disallow"):
            buf = DBuffer.distribute_tensors(arrays, mesh, [ROW], shard_layout=layout)
            logical = buf.logical_tensors()
        ref = DBuffer.distribute_tensors(values, mesh, [ROW], shard_layout=layout)  # host packing
        for s_got, s_ref in zip(buf.data.addressable_shards, ref.data.addressable_shards):
            np.testing.assert_array_equal(as_bytes(s_got.data), as_bytes(s_ref.data))
        for g, v in zip(logical, values):
            np.testing.assert_array_equal(as_bytes(g), as_bytes(v))
        # rows split over the n devices where n divides them (64, 96 and 40 rows), else replicated
        assert [g.sharding.spec for g in logical] == [
            PartitionSpec("x", None) if s[0] % n == 0 else PartitionSpec() for s in SHAPES
        ]


def test_logical_sharding_rule(devices):
    n = len(devices)
    mesh = _mesh((2, n // 2), ("a", "b"), devices)
    rows = 3 * n // 2  # a multiple of n/2 but not of n
    assert logical_sharding(mesh, [ROW, ROW], (64, 3)).spec == PartitionSpec(("b", "a"), None)
    assert logical_sharding(mesh, [pl.Replicate(), ROW], (rows,)).spec == PartitionSpec("b")
    assert logical_sharding(mesh, [ROW, ROW], (rows, 3)).spec == PartitionSpec()  # rows % n: replicated
    assert logical_sharding(mesh, [pl.Replicate(), pl.Replicate()], (64,)).spec == PartitionSpec()


def test_two_processes(tmp_path, devices):
    """2 processes x 4 CPU devices: tensors made sharded across both (non-addressable from
    either), packed with no host transfer and saved, then restored here on this process's n
    devices (and n/2), bytes equal; and a checkpoint saved here on n devices restored onto
    (2, 4) across both processes."""
    from _ckpt_workers import NAMES as W_NAMES
    from _ckpt_workers import SHAPES as W_SHAPES

    from multiproc import run_processes

    n = len(devices)
    mesh = _mesh((n,), ("x",), devices)
    here = DBuffer.distribute_tensors([host_tensor(s, t) for t, s in enumerate(W_SHAPES)], mesh, [ROW])
    here.save(tmp_path / "here", names=W_NAMES)
    results = run_processes(
        "tests/_ckpt_workers.py:save_then_restore", 2, args=[str(tmp_path / "there"), str(tmp_path / "here")]
    )
    for i, r in enumerate(results):
        saved, restored = r.result["saved"], r.result["restored"]
        assert saved["process"] == i and saved["devices"] == 8 and saved["local_devices"] == 4
        assert saved["inputs_fully_addressable"] == [False, False, False]
        assert saved["buffer_fully_addressable"] is False
        assert restored["equal"] is True
        # the shards a process holds: tensors split over "b" (4 ways), one process per "a" row
        assert restored["elements_checked"] == sum(int(np.prod(s)) for s in W_SHAPES)
    assert ck.read_metadata(tmp_path / "there").metadata["user"] == {"step": 7}
    for size in (n, n // 2):
        got = DBuffer.restore(tmp_path / "there", _mesh((size,), ("x",), devices), [ROW], names=W_NAMES)
        for t, (g, shape) in enumerate(zip(got.get_tensors(), W_SHAPES)):
            np.testing.assert_array_equal(as_bytes(g), as_bytes(host_tensor(shape, t)), err_msg=W_NAMES[t])


def test_conversions_move_tensor_pieces_not_the_buffer(devices):
    """The compiled conversions move data device to device: one all-to-all per tensor (rows
    split evenly across the shards: the mesh takes the most of the n devices that divides every
    tensor's rows, 64, 96 and 40, i.e. all of them for n = 2, 4, 8), each device exchanging
    messages of one tensor's size at most, never the whole buffer."""
    from mxfp8_jax._src.compiled import hlo

    shards = math.gcd(len(devices), *(s[0] for s in SHAPES))
    mesh = _mesh((shards,), ("x",), devices)
    buf = DBuffer.distribute_tensors(_tensors(), mesh, [ROW], shard_layout=UNPADDED)
    lay = buf.layout
    to_logical = jax.jit(lambda b: b.logical_tensors()).lower(buf).compile().as_text()
    arrays = buf.logical_tensors()
    to_flat = jax.jit(lambda *ts: pack_logical(ts, mesh, [ROW], lay, np.float32))
    to_flat = to_flat.lower(*arrays).compile().as_text()
    for text in (to_logical, to_flat):
        ops = hlo.collectives(text)
        assert [c.op for c in ops] == ["all-to-all"] * lay.num_tensors
        # messages padded to the largest: at most each tensor's size (4 bytes an element)
        assert sorted(c.bytes for c in ops) == sorted(4 * lay.numel(i) for i in range(lay.num_tensors))
        assert max(c.bytes for c in ops) < 4 * lay.physical_size
