"""The GPU step, decided by the program's platform and not by this process's default backend.

- ``core.platforms`` reads a device's lowering platform and compute capability (real devices,
  and compile-only ones that report only their kind);
- an FSDP step's dequantized units run their dgrad and wgrad in fp32 where the step is lowered
  for CPUs and in the layer's dtype (bf16, fp32 accumulation) where it is lowered for GPUs,
  checked on the StableHLO of one CPU-mesh step lowered for each platform, and ``backward_gemm``
  overrides it both ways;
- what the GPU backward changes in the numbers: the layer-dtype dgrad and wgrad against the
  exact (fp32-operand) ones, within the bound of one bf16 rounding of the cotangent plus fp32
  summation;
- the MXFP8 GEMM path a GPU mesh resolves to: native with block-scaled MMA, bf16 otherwise.

The compiled XLA:GPU program itself (on compile-only H100 and B200 meshes) is
``test_gpu_compile.py``'s.
"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh

from mxfp8_jax import flax as mxflax
from mxfp8_jax._src.core import platforms
from mxfp8_jax._src.fsdp import fsdp_dots, fsdp_geometry, fsdp_step
from mxfp8_jax._src.ops import mxfp8_gemm

from test_fsdp_gemm import WIDTH, Stack, loss_fn  # two bf16 projections a block, scanned

# ------------------------------------------------------------------------------------------------
# platforms


def _device(platform, kind="", raw=None, version="", capability=None):
    client = types.SimpleNamespace(platform_version=version)
    if raw is not None:
        client._raw_platform = raw
    dev = types.SimpleNamespace(platform=platform, device_kind=kind, client=client)
    if capability is not None:
        dev.compute_capability = capability
    return dev


def test_a_devices_platform_and_capability():
    assert platforms.of_device(jax.devices("cpu")[0]) == "cpu"
    # jax calls CUDA and ROCm devices "gpu"; the client says which (as jax's lowering reads it)
    assert platforms.of_device(_device("gpu", "NVIDIA H100 80GB HBM3", raw="cuda")) == "cuda"
    assert platforms.of_device(_device("gpu", "AMD Instinct MI300X", raw="rocm")) == "rocm"
    # without that attribute: the description
    assert platforms.of_device(_device("gpu", "MI300X", version="rocm 7.0")) == "rocm"
    assert platforms.of_device(_device("gpu", "NVIDIA H100 80GB HBM3 MIG 1g.10gb")) == "cuda"
    # a real device reports its capability; a compile-only one is known by its kind
    assert platforms.capability(_device("gpu", "anything", raw="cuda", capability="8.9")) == "8.9"
    cases = {
        "NVIDIA H100 80GB HBM3": "9.0",
        "NVIDIA H200 141GB HBM3e": "9.0",
        "NVIDIA B200": "10.0",
        "NVIDIA GB200": "10.0",
        "NVIDIA A100-SXM4-80GB": "8.0",
        "MI300X": "gfx942",
        "MI355X": "gfx950",
        "Some Future GPU": None,
    }
    for kind, cap in cases.items():
        raw = "rocm" if kind.startswith("MI") else "cuda"
        assert platforms.capability(_device("gpu", kind, raw=raw)) == cap, kind
    assert platforms.capability(jax.devices("cpu")[0]) is None
    assert [platforms.has_block_scaled_mma("cuda", c) for c in ("9.0", "10.0", "12.0", None)] == [
        False,
        True,
        True,
        None,
    ]
    assert platforms.has_block_scaled_mma("rocm", "gfx942") is False
    assert platforms.has_block_scaled_mma("rocm", "gfx950") is True
    assert platforms.has_block_scaled_mma("cpu", None) is False


def test_the_mxfp8_gemm_path_of_a_gpu_mesh():
    r = mxfp8_gemm.resolve_path
    assert r("auto", "cuda", "10.0") == "native"  # Blackwell multiplies MXFP8 blocks
    assert r("auto", "cuda", "9.0") == "bf16"  # Hopper: exact bf16 operands, bf16 tensor cores
    assert r("auto", "rocm", "gfx942") == "bf16"
    assert r("auto", "rocm", "gfx950") == "native"
    assert r("auto", "cuda", None) == "auto"  # unknown: the lowering platform decides
    assert r("auto", "cpu", None) == "auto"  # exact where lowered for CPUs, as before
    assert r("exact", "cuda", "10.0") == "exact" and r("native", "cuda", "9.0") == "native"
    with pytest.raises(ValueError, match=r"gemm_path='native': platform 'cpu' has no native block-scaled GEMM"):
        mxfp8_gemm.check_mode("mxfp8", "native", "rceil", "cpu")


# ------------------------------------------------------------------------------------------------
# the backward GEMMs by lowering platform


def _dot_operand_types(text: str) -> list[tuple[str, str]]:
    """The element types of both operands of every ``stablehlo.dot_general`` in ``text``."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            operands = line.rsplit(" : ", 1)[1].split(" -> ")[0]
            types_ = [t.rsplit("x", 1)[1] for t in re.findall(r"tensor<([^>]*)>", operands)]
            out.append(tuple(types_))
    return out


def _lowered(fsdp, batch, platform: str) -> str:
    tx = optax.sgd(0.1)
    return (
        jax.jit(fsdp._steps.step(loss_fn, tx, False))
        .trace(fsdp.abstract_state(tx), batch)
        .lower(lowering_platforms=(platform,))
        .as_text()
    )


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_backward_gemms_follow_the_lowering_platform(devices, precision):
    """One CPU-mesh step lowered for CPU, CUDA and ROCm: 2 units x (forward, dgrad, wgrad). For
    GPUs every one is the layer's bf16 GEMM; for the CPU all are fp32 (the forward's bf16
    operands multiplied as fp32, the same numbers; the exact backward). The GPU step is decided
    where the program is lowered, not by the default backend, which is the CPU here.
    ``backward_gemm="fp32"`` makes the GPU backward fp32; ``"layer"`` on the CPU rounds the
    cotangent to bf16 and multiplies the rounded values as fp32."""
    mesh = Mesh(np.array(devices), ("fsdp",))
    model = nnx.eval_shape(lambda: Stack(2, WIDTH, False, nnx.Rngs(0)))
    batch = jax.ShapeDtypeStruct((mesh.size * 8, WIDTH), jnp.float32)

    def dots(platform, **kw):
        fsdp = mxflax.FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch, precision=precision, **kw)
        found = _dot_operand_types(_lowered(fsdp, batch, platform))
        assert len(found) == 6, found  # one scan body: 2 units x (forward, dgrad, wgrad)
        return sorted(found)

    bf16, f32 = ("bf16", "bf16"), ("f32", "f32")
    assert dots("cpu") == [f32] * 6
    assert dots("cuda") == [bf16] * 6
    assert dots("rocm") == [bf16] * 6
    assert dots("cuda", backward_gemm="fp32") == sorted([bf16] * 2 + [f32] * 4)
    assert dots("cuda", backward_gemm="layer") == [bf16] * 6
    assert dots("cpu", backward_gemm="layer") == [f32] * 6
    with pytest.raises(ValueError, match=r"backward_gemm='bf16' must be one of \('auto', 'fp32', 'layer'\)"):
        mxflax.FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch, backward_gemm="bf16")


def test_layer_backward_trains_like_the_exact_one(devices):
    """On the CPU mesh, ``backward_gemm="layer"`` (the GPU arithmetic) against the exact
    backward, for bf16 layers: their cotangents are bf16 already, so the bf16 dgrad and wgrad
    multiply the same values exactly and accumulate in fp32 as the fp32 ones do; the same loss
    and the same update up to fp32 summation order (K = 256 terms)."""
    mesh = Mesh(np.array(devices), ("fsdp",))
    model = Stack(2, WIDTH, False, nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((mesh.size * 8, WIDTH)).astype(np.float32)
    tx = optax.sgd(1.0)
    out = {}
    for backward in ("fp32", "layer"):
        fsdp = mxflax.FSDP(model, mesh, loss_fn=loss_fn, example_batch=x, backward_gemm=backward)
        state, loss = fsdp.train_step(loss_fn, tx)(fsdp.init(model, tx), x)
        out[backward] = float(loss), jax.tree.leaves(nnx.state(fsdp.gather(state), nnx.Param))
    assert out["fp32"][0] == out["layer"][0]
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    for a, b, w in zip(out["fp32"][1], out["layer"][1], before):
        step = np.abs(np.asarray(w) - np.asarray(a)).max()  # sgd(1.0): the gradient
        assert step > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2 * 256 * 2.0**-24 * step + 2.0**-24)


# ------------------------------------------------------------------------------------------------
# the numbers of one backward GEMM


@settings(max_examples=25)
@given(
    case=st.sampled_from(
        [
            ((6, 40), (40, 24), (((1,), (0,)), ((), ()))),  # x @ W
            ((6, 40), (24, 40), (((1,), (1,)), ((), ()))),  # x @ W^T (a tied weight)
            ((2, 3, 40), (40, 5, 8), (((2,), (0,)), ((), ()))),  # an einsum kernel of two out axes
            ((3, 6, 32), (3, 32, 7), (((2,), (1,)), ((0,), (0,)))),  # batched (MoE experts)
        ]
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_dot_general_grads_are_jaxs_transposes(case, seed):
    """``dot_general_grads`` (the dgrad and wgrad the step runs) equals jax's own VJP of the
    ``dot_general`` bit for bit in fp32, for any dimension numbers."""
    a_shape, b_shape, dims = case
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), a, b)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    want = vjp(dy)
    got = jax.jit(lambda a, b, dy: fsdp_dots.dot_general_grads(a, b, dy, dims))(a, b, dy)
    for w, g in zip(want, got):
        assert g.dtype == jnp.float32 and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(np.abs(w).max()))


@pytest.mark.parametrize("position", [0, 1])
def test_layer_backward_is_the_exact_backward_within_one_rounding_of_the_cotangent(position):
    """``backward="layer"`` rounds the cotangent to bf16 (|error| <= 2^-8 of it) and multiplies
    bf16 operands exactly with fp32 accumulation; ``"fp32"`` multiplies the cotangent as it is.
    Each dgrad / wgrad element then differs by at most (2^-8 + 2 gamma_K) times the sum of the
    |products| it adds (gamma_K ~ K 2^-24: fp32 summation of K terms, on both sides).
    ``position``: which operand of the layer's ``dot_general`` the unit is."""
    rng = np.random.default_rng(position)
    k, m, n = 512, 64, 96
    act = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    d = rng.standard_normal((m, n)).astype(np.float32)  # not bf16 values
    # position 1: y = act @ v [m, n]; position 0: y = v^T act^T [n, m], dy transposed
    dims = (((1,), (0,)), ((), ())) if position == 1 else (((0,), (1,)), ((), ()))
    dy = jnp.asarray(d if position == 1 else d.T)

    def run(backward):
        op = types.SimpleNamespace(
            gemm=fsdp_geometry.Gemms(backward), position=position, params={"dimension_numbers": dims}
        )
        return jax.jit(lambda a, w, g: fsdp_dots.backward_dots(op, a, w, g))(act, v, dy)

    exact, layer = run("fp32"), run("layer")
    f64 = lambda a: np.asarray(a, np.float64)
    bounds = (np.abs(d) @ np.abs(f64(v)).T, np.abs(f64(act)).T @ np.abs(d))  # for d_act [m, k], d_v [k, n]
    for e, got, bound, terms in zip(exact, layer, bounds, (n, m)):
        assert got.dtype == e.dtype == jnp.float32 and got.shape == bound.shape
        diff = np.abs(f64(got) - f64(e))
        tol = (2.0**-8 + 2.01 * terms * 2.0**-24) * bound
        assert np.all(diff <= tol), float(np.max(diff / tol))
        assert np.any(diff > 0)  # the cotangent's rounding shows


ON, OFF = "COLLECTIVE_PIPELINING_MODE_ON", "COLLECTIVE_PIPELINING_MODE_OFF"
AG, RS = "xla_gpu_pipeline_all_gather", "xla_gpu_pipeline_reduce_scatter"


@pytest.mark.parametrize(
    ("jaxlib", "flags", "pipelined", "want"),
    [
        ((0, 12, 0), "", True, {AG: ON, RS: OFF}),
        ((0, 11, 2), "--xla_gpu_pipeline_reduce_scatter=COLLECTIVE_PIPELINING_MODE_ON", True, {AG: ON}),
        ((0, 10, 2), "", True, {"xla_gpu_enable_pipelined_all_gather": True}),
        ((0, 12, 0), "--xla_gpu_enable_pipelined_all_gather=false", True, {RS: OFF}),
        ((0, 10, 2), "--xla_gpu_pipeline_all_gather=COLLECTIVE_PIPELINING_MODE_OFF", True, {}),
        ((0, 12, 0), "", False, {AG: OFF, RS: OFF}),
        ((0, 12, 0), "--xla_gpu_enable_pipelined_all_gather=true", False, {RS: OFF}),
        ((0, 10, 2), "", False, {}),
    ],
)
def test_gpu_steps_set_the_collective_pipeliner_unless_xla_flags_say(jaxlib, flags, pipelined, want):
    """On GPU meshes the steps compile with XLA:GPU's collective pipeliner, under XLA's own
    prices (``pipelined``), on for all-gathers and off for reduce-scatters, with the prices put
    right off for both; in the option spelling of the installed jaxlib (an enum from 0.11, a
    bool before, where off is the default); a collective whose option the user's ``XLA_FLAGS``
    sets, in either spelling, is left to them."""
    assert fsdp_step.gpu_pipelining_options(jaxlib, flags, pipelined) == want


def test_cpu_steps_keep_xlas_defaults(devices):
    """On a CPU mesh (no tensor parallelism) the steps add no XLA option."""
    fsdp = mxflax.FSDP(Stack(2, WIDTH, False, nnx.Rngs(0)), Mesh(np.array(devices), ("fsdp",)))
    assert fsdp.compiler_options is None
