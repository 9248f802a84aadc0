"""Test setup: which devices the multi-device tests run on, and shared helpers.

Two environment variables choose the devices (they must be read before jax starts its
backends, so this happens at the top of the first module pytest imports):

- ``MXFP8_TEST_PLATFORM``: ``cpu`` (default) runs the multi-device tests on simulated CPU
  devices; ``gpu`` (or ``cuda`` / ``rocm``) runs them on this host's accelerators, with the
  same oracles. In GPU mode the tests that are not multi-device still run on the CPU (each
  test's default device is chosen by its ``multidevice`` marker), ``tests/test_gpu.py`` is
  collected, and asking for a GPU the host does not have stops the run with an error rather
  than falling back to the CPU.
- ``MXFP8_TEST_DEVICES``: how many simulated CPU devices the CPU run has (default 8).

A multi-device test takes the ``devices`` fixture (all of the run's devices, at least 2) or calls
``need_devices(n)``; either marks it ``multidevice`` (``-m multidevice`` selects them). A test
that needs more devices than the run has is skipped with the count it needs, and the end-of-run
"not run on this host" summary counts those tests, so nothing passes vacuously on a small host.
"""

import collections
import gc
import importlib.metadata
import os
import re

import pytest

_PLATFORM_NAMES = {"cpu": "cpu", "gpu": "gpu", "cuda": "cuda", "rocm": "rocm"}


def _read_env():
    platform = os.environ.get("MXFP8_TEST_PLATFORM", "cpu").strip().lower() or "cpu"
    if platform not in _PLATFORM_NAMES:
        raise pytest.UsageError(
            f"MXFP8_TEST_PLATFORM={platform!r}: must be one of cpu, gpu, cuda, rocm "
            "(gpu picks whichever of CUDA or ROCm jax has a plugin for)"
        )
    raw = os.environ.get("MXFP8_TEST_DEVICES", "8").strip()
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
        raise pytest.UsageError(f"MXFP8_TEST_DEVICES={raw!r}: must be a whole number of CPU devices, 1 or more")
    return platform, int(raw)


def _installed_gpu_plugins() -> list[str]:
    """The GPU platforms jax has a plugin package for (``cuda``, ``rocm``), from the installed
    distributions, so that nothing is initialised before JAX_PLATFORMS is set."""
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        for platform in ("cuda", "rocm"):
            if re.fullmatch(rf"jax-{platform}\d*-(plugin|pjrt)", name) and platform not in found:
                found.append(platform)
    return found


_ASKED, CPU_DEVICES = _read_env()
if _ASKED == "cpu":
    PLATFORM = "cpu"
else:
    _plugins = _installed_gpu_plugins()
    PLATFORM = _ASKED if _ASKED != "gpu" else (_plugins[0] if _plugins else "gpu")
    if PLATFORM not in _plugins:
        raise pytest.UsageError(
            f"MXFP8_TEST_PLATFORM={_ASKED}: jax has no {PLATFORM if PLATFORM != 'gpu' else 'CUDA or ROCm'} "
            f"plugin on this host (installed GPU plugins: {', '.join(_plugins) or 'none'}); "
            "the suite does not fall back to CPU devices. Unset it to test on simulated CPU devices."
        )
    # Several pytest-xdist workers share the GPUs: none may take 75% of each up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # One collective per op in the HLO, as on the CPU: the GPU combiners would merge the
    # per-layer gathers that the tests count (bytes are unchanged either way).
    os.environ["XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_gpu_all_gather_combine_threshold_bytes=0",
            "--xla_gpu_reduce_scatter_combine_threshold_bytes=0",
            "--xla_gpu_all_reduce_combine_threshold_bytes=0",
        ]
    ).strip()

GPU_MODE = PLATFORM != "cpu"
_USER_JAX_PLATFORMS = os.environ.get("JAX_PLATFORMS")
os.environ["JAX_PLATFORMS"] = f"{PLATFORM},cpu" if GPU_MODE else "cpu"
# The GPU kernel tests (test_gpu.py, also run by bench/gpu_check.sh) are collected in GPU mode
# only, rather than reported as skips on every CPU host.
collect_ignore = [] if GPU_MODE else ["test_gpu.py"]
# The steps compiled for compile-only GPU meshes (test_gpu_compile.py, -m gpu_compile) need jax's
# CUDA plugin, which CI adds to the newest leg's environment after that leg's other tests;
# collected where it is.
HAS_CUDA_PLUGIN = "cuda" in _installed_gpu_plugins()
if not HAS_CUDA_PLUGIN:
    collect_ignore.append("test_gpu_compile.py")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
# Tracing and lowering a training step makes many short-lived Python objects, and at the
# default threshold (700 allocations) the cyclic collector runs often while it does. Collecting
# every 50000 takes about a tenth off the FSDP tests' time (test_tp and test_fsdp_optim at 4
# devices, one process: 163 s -> 143 s); nothing here waits on a collection.
gc.set_threshold(50_000, 20, 100)
if GPU_MODE:
    try:  # start the backends now: a GPU that cannot start stops the run here, before collection
        jax.devices(PLATFORM)
    except RuntimeError as err:
        raise pytest.UsageError(
            f"MXFP8_TEST_PLATFORM={_ASKED}: jax cannot start {PLATFORM} on this host ({err}); "
            "the suite does not fall back to CPU devices"
        ) from err
    # fp32 GEMMs on Hopper and later default to TF32; the references here are fp32 to the bit.
    jax.config.update("jax_default_matmul_precision", "highest")

import chex  # noqa: E402
import numpy as np  # noqa: E402

try:  # a GPU image may lack hypothesis: the modules that use it then fail to collect, alone
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
    settings.register_profile("dev", max_examples=15, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def as_bytes(a) -> np.ndarray:
    """Any array (fp8, uint8, bf16, ...) as a uint8 numpy view, for byte-for-byte comparison."""
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1)


def assert_same_bytes(a, b) -> None:
    """Two pytrees of one structure whose leaves have the same shapes, dtypes and bytes (NaN
    payloads and signed zeros included, which a comparison of values lets through)."""
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    chex.assert_trees_all_equal(jax.tree.map(as_bytes, a), jax.tree.map(as_bytes, b))


def _all_test_devices() -> list:
    return jax.devices(PLATFORM)


def rows_per_device(n_rows: int, n: int) -> int:
    """Rows of an MXFP8 unit's ``W [n_rows, K]`` each of ``n`` devices stores: ``n_rows`` padded
    to whole 32-row blocks, the same number of blocks on every device (the padding rule, written
    here independently of the package)."""
    return -(-n_rows // (32 * n)) * 32


_current = {"node": None}


def need_devices(n: int) -> list:
    """The first ``n`` of this run's devices, or skip the test saying it needs ``n``.

    Only a test marked ``multidevice`` (directly, or through the ``devices`` fixture) may ask.
    """
    node = _current["node"]
    if node is not None and node.get_closest_marker("multidevice") is None:
        raise pytest.UsageError(f"{node.nodeid} asks for the test devices but is not marked multidevice")
    have = _all_test_devices()
    if len(have) < n:
        pytest.skip(f"needs {n} devices; this run has {len(have)} ({describe_devices()})")
    return have[:n]


def device_count() -> int:
    """How many devices the multi-device tests have in this run."""
    return len(_all_test_devices())


def describe_devices() -> str:
    if GPU_MODE:
        return f"{PLATFORM} devices"
    return "simulated CPU devices"


def cpu_only(what: str) -> None:
    """Skip, in GPU mode, a test that only holds on the CPU: numbers derived for XLA:CPU (memory
    budgets), or a comparison with multi-process runs, which are CPU-only."""
    if GPU_MODE:
        pytest.skip(f"CPU only: {what}")


@pytest.fixture(scope="session")
def devices():
    """All of this run's devices for multi-device tests (at least 2: a collective among one
    device proves nothing)."""
    n = device_count()
    return need_devices(max(n, 2))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multidevice: runs on several devices (MXFP8_TEST_PLATFORM and MXFP8_TEST_DEVICES choose which)"
    )
    config.addinivalue_line(
        "markers", "device_count: a multi-device test CI runs again on 4 devices (all but EIGHT_ONLY's modules)"
    )


# The compatibility subset (``-m compat``), which CI runs again on the oldest supported jax: every
# path that meets jax's interfaces, once. Module -> the tests of it (None: all of them).
COMPAT = {
    "test_jaxprs.py": None,  # each primitive the FSDP trace reads or stops at, as this jax spells it
    "test_fsdp_semantics.py": None,  # the step on the whole batch: jit, islands, the axis-name check
    "test_quantize.py": None,  # the quantize FFI call, its custom_jvp and the reference
    "test_blocks_2d.py": None,  # the 32x32 reference, its custom_jvp
    "test_rmsnorm_quantize.py": None,  # the RMSNorm + quantize FFI call
    "test_quantize_segments.py": None,  # the packed-segment FFI call inside shard_map
    "test_fused.py": None,  # the fused op: p2p custom call, futures, shard_map, vma types
    "test_partitioning.py": None,  # custom_partitioning and its Shardy rules
    "test_checkpoint.py": None,  # orbax, sharded arrays moved device to device, two processes
    # FSDP states through orbax, on other meshes
    "test_fsdp_checkpoint.py": (
        "test_round_trip_exact_on_any_mesh",
        "test_resume_on_the_same_mesh_is_exact_and_on_another_within_summation_order",
    ),
    "test_gpu_lowering.py": None,  # lowering for cuda and rocm, jax.ffi registration
    "test_mxfp8_gemm.py": None,  # jax.nn.scaled_matmul / scaled_dot_general, the MXFP8-GEMM step
    "test_transformer.py": ("test_step_hlo_gathers_units_inside_the_loops",),  # nnx.vmap + scan + remat, HLO
    # a shard_map manual over one axis, nested islands, the fused op inside
    "test_tp.py": ("test_gradients_match_one_device", "test_hlo_fused_call_in_the_loop_and_no_weight_gathered_whole"),
    "test_fsdp_models.py": ("test_gradients_match_the_unsharded_model",),  # one step of each model style
    # fori_loop (scan consts), static slices, cond branches, lax.split, while: as this jax spells them
    "test_fsdp_stacks.py": ("test_a_stack_read_by_index_is_a_unit_read_a_layer_at_a_time_and_the_step_is_exact",),
    "test_fsdp_frozen.py": ("test_lora_step_is_the_unsharded_step_and_the_base_is_unchanged",),  # nnx filters
}


# Multi-device modules CI does not run again on 4 devices (``-m device_count`` leaves them out):
# whole-model steps, and modules whose checks do not follow the device count. The per-count parts
# (row padding, shard geometry, collective sizes, resharding) are the other modules' to check, at
# both counts; each of these passes at 4 as well.
EIGHT_ONLY = {
    "test_fsdp_models.py": "the model styles' steps, bytes and memory",
    "test_fsdp_overlap.py": "the dependency graph of the step's gathers",
    "test_fsdp_gemm.py": "the MXFP8-GEMM step and its convergence",
    "test_fsdp_frozen.py": "frozen units and LoRA",
    "test_tp.py": "tensor parallelism (tp=2 at either count)",
    "test_transformer.py": "the package's transformer trained",
    "test_fsdp_optim.py": "optax transformations by path",
    "test_fsdp_scan_axes.py": "stacks scanned over other axes",
    "test_cli.py": "the command line's runs",
    "test_fsdp_blocks_2d.py": "32x32 units (their rows padded as 1x32 units', which both counts check)",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "devices" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multidevice)
            if item.path.name not in EIGHT_ONLY:
                item.add_marker(pytest.mark.device_count)
        chosen = COMPAT.get(item.path.name, ())
        if chosen is None or getattr(item, "originalname", item.name) in (chosen or ()):
            item.add_marker(pytest.mark.compat)


@pytest.fixture(autouse=True)
def _test_platform(request):
    """Remember the running test (for ``need_devices``) and, in GPU mode, give tests that are
    not multi-device (nor GPU kernel tests) the CPU as their default device."""
    _current["node"] = request.node
    on_gpu = any(request.node.get_closest_marker(m) is not None for m in ("multidevice", "gpu"))
    try:
        if GPU_MODE and not on_gpu:
            with jax.default_device(jax.devices("cpu")[0]):
                yield
        else:
            yield
    finally:
        _current["node"] = None


def pytest_report_header(config):
    lines = [f"multi-device tests: {device_count()} {describe_devices()} (MXFP8_TEST_PLATFORM={_ASKED})"]
    if _USER_JAX_PLATFORMS not in (None, "", os.environ["JAX_PLATFORMS"]):
        lines.append(
            f"JAX_PLATFORMS={_USER_JAX_PLATFORMS} replaced by {os.environ['JAX_PLATFORMS']}: "
            "MXFP8_TEST_PLATFORM chooses the platform"
        )
    if not GPU_MODE:
        lines.append("tests/test_gpu.py not collected: MXFP8_TEST_PLATFORM is cpu (bench/gpu_check.sh runs it)")
    return lines


_not_run: collections.Counter = collections.Counter()
_NEEDS = re.compile(r"needs (\d+) devices")


def pytest_runtest_logreport(report):
    """Count the tests skipped for lack of devices or for GPU mode (on the xdist controller too)."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    m = _NEEDS.search(reason)
    if m:
        _not_run[f"multi-device tests that need {m.group(1)} devices"] += 1
    elif "CPU only:" in reason:
        _not_run["CPU-only tests (memory budgets derived for XLA:CPU, multi-process comparisons)"] += 1


KNOWN_CPU_ISAS = ("baseline", "avx2", "avx512")  # the builds the CPU extension carries


def not_run_here() -> list[str]:
    """What this host cannot test: shown at the end of every run, -q and -n included."""
    import mxfp8_jax as mx

    lines = []
    if not GPU_MODE:
        lines.append("GPU tests: tests/test_gpu.py not collected (MXFP8_TEST_PLATFORM is cpu; bench/gpu_check.sh)")
    if not HAS_CUDA_PLUGIN:
        lines.append(
            "steps compiled for GPU meshes: tests/test_gpu_compile.py not collected (no jax CUDA plugin in this "
            "environment; the README's gpu-compile command installs it)"
        )
    if "cpu" not in mx.available_backends():
        lines.append("CPU kernels: the compiled extension is not installed; only the pure-JAX paths ran")
    else:
        missing = [isa for isa in KNOWN_CPU_ISAS if isa not in mx.cpu_isas()]
        if missing:
            lines.append(f"CPU kernel builds this CPU cannot run, so never tested here: {', '.join(missing)}")
    for what, count in sorted(_not_run.items()):
        where = f" (this run has {device_count()} {describe_devices()})" if "devices" in what else ""
        lines.append(f"{what}: {count} not run{where}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    lines = not_run_here()
    if lines:
        terminalreporter.write_sep("-", "not run on this host")
        for line in lines:
            terminalreporter.write_line(line)
