"""GPU clusters to compile for without one: XLA's descriptions of its GPUs, and meshes of
compile-only devices built from them.

XLA compiles for a GPU it cannot see from a ``GpuTargetConfigProto``: the device's limits,
core count, clocks, memory size and bandwidth, which its cost model and scheduler read. jax's
CUDA plugin (``jax[cuda13]``) carries XLA's own descriptions of the GPUs it knows (H100, H200,
B200, ...) as text inside its library; ``target_config`` reads them from the installed plugin,
so the project ships none and they always match the compiler that uses them. A description of
one's own (``--target-config``: a text-format ``GpuTargetConfigProto``) works too.

``topology_mesh`` turns one into a ``jax.sharding.Mesh`` of compile-only devices
(``jax.experimental.topologies``): programs jitted over it compile with XLA:GPU's whole pipeline
(partitioning, fusion, the latency-hiding scheduler, memory assignment) and cannot run. The
plugin must be registered without starting a GPU client: ``ensure_compile_only()`` sets
``JAX_PLATFORMS=cpu`` before jax starts its backends (the host's CPU stays the default device).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import sys

# short name -> XLA's device_description_str in its descriptions (the plugin's *.txtpb files)
TARGETS: dict[str, str] = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200 141GB HBM3e",
    "b200": "NVIDIA B200",
    "b300": "NVIDIA B300",
    "gb200": "NVIDIA GB200",
    "a100": "NVIDIA A100-SXM4-80GB",
}
_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
_MARKER = b"proto-message: stream_executor.GpuTargetConfigProto"


class TargetError(RuntimeError):
    """A GPU target cannot be described or compiled for here (the plugin, the name, the file)."""


def ensure_compile_only() -> None:
    """Lets jax register its GPU plugin for compile-only devices on a host without a GPU: the
    platforms jax starts are ``cpu`` when nothing chose them (a GPU client, which fails without
    a driver, is never started; the plugin still registers). Call before jax starts its
    backends; a setting of the user's (``JAX_PLATFORMS``) is kept."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


def plugin_library() -> pathlib.Path:
    """The installed jax CUDA plugin's PJRT library.

    Raises:
      TargetError: no jax CUDA plugin is installed (it is ``pip install "jax[cuda13]==<jax>"``).
    """
    for name in _PLUGINS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            found = sorted(pathlib.Path(folder).glob("xla_cuda_plugin*.so"))
            if found:
                return found[0]
    import jax

    raise TargetError(
        "compiling for GPUs needs jax's CUDA plugin at jax's version: "
        f'pip install "jax[cuda13]=={jax.__version__}" (it brings XLA:GPU and NVIDIA\'s compiler; no GPU '
        "or driver is needed to compile)"
    )


@functools.cache
def _embedded() -> dict[str, str]:
    """``{device_description_str: text}`` of every description inside the plugin's library."""
    data = plugin_library().read_bytes()
    out = {}
    for m in re.finditer(re.escape(_MARKER), data):
        start = data.rfind(b"\x00", 0, m.start()) + 1
        end = data.find(b"\x00", m.end())
        text = data[start:end].decode("utf-8", "replace")
        name = re.search(r'device_description_str:\s*"([^"]*)"', text)
        if name and "gpu_device_info" in text:
            out[name.group(1)] = text
    return out


def known() -> dict[str, str]:
    """The short names this module knows and the descriptions the installed plugin carries for
    them (``{name: device_description_str}``, those missing from the plugin left out)."""
    have = _embedded()
    return {k: v for k, v in TARGETS.items() if v in have}


def target_config(gpu: str, path: str | None = None) -> str:
    """The text-format ``GpuTargetConfigProto`` of ``gpu``.

    Args:
      gpu: a short name of ``TARGETS`` (``"h100"``, ``"b200"``...), or XLA's own description
        string (``"NVIDIA H100 80GB HBM3"``).
      path: a file holding the description instead (text format), read as it is.

    Raises:
      TargetError: the name is unknown, or the installed plugin does not describe it.
    """
    if path is not None:
        text = pathlib.Path(path).read_text()
        if "gpu_device_info" not in text:
            raise TargetError(f"--target-config {path}: not a text-format GpuTargetConfigProto (no gpu_device_info)")
        return text
    have = _embedded()
    description = TARGETS.get(gpu.lower(), gpu)
    if description not in have:
        raise TargetError(
            f"gpu={gpu!r}: the installed jax CUDA plugin ({plugin_library().name}) describes "
            f"{sorted(have)}; short names: {sorted(TARGETS)}; or give a description file (--target-config)"
        )
    return have[description]


def describe(config: str) -> dict[str, object]:
    """The fields of a description that a reader of its numbers wants: name, compute capability,
    SMs, clock, memory size and bandwidth."""

    def field(name, cast=str):
        m = re.search(rf"\b{name}:\s*\"?([^\"\n]+)\"?", config)
        return cast(m.group(1)) if m else None

    major = re.search(r"cuda_compute_capability\s*\{[^}]*?major:\s*(\d+)", config, re.S)
    minor = re.search(r"cuda_compute_capability\s*\{[^}]*?minor:\s*(\d+)", config, re.S)
    return {
        "name": field("device_description_str"),
        "compute_capability": f"{major.group(1)}.{minor.group(1) if minor else 0}" if major else None,
        "sms": field("core_count", int),
        "clock_ghz": field("clock_rate_ghz", float),
        "memory_bytes": field("device_memory_size", int),
        "memory_bandwidth": field("memory_bandwidth", int),
    }


def topology_mesh(config: str, devices: int, axes=("fsdp",), shape=None, *, hosts: int = 1):
    """A mesh of ``devices`` compile-only CUDA devices described by ``config`` (``hosts`` hosts
    of ``devices / hosts`` each), shaped ``shape`` (default: one axis) with names ``axes``.

    Raises:
      TargetError: jax cannot make compile-only CUDA devices here (no plugin, or jax started a
        GPU client that failed: set ``JAX_PLATFORMS=cpu``).
    """
    import jax
    from jax.experimental import topologies

    if devices < 1 or hosts < 1 or devices % hosts:
        raise TargetError(f"devices={devices} must be a positive multiple of hosts={hosts}")
    plugin_library()
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x{hosts}x{devices // hosts}"
        )
    except NotImplementedError as e:
        raise TargetError(
            f"jax has no compile-only CUDA devices here ({e}): its CUDA plugin did not register; "
            "run with JAX_PLATFORMS=cpu set before jax starts (mxfp8-jax gpu-compile does) and the "
            f'plugin at jax\'s version (pip install "jax[cuda13]=={jax.__version__}")'
        ) from e
    return topologies.make_mesh(topo, tuple(shape or (devices,)), tuple(axes))
