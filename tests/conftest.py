"""Test setup: 8 simulated CPU devices for every multi-device test, and shared helpers.

The device count must be fixed before jax initialises its backends, so it is set here, at the
top of the first module pytest imports.
"""

import os

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
