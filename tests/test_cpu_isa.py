"""The CPU kernels are built for several instruction sets (baseline x86-64, AVX2, AVX-512) and
run the best one this CPU has; the rest of the suite tests that one. Here every other one this
CPU can run is selected in turn and must give the oracle's bytes too: the paths share no vector
code (AVX-512 has its own bf16 paths), so each is tested on its own.
"""

import functools
import os
import platform

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import ffi_calls

import numpy_oracle as oracle
import rmsnorm_oracle
from conftest import as_bytes

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")

ISAS = mx.cpu_isas() if "cpu" in mx.available_backends() else ()
PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


@jax.jit
def _both_rceil(x):
    return mx.quantize(x, rowwise=True, columnwise=True, scale_rule="rceil", backend="ffi")


@jax.jit
def _both_floor(x):
    return mx.quantize(x, rowwise=True, columnwise=True, scale_rule="floor", backend="ffi")


def _check(x, rule):
    want = oracle.quantize(np.asarray(x), rule)
    got = (_both_rceil if rule == "rceil" else _both_floor)(jnp.asarray(x))
    for plane in PLANES:
        actual, expected = as_bytes(getattr(got, plane)), want[plane].reshape(-1)
        bad = np.flatnonzero(actual != expected)
        assert bad.size == 0, (
            f"isa={mx.cpu_isa()} {plane} ({rule}, {x.dtype}): {bad.size} bytes differ; first at "
            f"{bad[0]}: got {actual[bad[0]]:#04x}, want {expected[bad[0]]:#04x}"
        )


def _off_cast(rng, n):
    """[64, 512] normal data where, in the first 32x32 chunk of each band, n elements in distinct
    rows and columns sit 2^-20 below the others: E4M3 subnormals, which the 16-bit cast leaves
    to the general path, so n row blocks and n column blocks of the chunk go there (the AVX2
    kernel redoes up to 8 columns one by one and more together)."""
    x = rng.standard_normal((64, 512)) * 3
    x[:, :32] = np.abs(x[:, :32]) + 1
    for band in (0, 32):
        rows, cols = rng.permutation(32)[:n], rng.permutation(32)[:n]
        x[band + rows, cols] = 2.0**-20
    return x


def _inputs():
    """bf16 in every regime the vector paths choose between, and fp32 / fp16 for the rest."""
    rng = np.random.default_rng(11)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    yield "all bf16 patterns", bits.view(ml_dtypes.bfloat16).reshape(256, 256)
    yield "all bf16 patterns, transposed", np.ascontiguousarray(bits.view(ml_dtypes.bfloat16).reshape(256, 256).T)
    # normal data with a per-row scale (the 16-bit fast paths), K = 17 blocks
    x = rng.standard_normal((96, 544)) * np.exp2(rng.integers(-30, 30, size=(96, 1)))
    yield "normal bf16", x.astype(ml_dtypes.bfloat16)
    # all-zero (and -0) blocks among normal ones
    z = rng.standard_normal((64, 512)).astype(ml_dtypes.bfloat16)
    z[:, 64:128] = 0
    z[32:, 256:288] = -0.0
    z[::3, 320:352] = 0
    yield "zero blocks", z
    # elements spanning up to 24 binades below their block's maximum: some land on E4M3
    # subnormals or flush to zero, which the 16-bit paths must hand over
    e = rng.integers(-24, 1, size=(64, 512)) + rng.integers(-100, 100, size=(64, 1))
    w = np.ldexp(rng.uniform(1, 2, size=(64, 512)), e) * rng.choice([-1, 1], size=(64, 512))
    yield "wide range bf16", w.astype(ml_dtypes.bfloat16)
    # tiny maxima (scale bytes below 16) and bf16 subnormals
    t = np.ldexp(rng.uniform(1, 2, size=(64, 256)), rng.integers(-133, -100, size=(64, 256)))
    yield "tiny bf16", t.astype(ml_dtypes.bfloat16)
    for n in (1, 8, 9, 32):
        yield f"{n} blocks of a chunk off the 16-bit cast", _off_cast(rng, n).astype(ml_dtypes.bfloat16)
    yield "normal fp32", (rng.standard_normal((64, 288)) * 7).astype(np.float32)
    yield "normal fp16", (rng.standard_normal((64, 288)) * 7).astype(np.float16)


INPUTS = list(_inputs())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_every_isa_gives_the_oracle_bytes(isa, rule):
    with mx.use_cpu_isa(isa):
        assert mx.cpu_isa() == isa
        for _, x in INPUTS:
            _check(x, rule)


@functools.cache
def _planes(rowwise, columnwise, rule):
    return jax.jit(lambda x: mx.quantize(x, rowwise=rowwise, columnwise=columnwise, scale_rule=rule, backend="ffi"))


def _large(rng, shape, dtype):
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, size=(shape[0], 1)))
    special = np.array([np.nan, np.inf, -np.inf, 1e-40, 0.0, -0.0, 448.0], np.float32)
    x.reshape(-1)[rng.integers(0, x.size, 300)] = rng.choice(special, 300)
    return x.astype(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "fp32"])
def test_every_isa_on_large_outputs(isa, dtype):
    """Calls with 4 MiB of codes or more write them with streaming stores, and rows longer than
    16384 columns are staged in slabs: [128, 16928] (two slabs, the last tile ragged) with both
    planes and with the columnwise plane alone, and a columnwise-only [256, 16416] whose second
    slab is one 32-column chunk."""
    rng = np.random.default_rng(23)
    cases = [((128, 16928), True), ((128, 16928), False), ((256, 16416), False)]
    with mx.use_cpu_isa(isa):
        for shape, rowwise in cases:
            x = _large(rng, shape, dtype)
            for rule in ("rceil", "floor"):
                want = oracle.quantize(x, rule)
                got = _planes(rowwise, True, rule)(jnp.asarray(x))
                for plane in PLANES if rowwise else PLANES[2:]:
                    np.testing.assert_array_equal(
                        as_bytes(getattr(got, plane)),
                        want[plane].reshape(-1),
                        err_msg=f"isa={isa} {shape} rowwise={rowwise} {rule} {plane}",
                    )


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_on_a_large_segment(isa):
    """A packed segment of 2.3 M elements (its codes are streamed): pieces with rows of 16928
    (two slabs) and 4096 columns at odd multiples of 32, and a gap."""
    rng = np.random.default_rng(29)
    pieces = [(32, 64, 16928), (32 + 64 * 16928 + 96, 320, 4096)]
    size = pieces[-1][0] + 320 * 4096 + 64
    x = _large(rng, (size // 32, 32), np.float32).reshape(-1)
    desc = np.array(pieces + [(0, 0, 0)], np.int32)
    fn = jax.jit(lambda x, d: ffi_calls.quantize_segments(x, d, scale_rule=0, rowwise=True, columnwise=True))
    with mx.use_cpu_isa(isa):
        (rq, rs), (cq, cs) = fn(jnp.asarray(x), jnp.asarray(desc))
    out = dict(zip(PLANES, (rq, rs, cq, cs)))
    for off, rows, k in pieces:
        ref = oracle.quantize(x[off : off + rows * k].reshape(rows, k), "rceil")
        for name in PLANES:
            want = ref[name].reshape(-1)
            start = off if name.endswith("data") else off // 32
            got = as_bytes(out[name])[start : start + want.size]
            np.testing.assert_array_equal(got, want, err_msg=f"isa={isa} {name} piece at {off}")


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_gives_the_oracle_rmsnorm_bytes(isa):
    """Each build against the oracles (not against the default build, which is one of them)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 1024)) * 3).astype(ml_dtypes.bfloat16)
    gamma = (rng.standard_normal(1024) * 0.5 + 1).astype(ml_dtypes.bfloat16)
    normed_want, _ = rmsnorm_oracle.canonical(x, gamma, eps=1e-6)
    want = oracle.quantize(np.asarray(normed_want))
    fn = jax.jit(lambda a, g: mx.rmsnorm_quant(a, g, columnwise=True, backend="ffi"))
    with mx.use_cpu_isa(isa):
        normed, q, s, cq, cs = fn(x, gamma)
    np.testing.assert_array_equal(as_bytes(normed), as_bytes(normed_want))
    for plane, got in zip(PLANES, (q, s, cq, cs)):
        np.testing.assert_array_equal(as_bytes(got), want[plane].reshape(-1), err_msg=f"isa={isa} {plane}")


def test_selection():
    assert ISAS[0] == "baseline" and mx.cpu_isa() == ISAS[-1]  # the best one by default
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        assert ("avx2" in ISAS) == (" avx2" in flags)
        assert ("avx512" in ISAS) == all(f" {x}" in flags for x in ("avx512f", "avx512bw", "avx512vl"))
    with pytest.raises(ValueError, match="isa must be one of 'baseline', 'avx2', 'avx512'; got 'sse9'"):
        mx.set_cpu_isa("sse9")
    with mx.use_cpu_isa("baseline"):
        assert mx.cpu_isa() == "baseline"
    assert mx.cpu_isa() == ISAS[-1]  # restored
