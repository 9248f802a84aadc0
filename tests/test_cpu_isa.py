"""The CPU kernels are built for several instruction sets (baseline x86-64, AVX2, AVX-512) and
run the best one this CPU has; the rest of the suite tests that one. Here every other one this
CPU can run is selected in turn and must give the oracle's bytes too: the paths share no vector
code (AVX-512 has its own bf16 paths), so each is tested on its own.
"""

import os
import platform

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxfp8_jax as mx

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
