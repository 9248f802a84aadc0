"""The switch that chooses the test devices (MXFP8_TEST_PLATFORM, MXFP8_TEST_DEVICES), run as
separate pytest processes with this suite's conftest on a small test file of their own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _installed_gpu_plugins

HERE = Path(__file__).resolve().parent

PROBE = """
import pytest
from conftest import device_count, need_devices


def test_all_devices(devices):
    assert len(devices) == device_count() >= 2
    assert {d.platform for d in devices} == {"cpu"}


@pytest.mark.multidevice
def test_four():
    assert len(need_devices(4)) == 4


def test_unmarked_asks_for_devices():
    need_devices(2)


def test_single_device():
    assert True
"""


def _pytest(tmp_path, **env):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("MXFP8_TEST_", "PYTEST_"))}
    run_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", str(tmp_path)],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_platform_the_host_lacks_stops_the_run(tmp_path):
    """No silent CPU fallback: a GPU platform without a plugin (or without a device) fails the run
    before any test, naming the variable."""
    missing = [p for p in ("cuda", "rocm") if p not in _installed_gpu_plugins()]
    if not missing:
        pytest.skip("this host has both a CUDA and a ROCm plugin: no platform to ask for that it lacks")
    proc = _pytest(tmp_path, MXFP8_TEST_PLATFORM=missing[0])
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert f"MXFP8_TEST_PLATFORM={missing[0]}" in out and "does not fall back to CPU devices" in out
    assert "passed" not in out


@pytest.mark.parametrize(
    "env, match",
    [
        ({"MXFP8_TEST_PLATFORM": "tpu"}, "MXFP8_TEST_PLATFORM='tpu': must be one of cpu, gpu, cuda, rocm"),
        ({"MXFP8_TEST_DEVICES": "0"}, "MXFP8_TEST_DEVICES='0': must be a whole number of CPU devices, 1 or more"),
        ({"MXFP8_TEST_DEVICES": "four"}, "MXFP8_TEST_DEVICES='four'"),
    ],
)
def test_bad_values_are_named(tmp_path, env, match):
    proc = _pytest(tmp_path, **env)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR and match in proc.stdout + proc.stderr


@pytest.mark.parametrize("n", [1, 2, 4])
def test_device_count_and_what_is_not_run(tmp_path, n):
    """MXFP8_TEST_DEVICES sets the CPU device count; a test that needs more is skipped with the
    count it needs and counted in the end-of-run summary; at 1 device even the `devices` fixture's
    tests are not run (a collective among one device proves nothing); a test that asks for
    devices without the marker is an error."""
    proc = _pytest(tmp_path, MXFP8_TEST_DEVICES=str(n))
    out = proc.stdout
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out  # the unmarked test errors
    assert "test_unmarked_asks_for_devices" in out and "is not marked multidevice" in out
    summary = out[out.index("not run on this host") :]
    if n == 1:
        assert "1 failed, 1 passed, 2 skipped" in out
        assert "multi-device tests that need 2 devices: 1 not run (this run has 1 simulated CPU devices)" in summary
        assert "needs 4 devices" in out
    elif n == 2:
        assert "1 failed, 2 passed, 1 skipped" in out
        assert "multi-device tests that need 4 devices: 1 not run (this run has 2 simulated CPU devices)" in summary
        assert "need 2 devices" not in summary
    else:
        assert "1 failed, 3 passed in" in out and "need" not in summary
