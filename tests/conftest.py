"""Test setup: 8 simulated CPU devices for every multi-device test, and shared helpers.

The device count must be fixed before jax initialises its backends, so it is set here, at the
top of the first module pytest imports.
"""

import os

# The GPU tests (test_gpu.py, run by bench/gpu_check.sh) need a GPU platform asked for in
# JAX_PLATFORMS; without one they are not collected at all (rather than reported as skips).
_GPU_REQUESTED = any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "rocm", "gpu"))
collect_ignore = [] if _GPU_REQUESTED else ["test_gpu.py"]

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def as_bytes(a) -> np.ndarray:
    """Any array (fp8, uint8, bf16, ...) as a uint8 numpy view, for byte-for-byte comparison."""
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1)


@pytest.fixture(scope="session")
def cpu_devices():
    devs = jax.devices("cpu")
    assert len(devs) == 8, "tests expect 8 simulated CPU devices (jax_num_cpu_devices)"
    return devs


def pytest_report_header(config):
    if not _GPU_REQUESTED:
        return (
            "tests/test_gpu.py not collected: JAX_PLATFORMS asks for no GPU "
            "(bench/gpu_check.sh runs it on a GPU machine)"
        )
    return None


KNOWN_CPU_ISAS = ("baseline", "avx2", "avx512")  # the builds the CPU extension carries


def not_run_here() -> list[str]:
    """What this host cannot test: shown at the end of every run, -q and -n included."""
    import mxfp8_jax as mx

    lines = []
    if not _GPU_REQUESTED:
        lines.append("GPU tests: tests/test_gpu.py not collected (JAX_PLATFORMS asks for no GPU; bench/gpu_check.sh)")
    if "cpu" not in mx.available_backends():
        lines.append("CPU kernels: the compiled extension is not installed; only the pure-JAX paths ran")
    else:
        missing = [isa for isa in KNOWN_CPU_ISAS if isa not in mx.cpu_isas()]
        if missing:
            lines.append(f"CPU kernel builds this CPU cannot run, so never tested here: {', '.join(missing)}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    lines = not_run_here()
    if lines:
        terminalreporter.write_sep("-", "not run on this host")
        for line in lines:
            terminalreporter.write_line(line)
