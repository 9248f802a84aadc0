"""The kernels' partitioning rules: under jit a sharded input stays sharded (docs/design.md §7).

Every case runs the kernel (backend="ffi") on the run's n devices, on a line ``(n,)`` or a grid
``(n // 2, 2)`` mesh, with shapes derived from the mesh, and checks, from what XLA compiled,
the shape each device's custom call sees and the collectives around it; the planes' bytes are
compared with an independent numpy oracle (quantize) or with the single-device call (RMSNorm,
segments), and the planes' shardings with the input's. Both partitioners are covered: Shardy
(jax's default; the rule's ``sdy.sharding_rule``) and GSPMD (its callbacks). The CUDA/ROCm part
is HLO only, on CPU devices: the lowered module carries the same rule, and the per-shard body
lowers to the GPU call on the local shape.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax._src.kernels import ffi_calls

import numpy_oracle as oracle
import rmsnorm_oracle
from conftest import as_bytes, cpu_only, need_devices

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")

PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


# Every case runs under Shardy (jax's default); one of each kind under GSPMD as well.
GSPMD_CASES = {"rows", "rows-and-columns", "n-d-leading-axes", "longest-prefix-kept", "h-cut-is-gathered"}


def _with_partitioners(cases):
    """``(partitioner, case)`` pairs for parametrize."""
    pairs = [("shardy", c) for c in cases] + [("gspmd", c) for c in cases if c in GSPMD_CASES]
    return pytest.mark.parametrize("partitioner,case", pairs, indirect=["partitioner"])


@pytest.fixture
def partitioner(request):
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):  # a jax with Shardy only
        if request.param == "gspmd":
            pytest.skip("this jax has no GSPMD partitioner to switch to")
        yield request.param
        return
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", old)


# The meshes of a case, and the devices each needs: "line" is all n devices on one axis x;
# "grid" is (n // 2, 2) with both axes cut, so 4 devices at least; "grid-x4" is the grid with an
# x of 4 or more devices, which has a proper sub-axis (8 devices at least).
NEEDS = {"line": 2, "grid": 4, "grid-x4": 8}


def _mesh(devices, kind):
    """The case's mesh over the run's devices (skips, counted, where the run has too few)."""
    need_devices(NEEDS[kind])
    n = len(devices)
    if kind == "line":
        return Mesh(np.array(devices), ("x",))
    return Mesh(np.array(devices[: n // 2 * 2]).reshape(n // 2, 2), ("x", "y"))


def _random(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 4
    return jnp.asarray(x, jnp.bfloat16)


def _local_calls(compiled_text, target):
    """Operand shapes of each ``target`` custom call in compiled HLO: what one device runs on."""
    calls = []
    for line in compiled_text.splitlines():
        if f'custom_call_target="{target}"' in line:
            operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line).group(1)
            calls.append([tuple(int(d) for d in s.split(",") if d) for s in re.findall(r"\w+\[([\d,]*)\]", operands)])
    return calls


# ------------------------------------------------------------------------------------------------
# quantize: the cut is kept


KEPT = {
    # name: (mesh, input spec, input shape for the mesh's shape s, rowwise, columnwise,
    #        (M axes, K axes) of the planes)
    # one columnwise block of 32 rows a device
    "rows": ("line", P("x"), lambda s: (32 * s[0], 64), True, True, ("x", None)),
    # one block of 32 columns a device
    "columns": ("line", P(None, "x"), lambda s: (32, 32 * s[0]), True, True, (None, "x")),
    # [32, 64] a device
    "rows-and-columns": ("grid", P("x", "y"), lambda s: (32 * s[0], 64 * s[1]), True, True, ("x", "y")),
    "rows-over-both-axes": ("grid", P(("x", "y")), lambda s: (32 * s[0] * s[1], 64), True, True, (("x", "y"), None)),
    # [1, 32, 64] a device: the M view [32, 64] cut over both axes
    "n-d-leading-axes": ("grid", P("x", "y", None), lambda s: (s[0], 32 * s[1], 64), True, True, (("x", "y"), None)),
    "rowwise-3-rows-a-shard": ("line", P("x"), lambda s: (3 * s[0], 64), True, False, ("x", None)),
    "columnwise-k-cut": ("line", P(None, "x"), lambda s: (32, 32 * s[0]), False, True, (None, "x")),
}


@_with_partitioners(KEPT)
def test_quantize_keeps_sharding(case, devices, partitioner):
    kind, spec, shape_for, rowwise, columnwise, (m_axes, k_axes) = KEPT[case]
    mesh = _mesh(devices, kind)
    shape = shape_for(tuple(mesh.shape.values()))
    x = _random(shape)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    fn = jax.jit(lambda a: mx.quantize(a, rowwise=rowwise, columnwise=columnwise, backend="ffi"))
    text = fn.lower(xs).compile().as_text()
    assert hlo.counts_by_op(text) == {}, "the kernel's input or planes were moved between devices"
    view = NamedSharding(mesh, P(m_axes, k_axes))
    m, k = int(np.prod(shape[:-1])), shape[-1]
    assert _local_calls(text, "mxfp8_quantize") == [[view.shard_shape((m, k))]]

    t = fn(xs)
    want = oracle.quantize(np.asarray(x).reshape(m, k))
    for plane in PLANES:
        got = getattr(t, plane)
        if got is None:
            assert not (rowwise if plane.startswith("rowwise") else columnwise)
            continue
        assert got.sharding.is_equivalent_to(view, 2), f"{plane}: {got.sharding.spec} is not {view.spec}"
        np.testing.assert_array_equal(as_bytes(got), as_bytes(want[plane]), err_msg=plane)


# ------------------------------------------------------------------------------------------------
# quantize: a cut that splits blocks is undone, and only that one

RESHARDED = {
    # name: (mesh, input spec, input shape for the mesh's shape s, rowwise, columnwise,
    #        shape each device's call sees)
    # 16 rows a shard: no whole columnwise block, so the rows are gathered (K was not cut)
    "columnwise-16-rows-a-shard": ("line", P("x"), lambda s: (16 * s[0], 128), True, True, lambda s: (16 * s[0], 128)),
    # 16 columns a shard: no whole rowwise block, so K is gathered, rows stay cut
    "rowwise-16-columns-a-shard": (
        "grid",
        P("x", "y"),
        lambda s: (32 * s[0], 16 * s[1]),
        True,
        False,
        lambda s: (32, 16 * s[1]),
    ),
    # rows of 16 over both axes: too few; the first axis alone (32 rows a device) is kept
    "longest-prefix-kept": ("grid", P(("x", "y")), lambda s: (32 * s[0], 64), True, True, lambda s: (32, 64)),
    # 2 blocks of rows over an x of 4 or more: propagation may cut 2 of the devices of axis x,
    # a sub-axis no PartitionSpec names: the rows are gathered
    "unnamed-sub-axis": ("grid-x4", P(("x", "y")), lambda s: (64, 256), True, True, lambda s: (64, 256)),
}


@_with_partitioners(RESHARDED)
def test_quantize_reshards_split_blocks(case, devices, partitioner):
    kind, spec, shape_for, rowwise, columnwise, local_for = RESHARDED[case]
    mesh = _mesh(devices, kind)
    shape, local = shape_for(tuple(mesh.shape.values())), local_for(tuple(mesh.shape.values()))
    x = _random(shape, seed=1)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    fn = jax.jit(lambda a: mx.quantize(a, rowwise=rowwise, columnwise=columnwise, backend="ffi"))
    text = fn.lower(xs).compile().as_text()
    assert _local_calls(text, "mxfp8_quantize") == [[local]]
    assert set(hlo.counts_by_op(text)) <= {"all-gather", "all-to-all", "collective-permute"}
    assert hlo.counts_by_op(text).get("all-gather", 0) >= 1
    t = fn(xs)
    want = oracle.quantize(np.asarray(x))
    for plane in PLANES:
        if getattr(t, plane) is not None:
            np.testing.assert_array_equal(as_bytes(getattr(t, plane)), as_bytes(want[plane]), err_msg=plane)


@pytest.mark.parametrize("backend", ["auto", "ffi"])
def test_issue_example_memory(backend, devices):
    """Row-sharded [4096, 1024] bf16 over the run's n devices: each device holds 1/n of the planes
    and no copy of the whole input (before the rule, at 8 devices: 8.25 MiB of planes and 24 MiB
    of temp each)."""
    cpu_only("XLA:CPU's memory_analysis of the partitioned quantize")
    mesh = _mesh(devices, "line")
    n = len(devices)
    xs = jax.device_put(jnp.zeros((4096, 1024), jnp.bfloat16), NamedSharding(mesh, P("x")))
    compiled = jax.jit(lambda a: mx.quantize(a, backend=backend)).lower(xs).compile()
    assert hlo.counts_by_op(compiled.as_text()) == {}
    mem = compiled.memory_analysis()
    planes = 4096 * 1024 * 2 + 4096 * 32 + 128 * 1024  # both codes planes and both scales
    assert mem.output_size_in_bytes <= planes // n + 1024
    assert mem.temp_size_in_bytes < 4096 * 1024 * 2 // n  # less than one device's share of x


# ------------------------------------------------------------------------------------------------
# RMSNorm + quantize: rows stay cut, H is whole on every device


NORM = {
    # name: (mesh, input spec, input shape for the mesh's shape s, columnwise,
    #        shape each call sees, collectives?)
    "rows": ("line", P("x"), lambda s: (32 * s[0], 256), True, lambda s: (32, 256), False),
    "rows-rowwise-4-a-shard": ("line", P("x"), lambda s: (4 * s[0], 64), False, lambda s: (4, 64), False),
    "h-cut-is-gathered": ("grid", P("x", "y"), lambda s: (32 * s[0], 256), True, lambda s: (32, 256), True),
    # 16 rows a shard: no whole columnwise block, so the rows are gathered
    "columnwise-16-rows-a-shard": ("line", P("x"), lambda s: (16 * s[0], 64), True, lambda s: (16 * s[0], 64), True),
}


@_with_partitioners(NORM)
def test_rmsnorm_keeps_rows(case, devices, partitioner):
    kind, spec, shape_for, columnwise, local_for, gathers = NORM[case]
    mesh = _mesh(devices, kind)
    shape, local = shape_for(tuple(mesh.shape.values())), local_for(tuple(mesh.shape.values()))
    x, gamma = _random(shape, seed=2), _random(shape[-1:], seed=3)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    fn = jax.jit(lambda a, g: mx.rmsnorm_quant(a, g, eps=1e-5, columnwise=columnwise, backend="ffi"))
    text = fn.lower(xs, gamma).compile().as_text()
    assert _local_calls(text, "mxfp8_rmsnorm_quantize") == [[local, shape[-1:]]]
    assert bool(hlo.counts_by_op(text)) == gathers
    got = fn(xs, gamma)
    if not gathers:
        for a in got:
            assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    normed, _ = rmsnorm_oracle.canonical(x, gamma, eps=1e-5)
    np.testing.assert_array_equal(as_bytes(got[0]), as_bytes(normed))
    want = oracle.quantize(normed)
    for a, plane in zip(got[1:], PLANES):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(want[plane]), err_msg=plane)


# ------------------------------------------------------------------------------------------------
# the packed-segment quantize: one indivisible segment


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"], indirect=True)
def test_segments_are_replicated(devices, partitioner):
    """The descriptor addresses the whole segment, so a sharded segment is gathered and each
    device runs the full call; the bytes are the single-device call's. (QuantizedDBuffer calls
    it per device inside shard_map, where no rule applies.) The segment is cut over both axes
    of the (n // 2, 2) mesh: n ways (at 2 devices x has one device, y still cuts it)."""
    n = len(devices)
    mesh = Mesh(np.array(devices[: n // 2 * 2]).reshape(n // 2, 2), ("x", "y"))
    s = 4096
    x = _random((s,), seed=4)
    desc = jnp.asarray([[0, 64, 32], [2048, 32, 64], [s, 0, 32]], jnp.int32)
    fn = jax.jit(lambda a, d: ffi_calls.quantize_segments(a, d, scale_rule=0, rowwise=True, columnwise=True))
    xs = jax.device_put(x, NamedSharding(mesh, P(("x", "y"))))
    text = fn.lower(xs, desc).compile().as_text()
    assert _local_calls(text, "mxfp8_quantize_segments") == [[(s,), (3, 3)]]
    got = jax.tree.leaves(fn(xs, desc))
    with jax.default_device(devices[0]):
        want = jax.tree.leaves(fn(x, desc))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))


# ------------------------------------------------------------------------------------------------
# vmap (custom partitioning has no batching rule of its own)


@pytest.mark.parametrize("batched_gamma", [False, True])
def test_rmsnorm_vmap_matches_per_example(batched_gamma):
    x = _random((3, 64, 64), seed=5)
    gamma = _random((3, 64) if batched_gamma else (64,), seed=6)
    f = lambda a, g: mx.rmsnorm_quant(a, g, columnwise=True, backend="ffi")
    got = jax.jit(jax.vmap(f, in_axes=(0, 0 if batched_gamma else None)))(x, gamma)
    for i in range(3):
        want = f(x[i], gamma[i] if batched_gamma else gamma)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(as_bytes(a[i]), as_bytes(b))


# ------------------------------------------------------------------------------------------------
# CUDA / ROCm lowering (HLO only)


def _lowered(fn, args, shardings, platform):
    return jax.jit(fn, in_shardings=shardings).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _lowering_mesh_devices() -> list:
    """The run's simulated CPU devices, for a mesh that is only lowered for CUDA/ROCm.

    CPU devices in GPU mode too (MXFP8_TEST_PLATFORM=gpu still gives the run its
    MXFP8_TEST_DEVICES CPU devices): the test checks what a CPU-only machine hands a GPU and
    needs neither a real GPU count nor a GPU runtime (nor a ROCm lowering of CUDA devices)."""
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        pytest.skip(f"needs 2 devices; this run has {len(cpus)} simulated CPU devices")
    return cpus


@pytest.mark.multidevice
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_gpu_lowering_carries_the_rule(platform):
    devices = _lowering_mesh_devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    sds = jax.ShapeDtypeStruct
    rows = NamedSharding(mesh, P("x"))

    call = ffi_calls._quantize_call(1, True, True)
    x = sds((32 * n, 64), jnp.bfloat16)  # one block of 32 rows a device
    text = _lowered(lambda a: ffi_calls.quantize(a, scale_rule=1, rowwise=True, columnwise=True), (x,), rows, platform)
    # [M, K] = [(blocks, 32), (blocks, 32)]: M / 32 = n and K / 32 = 2 blocks; scales on the
    # blocks factors; never split a block
    assert re.search(
        r"@CustomSPMDPartitioning\(.*sdy\.sharding_rule = #sdy\.op_sharding_rule<\(\[ij, kl\]\)->"
        r"\(\[ij, kl\], \[ij, k\], \[ij, kl\], \[i, kl\]\) "
        rf"\{{i={n}, j=32, k=2, l=32\}} need_replication=\{{j, l\}}",
        text,
    ), text
    # the partitioner's callback keeps the rows cut; its body is the GPU call on the local shape
    _, body, results, args = call.partition(mesh, (sds(x.shape, x.dtype, sharding=rows),))
    assert all(r.spec == P("x", None) for r in results) and args[0].spec == P("x", None)
    local = jax.jit(body).trace(sds(args[0].shard_shape(x.shape), x.dtype)).lower(lowering_platforms=(platform,))
    assert re.search(r"stablehlo\.custom_call @mxfp8_quantize\(%\w+\).*: \(tensor<32x64xbf16>\)", local.as_text())

    g = sds((256,), jnp.bfloat16)
    text = _lowered(
        lambda a, b: ffi_calls.rmsnorm_quantize(
            a, b, eps=1e-6, weight_offset=0.0, quantize_from_fp32=False, columnwise=False, scale_rule=1
        ),
        (sds((32 * n, 256), jnp.bfloat16), g),
        (NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P())),
        platform,
    )
    # H = (blocks, 32) is one factor kept whole (need_replication), rows pass through
    assert re.search(r"@CustomSPMDPartitioning\(.*op_sharding_rule<\(\[i, jk\], \[jk\]\)->", text), text
    assert "need_replication={j, k}" in text
