"""Which platform a program is built for, read from its devices, not from the process.

A program's platform is its devices' platform: a step jitted over a mesh of CUDA devices is a
CUDA program even when this process's default backend is the CPU (compiled ahead of time for a
GPU cluster from a host without one: ``jax.experimental.topologies``). Code that shapes a
program by platform reads it here, from the mesh it is given (``of_mesh``), or lets the lowering
decide (``lax.platform_dependent``); never ``jax.default_backend()``.

Names are the lowering platforms jax uses for ``lax.platform_dependent`` and FFI targets:
``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``. jax calls CUDA and ROCm devices alike ``"gpu"``;
which of the two a device is comes from its client.
"""

from __future__ import annotations

import re

import jax

GPU_PLATFORMS = ("cuda", "rocm")
_ROCM_HINTS = re.compile(r"rocm|hip|gfx\d|amd|instinct|\bmi\d{3}", re.IGNORECASE)


def of_device(device) -> str:
    """The lowering platform of ``device`` (a ``jax.Device``, compile-only ones included).

    Args:
      device: a device of a mesh, ``jax.devices()`` or a ``topologies`` description.

    Returns:
      ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"`` or the device's own platform name.
    """
    platform = str(device.platform).lower()
    if platform not in ("gpu", *GPU_PLATFORMS):
        return platform
    client = getattr(device, "client", None)
    raw = str(getattr(client, "_raw_platform", "") or "").lower()  # what jax lowers for
    if raw in GPU_PLATFORMS:
        return raw
    if platform in GPU_PLATFORMS:
        return platform
    described = f"{getattr(client, 'platform_version', '')} {getattr(device, 'device_kind', '')}"
    return "rocm" if _ROCM_HINTS.search(described) else "cuda"


def of_mesh(mesh) -> str:
    """The lowering platform of ``mesh``'s devices (``jax.sharding.Mesh``).

    Raises:
      ValueError: the mesh mixes platforms (one program has one).
    """
    found = {of_device(d) for d in mesh.devices.flat}
    if len(found) != 1:
        raise ValueError(f"mesh spans devices of several platforms {sorted(found)}; a program runs on one")
    return found.pop()


# Compile-only devices (``jax.experimental.topologies``) carry no compute capability; their kind
# names the GPU. The chips whose capability a program's choices depend on (block-scaled MMA:
# CUDA 10.0+, gfx950):
_KINDS = (
    (re.compile(r"\b(GB|B)(200|300)\b", re.I), "10.0"),
    (re.compile(r"RTX PRO 6000 Blackwell|\bRTX 50\d0\b", re.I), "12.0"),
    (re.compile(r"\b(GH|H)(100|200|800|20)\b", re.I), "9.0"),
    (re.compile(r"\bL(4|40S?)\b|RTX 40\d0|RTX 6000 Ada", re.I), "8.9"),
    (re.compile(r"\bA(100|800|30|10|40)\b|A6000", re.I), "8.0"),
    (re.compile(r"MI35\dX", re.I), "gfx950"),
    (re.compile(r"MI30\dX|MI300A", re.I), "gfx942"),
)


def capability(device) -> str | None:
    """The GPU's compute capability (``"9.0"``) or gfx target (``"gfx942"``): the device's own
    where it reports one, else read from its kind for the chips listed here (compile-only
    devices report none); None for anything else, and for CPUs."""
    own = str(getattr(device, "compute_capability", "") or "")
    if own:
        return own.split(":")[0]
    if not is_gpu(of_device(device)):
        return None
    kind = f"{getattr(device, 'device_kind', '')} {getattr(getattr(device, 'client', None), 'platform_version', '')}"
    for pattern, cap in _KINDS:
        if pattern.search(kind):
            return cap
    return None


def has_block_scaled_mma(platform: str, cap: str | None) -> bool | None:
    """Whether a GPU multiplies MXFP8 blocks in hardware (CUDA 10.0 and later; gfx950); None
    when its capability is unknown."""
    if cap is None or not is_gpu(platform):
        return None if is_gpu(platform) else False
    if cap.startswith("gfx"):
        return cap == "gfx950"
    try:
        return int(cap.split(".")[0]) >= 10
    except ValueError:
        return None


def of_mesh_capability(mesh) -> str | None:
    """The capability of ``mesh``'s devices when they share one (``capability``), else None."""
    found = {capability(d) for d in mesh.devices.flat}
    return found.pop() if len(found) == 1 else None


def is_gpu(platform: str) -> bool:
    """Whether ``platform`` (a lowering platform name, or jax's ``"gpu"``) is a GPU."""
    return platform in ("gpu", *GPU_PLATFORMS)


def default() -> str:
    """The lowering platform of this process's default device: only for what runs eagerly
    here (benchmarks, reports); a program over a mesh takes ``of_mesh``."""
    return of_device(jax.devices()[0])
