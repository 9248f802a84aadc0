"""The GPU kernels (CUDA or ROCm) byte for byte against the references, on a GPU.

Run by bench/gpu_check.sh on a machine with a GPU (``MXFP8_TEST_PLATFORM=gpu``; in a CPU run
conftest does not collect this file, and in GPU mode a GPU jax cannot start stops the run). Every
test is marked ``gpu`` and skipped, saying why, when the installed extension has no handler for
the GPU. References run on the CPU backend: the pure-JAX
quantize reference (integer code, exact there), the independent numpy quantize oracle, and the
numpy oracle of the canonical RMSNorm order (tests/rmsnorm_oracle.py). The compiled GPU program
is checked to contain the custom call, so no test can pass through a silent fallback.

The experimental p2p gather (strategy="p2p") is compared with strategy="xla" on the same GPUs
and with the CPU kernel: on one GPU always, on 2, 4 and 8 GPUs where this process has them.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src.buffers.segments import quantize_segments_reference
from mxfp8_jax._src.compiled.hlo import collectives as hlo_collectives
from mxfp8_jax._src.kernels import _ffi, ffi_calls

from conftest import as_bytes
from rmsnorm_oracle import BF16, canonical

PLATFORM = _ffi.gpu_platform()
TARGETS = ("mxfp8_quantize", "mxfp8_quantize_segments", "mxfp8_rmsnorm_quantize")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(PLATFORM is None, reason="no GPU visible to jax (MXFP8_TEST_PLATFORM=gpu?)"),
    pytest.mark.skipif(
        PLATFORM is not None and not all(_ffi.has_target(t, PLATFORM) for t in TARGETS),
        reason=f"the installed extension has no {PLATFORM} handlers (build with MXFP8_CUDA=ON)",
    ),
]

PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


def _cpu():
    return jax.devices("cpu")[0]


def _gpu_jit(fn, target):
    """jit for the GPU, refusing a program that does not call the GPU handler ``target``."""
    jitted = jax.jit(fn)

    @functools.wraps(fn)
    def run(*args):
        args = [jax.device_put(a, jax.devices()[0]) for a in args]
        hlo = jitted.lower(*args).compile().as_text()
        assert target in hlo, f"the GPU program does not call {target}"
        return jitted(*args)

    return run


@functools.cache
def _gpu_quantize(rule, rowwise, columnwise):
    return _gpu_jit(
        lambda x: mx.quantize(x, rowwise=rowwise, columnwise=columnwise, scale_rule=rule),
        "mxfp8_quantize",
    )


@functools.cache
def _cpu_quantize(rule, rowwise, columnwise):
    return jax.jit(lambda x: mx.quantize(x, rowwise=rowwise, columnwise=columnwise, scale_rule=rule, backend="jax"))


def _check_quantize(x, rule="rceil", rowwise=True, columnwise=True):
    got = _gpu_quantize(rule, rowwise, columnwise)(x)
    ref = _cpu_quantize(rule, rowwise, columnwise)(jax.device_put(x, _cpu()))
    for name in PLANES:
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(as_bytes(a), as_bytes(b), err_msg=f"{name} ({rule})")


# ------------------------------------------------------------------------------------------------
# mxfp8_quantize


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (256, 4128), (4, 96, 2048)])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_random(dtype, shape, rule):
    rng = np.random.default_rng(hash((str(dtype), shape, rule)) % 2**32)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape[:-1] + (1,)))
    _check_quantize(jnp.asarray(x, dtype), rule)


@pytest.mark.parametrize("rows", [1, 7, 33, 1000])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_rowwise_any_rows(rows, dtype):
    x = np.random.default_rng(rows).standard_normal((rows, 160))
    _check_quantize(jnp.asarray(x, dtype), rowwise=True, columnwise=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_columnwise_only(dtype):
    x = np.random.default_rng(5).standard_normal((96, 288))
    _check_quantize(jnp.asarray(x, dtype), rowwise=False, columnwise=True)


# ------------------------------------------------------------------------------------------------
# mxfp8_quantize_tiles (32x32 blocks)


@functools.cache
def _gpu_tiles(rule):
    return _gpu_jit(lambda x: mx.quantize(x, blocks="32x32", scale_rule=rule), "mxfp8_quantize_tiles")


def _check_tiles(x, rule="rceil"):
    got = _gpu_tiles(rule)(x)
    ref = jax.jit(lambda a: mx.quantize(a, blocks="32x32", scale_rule=rule, backend="jax"))(jax.device_put(x, _cpu()))
    np.testing.assert_array_equal(as_bytes(got.data), as_bytes(ref.data), err_msg=f"codes ({rule})")
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(ref.scale), err_msg=f"tile scales ({rule})")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (256, 4128), (4, 96, 2048)])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_tiles_random(dtype, shape, rule):
    rng = np.random.default_rng(hash(("tiles", str(dtype), shape, rule)) % 2**32)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape[:-1] + (1,)))
    _check_tiles(jnp.asarray(x, dtype), rule)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_tiles_all_16bit_patterns(dtype, rule):
    _check_tiles(_all_16bit(dtype, 0), rule)


def _all_16bit(dtype, seed):
    """All 65,536 bit patterns of a 16-bit float type, shuffled into a [2048, 32] matrix."""
    bits = np.random.default_rng(seed).permutation(np.arange(65536, dtype=np.uint16))
    return jnp.asarray(bits.view(dtype).reshape(2048, 32))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_all_16bit_patterns(dtype, rule, seed):
    x = _all_16bit(dtype, seed)
    _check_quantize(x, rule)
    _check_quantize(x.reshape(256, 256), rule)  # other block mixes, both directions


def _edge_blocks():
    """Blocks whose amax sits on the scale boundaries 448 * 2^k (and just around them), zero,
    subnormal, NaN-only, Inf and mixed blocks, as fp32 rows of 32."""
    rows = []
    for k in range(-140, 128, 3):
        for mult in (1.0, np.nextafter(np.float32(1), np.float32(0)), np.nextafter(np.float32(1), np.float32(2))):
            amax = np.float32(448.0) * np.float32(mult) * np.float32(2.0 ** max(k, -149))
            row = np.linspace(-1, 1, 32, dtype=np.float32) * amax
            row[3] = amax
            rows.append(row)
    rows.append(np.zeros(32, np.float32))
    rows.append(-np.zeros(32, np.float32))
    rows.append(np.full(32, np.float32(1e-45)))
    rows.append(np.arange(32, dtype=np.float32) * np.float32(1e-45))
    rows.append(np.full(32, np.nan, np.float32))
    mixed = np.linspace(-3, 3, 32, dtype=np.float32)
    for special in (np.inf, -np.inf, np.nan, -np.nan):
        r = mixed.copy()
        r[7] = special
        rows.append(r)
    rows.append(np.full(32, np.float32(3.4e38)))
    x = np.stack(rows)
    return x[: len(x) // 32 * 32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_edge_cases(dtype, rule):
    x = _edge_blocks()
    _check_quantize(jnp.asarray(x, dtype), rule)
    _check_quantize(jnp.asarray(np.ascontiguousarray(x.T), dtype), rule)


def test_quantize_random_f32_bits():
    """Arbitrary fp32 bit patterns: every exponent, subnormals, NaN payloads, both signs."""
    bits = np.random.default_rng(11).integers(0, 2**32, (512, 256), dtype=np.uint64).astype(np.uint32)
    _check_quantize(jnp.asarray(bits.view(np.float32)))


# ------------------------------------------------------------------------------------------------
# mxfp8_quantize_segments


def _segment_case(rng, s, dtype):
    pieces, at = [], 0
    while True:
        k = int(rng.choice([32, 96, 256, 4096]))
        rows = 32 * int(rng.integers(1, 5))
        off = at + 32 * int(rng.choice([0, 0, 1, 7, 40]))
        if off + rows * k > s:
            break
        pieces.append((off, rows, k))
        at = off + rows * k
    # The kernel takes the table in any order (unused rows anywhere); the pure-JAX reference
    # wants it sorted by offset, unused rows (s, 0, 32) last, as descriptor_table builds it.
    order = rng.permutation(len(pieces))
    shuffled = np.array([pieces[j] for j in order] + [(0, 0, 0)] * 2, np.int32)
    ordered = np.array(sorted(pieces) + [(s, 0, 32)] * 2, np.int32)
    x = (rng.standard_normal(s) * 4).astype(dtype)
    return x, shuffled, ordered


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("seed", range(3))
def test_quantize_segments(dtype, rowwise, columnwise, seed):
    rng = np.random.default_rng(seed)
    x, desc, ordered = _segment_case(rng, 1 << 17, dtype)
    x = np.where(rng.random(x.shape) < 0.001, np.nan, x).astype(dtype)  # some NaN tiles
    kernel = _gpu_jit(
        lambda x, d: ffi_calls.quantize_segments(x, d, scale_rule=0, rowwise=rowwise, columnwise=columnwise),
        "mxfp8_quantize_segments",
    )
    (rq, rs), (cq, cs) = kernel(jnp.asarray(x), jnp.asarray(desc))
    got = [p for p in (rq, rs, cq, cs) if p is not None]
    ref = jax.jit(lambda x, d: quantize_segments_reference(x, d, mx.ScaleRule.RCEIL, rowwise, columnwise))(
        jax.device_put(jnp.asarray(x), _cpu()), jax.device_put(jnp.asarray(ordered), _cpu())
    )
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))


# ------------------------------------------------------------------------------------------------
# mxfp8_rmsnorm_quantize


@functools.cache
def _gpu_norm(eps, offset, quantize_from, columnwise):
    return _gpu_jit(
        lambda x, g: mx.rmsnorm_quant(
            x, g, eps=eps, weight_offset=offset, quantize_from=quantize_from, columnwise=columnwise
        ),
        "mxfp8_rmsnorm_quantize",
    )


@pytest.mark.parametrize("r,h", [(1, 32), (33, 96), (64, 288), (32, 4096), (96, 8192), (32, 8448), (8, 16384)])
@pytest.mark.parametrize("quantize_from", ["normed", "fp32"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_rmsnorm_quantize(r, h, quantize_from, columnwise):
    if columnwise and r % 32:
        pytest.skip("columnwise planes need R % 32 == 0 (rejected by the wrapper, tested on CPU)")
    rng = np.random.default_rng(r * h)
    eps, offset = 1e-5, (1.0 if h % 64 else 0.0)
    x = (rng.standard_normal((r, h)) * np.exp2(rng.integers(-20, 20, (r, 1)))).astype(BF16)
    gamma = (rng.standard_normal(h) * 0.5 + 1.0).astype(BF16)
    out = _gpu_norm(eps, offset, quantize_from, columnwise)(jnp.asarray(x), jnp.asarray(gamma))
    normed_ref, y = canonical(x, gamma, eps=eps, offset=offset)
    np.testing.assert_array_equal(as_bytes(out[0]), as_bytes(normed_ref))
    src = jnp.asarray(y if quantize_from == "fp32" else normed_ref)
    ref = _cpu_quantize("rceil", True, columnwise)(jax.device_put(src, _cpu()))
    np.testing.assert_array_equal(as_bytes(out[1]), as_bytes(ref.rowwise_data))
    np.testing.assert_array_equal(as_bytes(out[2]), as_bytes(ref.rowwise_scale))
    if columnwise:
        np.testing.assert_array_equal(as_bytes(out[3]), as_bytes(ref.columnwise_data))
        np.testing.assert_array_equal(as_bytes(out[4]), as_bytes(ref.columnwise_scale))


def test_rmsnorm_quantize_specials():
    """Rows with zeros (inv = 1/sqrt(eps)), Inf, NaN and tiny values: NaN tiles take the exact
    path, and every byte still matches."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 512))).astype(np.float32)
    x[0] = 0
    x[1, 5] = np.inf
    x[2, 9] = np.nan
    x[3] *= 1e-38
    x = x.astype(BF16)
    gamma = np.ones(512, BF16)
    for quantize_from in ("normed", "fp32"):
        out = _gpu_norm(1e-6, 0.0, quantize_from, True)(jnp.asarray(x), jnp.asarray(gamma))
        normed_ref, y = canonical(x, gamma, eps=1e-6)
        np.testing.assert_array_equal(as_bytes(out[0]), as_bytes(normed_ref))
        src = jnp.asarray(y if quantize_from == "fp32" else normed_ref)
        ref = _cpu_quantize("rceil", True, True)(jax.device_put(src, _cpu()))
        for got, name in zip(out[1:], PLANES):
            np.testing.assert_array_equal(as_bytes(got), as_bytes(getattr(ref, name)), err_msg=name)


# ------------------------------------------------------------------------------------------------
# mxfp8_allgather_rmsnorm_quantize: strategy="p2p" on GPUs (experimental)
#
# The p2p outputs must equal, byte for byte, those of strategy="xla" on the same GPUs and those
# of the CPU kernel on as many CPU devices. A one-GPU mesh is a group of one: it still runs the
# gather kernel, the events and both meetings of the rendezvous.

P2P_TARGET = "mxfp8_allgather_rmsnorm_quantize"
needs_p2p = pytest.mark.skipif(
    PLATFORM is not None and not (_ffi.has_target(P2P_TARGET, PLATFORM) and _ffi.has_target(P2P_TARGET, "cpu")),
    reason=f"the installed extension lacks the {P2P_TARGET} handler for {PLATFORM} or cpu",
)
# The warning is checked once, by test_p2p_warns_once; elsewhere it is expected noise.
quiet_p2p = pytest.mark.filterwarnings("ignore::mxfp8_jax.ExperimentalGpuP2PWarning")


def _gpus(n):
    gpus = [d for d in jax.devices() if d.platform != "cpu"]
    if len(gpus) < n:
        pytest.skip(f"needs {n} devices; jax sees {len(gpus)} GPUs in this process")
    return gpus[:n]


def _gather(devices, x, gamma, strategy, **kw):
    mesh = Mesh(np.array(devices), ("x",))
    return mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy=strategy, **kw)


def _gather_hlo(devices, x, gamma, **kw):
    mesh = Mesh(np.array(devices), ("x",))
    fn = lambda x, g: mx.allgather_rmsnorm_quant(x, g, mesh=mesh, axis="x", **kw)
    return jax.jit(fn).lower(x, gamma).compile().as_text()


def _check_p2p(n, rows_max, h, counts, *, group_size=None, per_device_gamma=False, seed=0, **kw):
    gpus = _gpus(n)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n * rows_max, h)) * np.exp2(rng.integers(-8, 8, (n * rows_max, 1)))).astype(BF16)
    gamma = (rng.standard_normal((n, h) if per_device_gamma else (h,)) * 0.5 + 1.0).astype(BF16)
    kw = dict(kw, row_counts=counts, group_size=group_size)
    hlo = _gather_hlo(gpus, x, gamma, strategy="p2p", **kw)
    assert P2P_TARGET in hlo, "the GPU program does not call the p2p handler"
    assert hlo_collectives(hlo) == []
    p2p = _gather(gpus, x, gamma, "p2p", **kw)
    refs = {
        "xla on the GPUs": _gather(gpus, x, gamma, "xla", **kw),
        "p2p on CPU devices": _gather(jax.devices("cpu")[:n], x, gamma, "p2p", **kw),
    }
    names = ("normed", "quant", "scales", "residual", "col_quant", "col_scales")
    for ref_name, ref in refs.items():
        assert len(p2p) == len(ref)
        for name, a, b in zip(names, p2p, ref):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, ref_name)
            np.testing.assert_array_equal(as_bytes(a), as_bytes(b), err_msg=f"{name} vs {ref_name}")
    # the residual is the gathered x itself
    g = group_size or n
    rows = np.concatenate([x[k * rows_max : k * rows_max + counts[k]] for k in range(g)])
    res = np.asarray(p2p[3])
    np.testing.assert_array_equal(as_bytes(res[: len(rows)]), as_bytes(rows))
    return p2p


@needs_p2p
@quiet_p2p
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
@pytest.mark.parametrize("quantize_from", ["normed", "fp32"])
def test_p2p_one_gpu(columnwise, scale_rule, quantize_from):
    # ragged: 64 valid rows of 72 (columnwise needs R % 32 == 0), else 37 of 40
    rows_max, count = (72, 64) if columnwise else (40, 37)
    _check_p2p(
        1,
        rows_max,
        4096,
        (count,),
        columnwise=columnwise,
        scale_rule=scale_rule,
        quantize_from=quantize_from,
        eps=1e-5,
        weight_offset=1.0,
    )


@needs_p2p
@quiet_p2p
@pytest.mark.parametrize("h", [32, 288, 8448])
def test_p2p_one_gpu_widths(h):
    """Rows held in registers (H <= 8192) and re-read (wider); H not a multiple of 256."""
    _check_p2p(1, 33, h, (33,))


@needs_p2p
@quiet_p2p
def test_p2p_one_gpu_repeated_in_a_scan():
    """Many calls of one op in one program and across executions: events and meetings are per
    call, and every step must see its own rows."""
    gpus = _gpus(1)
    mesh = Mesh(np.array(gpus), ("x",))
    steps, h = 50, 256
    xs = (np.random.default_rng(9).standard_normal((steps, 8, h))).astype(BF16)
    gamma = np.ones(h, BF16)

    def run(strategy):
        def body(carry, xk):
            normed, _, _, res = mx.allgather_rmsnorm_quant_local(xk, gamma, axis_name="x", strategy=strategy)
            return carry, (normed, res)

        f = jax.shard_map(
            lambda xl: jax.lax.scan(body, 0, xl)[1],
            mesh=mesh,
            in_specs=P(None, "x"),
            out_specs=P(None, "x"),
            check_vma=False,
        )
        return jax.jit(f)(xs)

    for _ in range(2):  # a second execution: new run id, same op ids
        p2p, xla = run("p2p"), run("xla")
        for a, b in zip(p2p, xla):
            np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
        np.testing.assert_array_equal(as_bytes(p2p[1]), as_bytes(xs))


@needs_p2p
def test_p2p_warns_once(monkeypatch):
    from mxfp8_jax._src.ops import fused as fused_impl

    monkeypatch.setattr(fused_impl, "_warned_gpu_p2p", False)
    gpus = _gpus(1)
    x, gamma = np.ones((32, 64), BF16), np.ones(64, BF16)
    with pytest.warns(mx.ExperimentalGpuP2PWarning, match="untested on multi-GPU"):
        _gather(gpus, x, gamma, "p2p")
    # "auto" never picks the GPU p2p path
    assert P2P_TARGET not in _gather_hlo(gpus, x, gamma, strategy="auto")


@needs_p2p
@quiet_p2p
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("columnwise,scale_rule", [(False, "rceil"), (True, "floor")])
def test_p2p_gpus(n, columnwise, scale_rule):
    counts = ((16, 48, 0, 32, 8, 24, 40, 24) if columnwise else (3, 0, 17, 1, 9, 2, 0, 5))[:n]
    if columnwise and sum(counts) % 32:
        counts = (32,) * n
    _check_p2p(n, max(counts), 1024, counts, columnwise=columnwise, scale_rule=scale_rule)


@needs_p2p
@quiet_p2p
@pytest.mark.parametrize("n", [4, 8])
def test_p2p_gpus_groups_and_per_device_gamma(n):
    g = n // 2
    # ragged, a rank with no rows, the same total per group (16 rows, or 8 for n = 4)
    counts = (5, 0, 3, 8, 4, 4, 8, 0) if n == 8 else (5, 3, 4, 4)
    _check_p2p(n, 8, 512, counts, group_size=g, per_device_gamma=True, weight_offset=1.0)


@needs_p2p
@quiet_p2p
def test_p2p_gpus_missing_peer_fails_with_deadline():
    gpus = _gpus(2)
    mesh = Mesh(np.array(gpus), ("x",))
    h = 64
    gamma = np.ones(h, BF16)

    def local(xl):
        def call(v):
            return mx.allgather_rmsnorm_quant_local(v, gamma, axis_name="x", strategy="p2p", p2p_timeout_s=1.0)[0][:4]

        # rank 1 never reaches the gather
        return jax.lax.cond(jax.lax.axis_index("x") == 0, call, lambda v: jnp.zeros((4, h), jnp.bfloat16), xl)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    x = np.ones((8, h), BF16)
    with pytest.raises(Exception, match=r"ranks \[1\].*did not arrive") as info:
        jax.block_until_ready(f(x))
    assert "DEADLINE" in str(info.value).upper()
    _check_p2p(2, 4, h, (4, 4))  # the process is still usable
