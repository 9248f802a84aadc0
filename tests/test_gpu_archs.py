"""GPU architecture coverage, checked without a GPU.

- ``arch_runs``: which devices the kernels built for a CMake architecture list run on, against
  a table derived by hand from CUDA's compatibility rules (SASS X.Y runs on X.Z for Z >= Y, an
  ``a`` target on X.Y only, an ``f`` target on its family, PTX on any later GPU).
- A device the module has no code for gets one warning and the pure-JAX reference (no custom
  call in the lowering); ``backend="ffi"`` names the reason.
- Every listed target of one kernel file still compiles (CI builds one architecture per backend;
  this catches a target that no longer builds), device code only.
"""

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import _ffi

ROOT = Path(__file__).resolve().parents[1]
FFI = ROOT / "xla_ffi"


def _default_archs(cmake_file: str, var: str) -> list[str]:
    text = (FFI / "cmake" / cmake_file).read_text()
    m = re.search(rf'set\({var} "([^"]+)" CACHE', text)
    assert m, f"{cmake_file} sets no default {var}"
    return m.group(1).split(";")


CUDA_ARCHS = _default_archs("cuda.cmake", "MXFP8_CUDA_ARCHS")
HIP_ARCHS = _default_archs("rocm.cmake", "MXFP8_HIP_ARCHS")

# (compute capability, GPU, runs with the default list?, ran with the old "90,100a,120" SASS list?)
CUDA_DEVICES = [
    ("7.5", "T4", False, False),
    ("8.0", "A100", True, False),
    ("8.6", "A10 / RTX 30xx", True, False),
    ("8.9", "L40S / RTX 40xx", True, False),
    ("9.0", "H100 / H200", True, True),
    ("10.0", "B200", True, True),
    ("10.3", "B300", True, False),
    ("11.0", "Thor (PTX)", True, False),
    ("12.0", "RTX 50xx", True, True),
    ("12.1", "GB10", True, True),  # sm_120 SASS runs on 12.1 too
]


@pytest.mark.parametrize("cap,gpu,now,before", CUDA_DEVICES)
def test_cuda_arch_table(cap, gpu, now, before):
    assert _ffi.arch_runs(",".join(CUDA_ARCHS), cap, "cuda") is now, gpu
    assert _ffi.arch_runs("90-real,100a-real,120-real", cap, "cuda") is before, gpu


def test_arch_rules_one_by_one():
    runs = lambda archs, cap: _ffi.arch_runs(archs, cap, "cuda")
    assert runs("100a-real", "10.0") and not runs("100a-real", "10.3")
    assert runs("100f-real", "10.3") and not runs("100f-real", "12.0")
    assert runs("80-real", "8.9") and not runs("80-real", "9.0")  # SASS: same major only
    assert runs("90-virtual", "12.1") and not runs("90-virtual", "8.9")  # PTX: any later GPU
    assert runs("90", "10.0")  # a bare number is SASS + PTX
    rocm = lambda cap: _ffi.arch_runs(",".join(HIP_ARCHS), cap, "rocm")
    assert rocm("gfx942:sramecc+:xnack-") and rocm("gfx950") and not rocm("gfx90a")


class _FakeGpu:
    def __init__(self, cap, kind):
        self.id, self.compute_capability, self.device_kind = 0, cap, kind


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA part that is 'installed' for the lowering, with one fake device of a chosen
    capability (the handler itself is never run: the functions are only lowered)."""
    loaded, errors = _ffi._load()
    fake = dict(loaded, cuda={t: None for t in loaded.get("cpu", {})})
    monkeypatch.setattr(_ffi, "_load", lambda: (fake, errors))
    monkeypatch.setitem(_ffi._ARCHS, "cuda", ",".join(CUDA_ARCHS))
    cap = {}
    monkeypatch.setattr(_ffi, "_platform_devices", lambda p: [_FakeGpu(cap["v"], "Fake GPU")] if p == "cuda" else [])
    _ffi.unsupported_devices.cache_clear()
    yield cap
    _ffi.unsupported_devices.cache_clear()


def _lowered_calls(platform):
    fn = lambda x: mx.quantize(x, backend="auto")
    spec = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    text = jax.jit(fn).trace(spec).lower(lowering_platforms=(platform,)).as_text()
    return text.count("custom_call @mxfp8_quantize(")


@pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")
def test_unsupported_gpu_falls_back_with_one_warning(fake_cuda):
    fake_cuda["v"] = "7.5"
    with pytest.warns(_ffi.GpuFallbackWarning, match=r"compute capability 7\.5.*pure-JAX reference.*75-real"):
        assert _lowered_calls("cuda") == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert _lowered_calls("cuda") == 0
    with pytest.raises(mx.ExtensionMissingError, match=r"mxfp8_quantize cannot run.*compute capability 7\.5"):
        _ffi.require("mxfp8_quantize", "cuda")


@pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")
def test_supported_gpu_takes_the_kernel(fake_cuda):
    fake_cuda["v"] = "10.3"  # B300: only the family target covers it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _lowered_calls("cuda") == 1
        _ffi.require("mxfp8_quantize", "cuda")


def _gencode(arch: str) -> list[str]:
    """nvcc flags for one CMake CUDA_ARCHITECTURES entry."""
    m = re.fullmatch(r"(\d+[af]?)(?:-(real|virtual))?", arch)
    assert m, arch
    num, kind = m.groups()
    codes = {"real": [f"sm_{num}"], "virtual": [f"compute_{num}"], None: [f"sm_{num}", f"compute_{num}"]}[kind]
    return [f"--generate-code=arch=compute_{num},code=[{','.join(codes)}]"]


def test_every_cuda_target_compiles(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the CUDA targets of cuda.cmake cannot be compiled here")
    flags = [f for a in CUDA_ARCHS for f in _gencode(a)]
    cmd = [nvcc, "-std=c++17", "-O3", "--fmad=false", "--threads=0", "-fatbin", *flags]
    cmd += [f"-I{FFI / 'include'}", f"-I{FFI}", str(FFI / "gpu" / "quantize.cu"), "-o", str(tmp_path / "q.fatbin")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "q.fatbin").stat().st_size > 0


def _hip_clang():
    for name in ("clang++-22", "clang++-21", "clang++-20", "clang++-19"):
        if path := shutil.which(name):
            return path
    return None


def test_every_hip_target_compiles(tmp_path):
    clang = _hip_clang()
    hip_header = Path("/opt/rocm/include/hip/hip_runtime.h"), Path("/usr/include/hip/hip_runtime.h")
    include = next((p.parents[1] for p in hip_header if p.exists()), None)
    if clang is None or include is None:
        pytest.skip("no HIP clang (clang++-19..22) or HIP headers: the HIP targets cannot be compiled here")
    cmd = [clang, "-x", "hip", "-std=c++17", "-O3", "-nogpulib", "--cuda-device-only", "-ffp-contract=off"]
    cmd += ["-fno-vectorize", "-D__AMDGCN_WAVEFRONT_SIZE=64", *[f"--offload-arch={a}" for a in HIP_ARCHS]]
    cmd += [f"-I{FFI / 'include'}", f"-I{FFI}", f"-idirafter{include}", "-c", str(FFI / "gpu" / "quantize.cu")]
    r = subprocess.run([*cmd, "-o", str(tmp_path / "q.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
