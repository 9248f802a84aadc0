"""The jitted entry points lower for CUDA and ROCm on a CPU-only machine, with the right calls.

Cross-platform lowering (``jax.jit(f).trace(...).lower(lowering_platforms=...)``) needs no GPU:
it checks what a GPU would be handed. The thin FFI wrappers must emit their custom call with the
operand and result types and attributes the GPU handlers (xla_ffi/gpu/) decode. The public
functions with ``backend="auto"`` must call the GPU handler exactly when the installed extension
carries it for that platform, and the pure-JAX reference (no custom call) otherwise.
"""

import importlib
import importlib.util
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import _ffi, ffi_calls
from mxfp8_jax._src.ops import fused as fused_impl

PLATFORMS = ("cuda", "rocm")
TARGETS = (
    "mxfp8_quantize",
    "mxfp8_quantize_tiles",
    "mxfp8_quantize_segments",
    "mxfp8_rmsnorm_quantize",
    "mxfp8_allgather_rmsnorm_quantize",
)
GPU_MODULES = {"cuda": "_mxfp8_cuda", "rocm": "_mxfp8_rocm"}


def _lower(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\(")


def _custom_calls(text, target):
    """[(operand types, result types, attribute text)] of every call of ``target``."""
    calls = []
    for line in text.splitlines():
        m = _CALL.search(line)
        if not m or m.group(1) != target:
            continue
        head, sig = line.rsplit(" : ", 1)
        operands, results = sig.split(" -> ")
        types = lambda s: re.findall(r"tensor<[^>]*>", s)
        calls.append((types(operands), types(results), head))
    return calls


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


# ------------------------------------------------------------------------------------------------
# the thin wrappers: exact operand/result types and attributes


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,tname", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16"), (jnp.float32, "f32")])
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_quantize_call(platform, dtype, tname, rowwise, columnwise):
    m, k = 64, 96
    fn = lambda x: ffi_calls.quantize(x, scale_rule=1, rowwise=rowwise, columnwise=columnwise)
    (call,) = _custom_calls(_lower(fn, _spec((m, k), dtype), platform=platform), "mxfp8_quantize")
    operands, results, attrs = call
    assert operands == [f"tensor<{m}x{k}x{tname}>"]
    # codes come out as E4M3 (no bitcast pass after the call), scales as bytes
    row = [f"tensor<{m}x{k}xf8E4M3FN>", f"tensor<{m}x{k // 32}xui8>"] if rowwise else ["tensor<0xui8>"] * 2
    col = [f"tensor<{m}x{k}xf8E4M3FN>", f"tensor<{m // 32}x{k}xui8>"] if columnwise else ["tensor<0xui8>"] * 2
    assert results == row + col
    assert "scale_rule = 1 : i32" in attrs
    assert f"rowwise = {str(rowwise).lower()}" in attrs
    assert f"columnwise = {str(columnwise).lower()}" in attrs


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype,tname", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16"), (jnp.float32, "f32")])
def test_quantize_tiles_call(platform, dtype, tname):
    m, k = 64, 96
    fn = lambda x: ffi_calls.quantize_tiles(x, scale_rule=1)
    (call,) = _custom_calls(_lower(fn, _spec((m, k), dtype), platform=platform), "mxfp8_quantize_tiles")
    operands, results, attrs = call
    assert operands == [f"tensor<{m}x{k}x{tname}>"]
    # one E4M3 plane and one scale byte per 32x32 tile
    assert results == [f"tensor<{m}x{k}xf8E4M3FN>", f"tensor<{m // 32}x{k // 32}xui8>"]
    assert "scale_rule = 1 : i32" in attrs


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("desc_dtype,dname", [(jnp.int32, "i32")])
def test_quantize_segments_call(platform, desc_dtype, dname):
    s, p = 4096, 3
    fn = lambda x, d: ffi_calls.quantize_segments(x, d, scale_rule=0, rowwise=True, columnwise=True)
    text = _lower(fn, _spec((s,), jnp.bfloat16), _spec((p, 3), desc_dtype), platform=platform)
    (call,) = _custom_calls(text, "mxfp8_quantize_segments")
    operands, results, attrs = call
    assert operands == [f"tensor<{s}xbf16>", f"tensor<{p}x3x{dname}>"]
    assert results == [f"tensor<{s}xui8>", f"tensor<{s // 32}xui8>"] * 2
    assert "scale_rule = 0 : i32" in attrs


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("columnwise", [False, True])
def test_rmsnorm_quantize_call(platform, columnwise):
    r, h = 64, 288
    fn = lambda x, g: ffi_calls.rmsnorm_quantize(
        x,
        g,
        eps=1e-5,
        weight_offset=1.0,
        quantize_from_fp32=True,
        columnwise=columnwise,
        scale_rule=0,
    )
    text = _lower(fn, _spec((r, h), jnp.bfloat16), _spec((h,), jnp.bfloat16), platform=platform)
    (call,) = _custom_calls(text, "mxfp8_rmsnorm_quantize")
    operands, results, attrs = call
    assert operands == [f"tensor<{r}x{h}xbf16>", f"tensor<{h}xbf16>"]
    col = [f"tensor<{r}x{h}xf8E4M3FN>", f"tensor<{r // 32}x{h}xui8>"] if columnwise else ["tensor<0xui8>"] * 2
    assert results == [f"tensor<{r}x{h}xbf16>", f"tensor<{r}x{h}xf8E4M3FN>", f"tensor<{r}x{h // 32}xui8>"] + col
    assert "quantize_from_fp32 = true" in attrs
    assert f"columnwise = {str(columnwise).lower()}" in attrs
    f32_attr = lambda name: np.float32(re.search(rf"{name} = (\S+) : f32", attrs).group(1))
    assert f32_attr("eps") == np.float32(1e-5)
    assert f32_attr("weight_offset") == np.float32(1.0)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("columnwise", [False, True])
def test_allgather_rmsnorm_quantize_call(platform, columnwise):
    rows_max, h, counts = 24, 96, (24, 0, 8, 0, 16, 16, 24, 8)  # groups of 4, R = 32 each
    r = sum(counts[:4])
    fn = lambda x, g, w: ffi_calls.allgather_rmsnorm_quantize(
        x,
        g,
        w,
        rows=r,
        op_id=7,
        group_size=4,
        row_counts=counts,
        eps=1e-5,
        weight_offset=1.0,
        quantize_from_fp32=False,
        columnwise=columnwise,
        scale_rule=1,
        timeout_ms=2500,
    )
    text = _lower(
        fn, _spec((rows_max, h), jnp.bfloat16), _spec((h,), jnp.bfloat16), _spec((3,), jnp.int32), platform=platform
    )
    (call,) = _custom_calls(text, "mxfp8_allgather_rmsnorm_quantize")
    operands, results, attrs = call
    assert operands == [f"tensor<{rows_max}x{h}xbf16>", f"tensor<{h}xbf16>", "tensor<3xi32>"]
    col = [f"tensor<{r}x{h}xf8E4M3FN>", f"tensor<{r // 32}x{h}xui8>"] if columnwise else ["tensor<0xui8>"] * 2
    assert results == (
        [f"tensor<{r}x{h}xbf16>", f"tensor<{r}x{h}xf8E4M3FN>", f"tensor<{r}x{h // 32}xui8>"]
        + col
        + [f"tensor<{r}x{h}xbf16>"]
    )
    for attr in (
        "op_id = 7 : i64",
        "group_size = 4 : i64",
        "timeout_ms = 2500 : i64",
        "row_counts = dense<[24, 0, 8, 0, 16, 16, 24, 8]> : tensor<8xi64>",
        "scale_rule = 1 : i32",
        "quantize_from_fp32 = false",
        f"columnwise = {str(columnwise).lower()}",
    ):
        assert attr in attrs, attr


def _lowering_mesh_devices() -> list:
    """The run's simulated CPU devices, for a mesh that is only lowered for CUDA/ROCm.

    CPU devices in GPU mode too (MXFP8_TEST_PLATFORM=gpu still gives the run its
    MXFP8_TEST_DEVICES CPU devices): the test checks what a CPU-only machine hands a GPU, with
    the strategy resolved for the mesh's platform, and needs a mesh of neither a real GPU count
    nor a GPU runtime (lowering for ROCm on CUDA devices is not what the test is about)."""
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        pytest.skip(f"needs 2 devices; this run has {len(cpus)} simulated CPU devices")
    return cpus


@pytest.mark.multidevice
@pytest.mark.parametrize("platform", PLATFORMS)
def test_public_p2p_lowers_to_the_gather_call(platform):
    """The global wrapper with strategy="p2p" over all n of the run's CPU devices, lowered for
    the GPU: one gather call per device on its local rows, no collective."""
    if not _ffi.has_target("mxfp8_allgather_rmsnorm_quantize", "cpu"):
        pytest.skip("the mesh is on CPU here, whose p2p handler is not installed")
    devices = _lowering_mesh_devices()
    n = len(devices)
    counts = tuple((2, 0, 1, 2)[k % 4] for k in range(n))  # ragged, rows_max = 2: (2, 0, 1, 2) at n = 4
    mesh = Mesh(np.array(devices), ("x",))
    fn = lambda x, g: mx.allgather_rmsnorm_quant(x, g, mesh=mesh, axis="x", strategy="p2p", row_counts=counts)
    text = _lower(fn, _spec((2 * n, 64), jnp.bfloat16), _spec((64,), jnp.bfloat16), platform=platform)
    (call,) = _custom_calls(text, "mxfp8_allgather_rmsnorm_quantize")
    assert call[0] == ["tensor<2x64xbf16>", "tensor<64xbf16>", "tensor<3xi32>"]
    r = sum(counts)  # normed and residual: the R gathered valid rows
    assert call[1][0] == call[1][-1] == f"tensor<{r}x64xbf16>"
    assert "all_gather" not in text


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_gpu_strategy_resolution(platform, monkeypatch):
    """ "auto" stays "xla" on GPUs; an explicit "p2p" needs the GPU handler and warns once."""
    assert fused_impl._resolve_strategy("auto", platform, True, "x") == "xla"
    kernel_platform = _ffi.extension_platform(platform)
    if not _ffi.has_target("mxfp8_allgather_rmsnorm_quantize", kernel_platform):
        with pytest.raises(mx.ExtensionMissingError, match="mxfp8_allgather_rmsnorm_quantize"):
            fused_impl._resolve_strategy("p2p", platform, True, "x")
        return
    monkeypatch.setattr(fused_impl, "_warned_gpu_p2p", False)
    with pytest.warns(mx.ExperimentalGpuP2PWarning, match="experimental.*untested on multi-GPU"):
        assert fused_impl._resolve_strategy("p2p", platform, True, "x") == "p2p"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        assert fused_impl._resolve_strategy("p2p", platform, True, "x") == "p2p"
    with pytest.raises(ValueError, match="needs every device of axis 'x' in this process"):
        fused_impl._resolve_strategy("p2p", platform, False, "x")


# ------------------------------------------------------------------------------------------------
# the public functions: GPU handler iff the installed extension has it for the platform


def _expect_call(text, target, platform):
    calls = _custom_calls(text, target)
    if _ffi.has_target(target, platform):
        assert len(calls) == 1, f"{target} not called when lowered for {platform}"
    else:
        assert calls == [], f"{target} called for {platform}, whose handler is not installed"
    return calls


@pytest.mark.parametrize("platform", PLATFORMS)
def test_public_quantize_dispatch(platform):
    fn = lambda x: mx.quantize(x, backend="auto")
    text = _lower(fn, _spec((4, 32, 64), jnp.bfloat16), platform=platform)
    for call in _expect_call(text, "mxfp8_quantize", platform):
        assert call[0] == ["tensor<128x64xbf16>"]
    # whatever the path, the program returns E4M3 data and uint8 scales of the 2-D view
    assert re.search(r"tensor<128x64xf8E4M3FN>", text)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_public_quantize_tiles_dispatch(platform):
    fn = lambda x: mx.quantize(x, blocks="32x32", backend="auto")
    text = _lower(fn, _spec((2, 32, 64), jnp.bfloat16), platform=platform)
    for call in _expect_call(text, "mxfp8_quantize_tiles", platform):
        assert call[0] == ["tensor<64x64xbf16>"]
    assert re.search(r"tensor<64x64xf8E4M3FN>", text) and re.search(r"tensor<2x2xui8>", text)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_public_rmsnorm_dispatch(platform):
    fn = lambda x, g: mx.rmsnorm_quant(x, g, backend="auto")
    text = _lower(fn, _spec((16, 256), jnp.bfloat16), _spec((256,), jnp.bfloat16), platform=platform)
    _expect_call(text, "mxfp8_rmsnorm_quantize", platform)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_reference_path_has_no_custom_call(platform):
    fn = lambda x: mx.quantize(x, backend="jax")
    text = _lower(fn, _spec((64, 64), jnp.float32), platform=platform)
    assert not _CALL.search(text)


# ------------------------------------------------------------------------------------------------
# built GPU modules import cleanly on a machine without GPU and carry every target


def _built_modules():
    """Platforms whose GPU module file is installed (wherever the install put the package's
    extension modules: an editable install keeps them outside the source tree)."""
    return [
        platform for platform, name in GPU_MODULES.items() if importlib.util.find_spec(f"mxfp8_jax.{name}") is not None
    ]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_built_gpu_module_imports_and_registers(platform):
    if platform not in _built_modules():
        # Not a pass in disguise: the module file is absent, so there is nothing to import.
        pytest.skip(f"{GPU_MODULES[platform]} was not built here (no {platform} toolchain)")
    mod = importlib.import_module(f"mxfp8_jax.{GPU_MODULES[platform]}")
    regs = mod.registrations()
    assert set(TARGETS) <= set(regs)
    assert platform in mx.available_backends()
    for t in TARGETS:
        assert _ffi.has_target(t, platform)
