"""Builds the GPU kernels' device code with the host compiler on HIP-CPU, for tests/test_hipcpu.py.

HIP-CPU is ROCm's header-only HIP runtime for CPUs (MIT). It is not part of the package: the
tests look for it at ``$MXFP8_HIP_CPU``, else at ``../shared/hip-cpu`` beside the repository,
and it needs TBB (Debian: ``libtbb-dev``; ``bash .ci/install_hipcpu.sh`` installs it).

One executable per vendor path (``cuda``, ``rocm``): the kernels' ``.cu`` files and
``tests/hipcpu/driver.cc``, each compiled as C++ with that path's shim force-included
(``xla_ffi/hipcpu/cuda.h`` or ``rocm.h``). The build is cached in the repository at
``build/hipcpu/<hash>/``, the hash taken over every source and header it reads, this file
(which holds the flags), the compiler's version and HIP-CPU's headers: a second run, or a second
pytest process on the same checkout (another Python, another jax), reuses it. The build holds
a file lock, so that pytest-xdist workers that start it together build it once, puts each
executable in place with an atomic rename, and then removes the builds of earlier sources.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FFI = ROOT / "xla_ffi"
PATHS = ("cuda", "rocm")  # vendor paths: the shim each executable is built with
KERNEL_SOURCES = ("quantize.cu", "quantize_tiles.cu", "quantize_segments.cu", "rmsnorm_quantize.cu")
DRIVER = ROOT / "tests" / "hipcpu" / "driver.cc"
# Exact IEEE arithmetic, as the GPU builds ask for (no fast-math, no contraction into FMA).
FLAGS = ("-std=c++17", "-O1", "-fno-fast-math", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas")
LIBS = ("-ltbb", "-lpthread")
HOW_TO_GET = (
    "set MXFP8_HIP_CPU to a checkout of ROCm's HIP-CPU (https://github.com/ROCm/HIP-CPU), or put one at "
    "../shared/hip-cpu beside the repository, and install TBB (bash .ci/install_hipcpu.sh, or apt-get install "
    "libtbb-dev)"
)


class Unavailable(RuntimeError):
    """HIP-CPU, TBB or a C++ compiler is missing: the tests cannot run here (a skip, or a failure
    where MXFP8_REQUIRE_HIPCPU=1)."""


class BuildError(RuntimeError):
    """The device code did not compile on HIP-CPU: always a test failure."""


def required() -> bool:
    """CI sets MXFP8_REQUIRE_HIPCPU=1: there a missing HIP-CPU fails the tests instead of skipping them."""
    return os.environ.get("MXFP8_REQUIRE_HIPCPU", "").strip() not in ("", "0")


def hip_cpu_dir() -> Path:
    """HIP-CPU's root (the directory holding ``include/hip/hip_runtime.h``), or Unavailable."""
    given = os.environ.get("MXFP8_HIP_CPU", "").strip()
    where = Path(given).expanduser() if given else ROOT.parent / "shared" / "hip-cpu"
    if not (where / "include" / "hip" / "hip_runtime.h").is_file():
        source = "MXFP8_HIP_CPU" if given else "the default ../shared/hip-cpu"
        raise Unavailable(f"HIP-CPU not found at {where} ({source}): {HOW_TO_GET}")
    return where.resolve()


def compiler() -> str:
    cxx = os.environ.get("CXX", "").strip() or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise Unavailable(f"no C++ compiler (c++, g++ or clang++, or CXX) to build the device code: {HOW_TO_GET}")
    return cxx


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def source_hash(hip_cpu: Path, cxx: str) -> str:
    """Every input of the build: the kernels' sources and headers, the shims, the driver, this
    file, the compiler's version, HIP-CPU's headers."""
    h = hashlib.sha256()
    files = [FFI / "gpu" / k for k in KERNEL_SOURCES]
    files += [*sorted((FFI / "gpu").glob("*.cuh")), *sorted((FFI / "gpu").glob("*.h"))]
    files += [*sorted((FFI / "include" / "mxfp8").glob("*.h")), *sorted((FFI / "hipcpu").glob("*.h"))]
    files += [DRIVER, Path(__file__)]
    files += sorted(p for d in ("include", "src/include") for p in (hip_cpu / d).rglob("*") if p.is_file())
    files += sorted(p for p in (hip_cpu / "external").rglob("*") if p.is_file())
    for p in files:
        h.update(str(p.relative_to(hip_cpu) if p.is_relative_to(hip_cpu) else p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    h.update(_run([cxx, "--version"]).stdout.encode())
    return h.hexdigest()[:16]


def _probe(cxx: str, hip_cpu: Path, tmp: Path) -> None:
    """HIP-CPU's parallel algorithms need TBB: a missing one is the environment, not the code."""
    src = tmp / "probe.cc"
    src.write_text("#include <execution>\n#include <tbb/version.h>\nint main() { return 0; }\n")
    r = _run([cxx, "-std=c++17", f"-I{hip_cpu / 'include'}", str(src), "-o", str(tmp / "probe"), *LIBS])
    if r.returncode != 0:
        raise Unavailable(f"{cxx} cannot build against TBB ({r.stderr.strip()[-300:]}): {HOW_TO_GET}")


def _stack_flags(cxx: str) -> list[str]:
    """HIP-CPU runs a block's threads on fibers with 7 KiB stacks, which nothing checks at run
    time: GCC reports the functions whose frame passes 4 KiB (see _compile)."""
    return ["-Wstack-usage=4096"] if "Free Software Foundation" in _run([cxx, "--version"]).stdout else []


def _compile(cxx: str, hip_cpu: Path, path: str, source: Path, obj: Path) -> tuple[float, str]:
    cmd = [cxx, *FLAGS, *_stack_flags(cxx), "-x", "c++", "-include", f"hipcpu/{path}.h"]
    cmd += [f"-I{hip_cpu / 'include'}", f"-I{FFI / 'include'}", f"-I{FFI}", "-c", str(source), "-o", str(obj)]
    t0 = time.monotonic()
    r = _run(cmd)
    rel = source.relative_to(ROOT)
    if r.returncode != 0:
        raise BuildError(f"{rel} ({path} path) does not compile on HIP-CPU:\n{' '.join(cmd)}\n{r.stderr[-6000:]}")
    # Frames of the kernels and the driver (HIP-CPU's own large ones run on ordinary threads).
    big = [ln for ln in r.stderr.splitlines() if "stack usage" in ln and ln.startswith((str(FFI), str(DRIVER)))]
    if big:
        raise BuildError(f"{rel} ({path} path): frames too large for HIP-CPU's fiber stacks:\n" + "\n".join(big))
    return time.monotonic() - t0, r.stderr


@contextlib.contextmanager
def _locked(lock: Path):
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def executables() -> dict[str, Path]:
    """{vendor path: driver executable}, built if the cache has none for these sources. Raises
    Unavailable (missing HIP-CPU, TBB or compiler) or BuildError (the code does not compile)."""
    hip_cpu, cxx = hip_cpu_dir(), compiler()
    digest = source_hash(hip_cpu, cxx)
    out = ROOT / "build" / "hipcpu" / digest
    exes = {p: out / f"driver_{p}" for p in PATHS}
    if all(e.is_file() for e in exes.values()):
        return exes
    with _locked(ROOT / "build" / "hipcpu" / f"{digest}.lock"):
        if all(e.is_file() for e in exes.values()):  # another process built it meanwhile
            return exes
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out, prefix="tmp-") as tmp:
            tmp = Path(tmp)
            _probe(cxx, hip_cpu, tmp)
            jobs = [(p, s) for p in PATHS for s in [*(FFI / "gpu" / k for k in KERNEL_SOURCES), DRIVER]]
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                futures = [pool.submit(_compile, cxx, hip_cpu, p, s, tmp / f"{p}.{s.name}.o") for p, s in jobs]
                results = [f.result() for f in futures]
            log = [f"{p} {s.relative_to(ROOT)}: {secs:.1f}s" for (p, s), (secs, _) in zip(jobs, results)]
            for p in PATHS:
                objs = [str(tmp / f"{p}.{s.name}.o") for q, s in jobs if q == p]
                r = _run([cxx, "-o", str(tmp / f"driver_{p}"), *objs, *LIBS])
                if r.returncode != 0:
                    raise BuildError(f"linking the {p} driver failed:\n{r.stderr[-4000:]}")
            wall = time.monotonic() - t0
            log.append(f"compiled and linked {len(jobs)} objects, 2 executables in {wall:.1f}s wall time")
            log.append(f"compiler: {cxx}; HIP-CPU: {hip_cpu}")
            (out / "build.log").write_text("\n".join(log) + "\n")
            for p in PATHS:
                os.replace(tmp / f"driver_{p}", exes[p])
    _prune(out)
    return exes


def _prune(keep: Path) -> None:
    """Removes the builds of other sources (earlier edits), each only while nobody holds its lock."""
    for old in keep.parent.iterdir():
        if old == keep or not old.is_dir():
            continue
        lock = old.parent / f"{old.name}.lock"
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # being built or used right now
            shutil.rmtree(old, ignore_errors=True)
            lock.unlink(missing_ok=True)


def build_seconds(exe: Path) -> str:
    """The build log's summary line (how long the build that made ``exe`` took)."""
    log = exe.parent / "build.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return next((ln for ln in lines if ln.startswith("compiled and linked")), "")
