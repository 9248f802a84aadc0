"""Loads the compiled XLA FFI extension(s) and registers their targets with jax.

The extension is optional: without it the package imports, says so once, and only the pure-JAX
paths (``backend="jax"``) work. Each platform lives in its own module (``_mxfp8_cpu``,
``_mxfp8_cuda``, ``_mxfp8_rocm``) so that a GPU part that cannot load on this machine (no driver,
no ROCm runtime) never stops the CPU part from loading.

A GPU module checks at import that this machine's driver or ROCm runtime can run it (a CUDA 13
build needs an R580+ driver; a ROCm build needs the HIP runtime of its major version) and fails
the import with the reason, which is warned once here. The devices are checked against the
architectures the module was built for when an op first dispatches: a GPU without code in the
module gets one warning and the pure-JAX reference (same bytes), instead of a launch failure.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import warnings

import jax

from mxfp8_jax._src.core import platforms, vma

# platform name as jax spells it for register_ffi_target -> extension module
_MODULES = {"cpu": "_mxfp8_cpu", "cuda": "_mxfp8_cuda", "rocm": "_mxfp8_rocm"}
_FFI_PLATFORM = {"cpu": "cpu", "cuda": "CUDA", "rocm": "ROCM"}


class ExtensionMissingError(RuntimeError):
    """The compiled extension (or the platform part a call needs) is not installed."""


class GpuFallbackWarning(RuntimeWarning):
    """A GPU part of the extension cannot run here; the ops use the pure-JAX reference there."""


# backend -> the architectures its module was built for (CMake's list, comma-separated)
_ARCHS: dict[str, str] = {}


def _import_problem(module: str, e: ImportError) -> str | None:
    """The reason to warn about when a built GPU module fails to import, else None (not built:
    nothing to say). The module's own check (runtime.cu) words its reason; a missing
    libamdhip64 of the ROCm it was linked with is named here."""
    msg = str(e)
    if isinstance(e, ModuleNotFoundError) and importlib.util.find_spec(f"mxfp8_jax.{module}") is None:
        return None
    if msg.startswith("mxfp8_jax:"):
        return msg
    if "libamdhip64" in msg:
        needed = _needed_library(module, rb"libamdhip64\.so\.\d+")
        return (
            f"mxfp8_jax: {module} links {needed or 'libamdhip64'} (the ROCm it was built with), which "
            f"this machine cannot load ({msg}); install that ROCm or rebuild the extension against this one"
        )
    return None


def _needed_library(module: str, pattern: bytes) -> str | None:
    """The first library name matching ``pattern`` in the module file (its DT_NEEDED entry)."""
    spec = importlib.util.find_spec(f"mxfp8_jax.{module}")
    try:
        with open(spec.origin, "rb") as f:  # type: ignore[union-attr, arg-type]
            m = re.search(pattern, f.read())
    except (OSError, AttributeError, TypeError):
        return None
    return m.group().decode() if m else None


def _registration_problem(mod, err: Exception) -> str:
    """Why jax refused a module's handlers, with the fix when it is the FFI API version: the
    module was compiled against the headers of a newer jaxlib than the one running."""
    built = getattr(mod, "ffi_jaxlib", "an unknown jaxlib")
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "API version" not in text:
        return f"jax refused the extension's handlers: {text}"
    import jaxlib

    return (
        f"the extension was compiled against the XLA FFI headers of jaxlib {built}, and the jaxlib "
        f"running here ({jaxlib.__version__}) supports an older FFI API ({text}). Rebuild it against the "
        "installed jaxlib: pip install --no-build-isolation --no-deps --force-reinstall . (with the build "
        f"requirements installed), or install jaxlib {built}"
    )


@functools.cache
def _load() -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Imports every platform module present; returns (targets per backend, load errors)."""
    loaded: dict[str, dict[str, object]] = {}
    errors: dict[str, str] = {}
    for backend, module in _MODULES.items():
        try:
            mod = importlib.import_module(f"mxfp8_jax.{module}")
        except ImportError as e:  # not built, or its runtime library is absent or too old
            errors[backend] = str(e)
            if backend != "cpu" and (why := _import_problem(module, e)):
                errors[backend] = why
                warnings.warn(f"{why}; the mxfp8 ops use the pure-JAX reference on {backend}", GpuFallbackWarning, 3)
            continue
        regs = mod.registrations()
        try:
            for name, capsule in regs.items():
                jax.ffi.register_ffi_target(name, capsule, platform=_FFI_PLATFORM[backend])
        except Exception as e:  # noqa: BLE001 (jax raises its runtime error type, which moved)
            errors[backend] = _registration_problem(mod, e)
            if backend != "cpu":
                warnings.warn(
                    f"{errors[backend]}; the mxfp8 ops use the pure-JAX reference on {backend}", GpuFallbackWarning, 3
                )
            continue
        loaded[backend] = dict(regs)
        _ARCHS[backend] = str(getattr(mod, "architectures", ""))
    if "cpu" not in loaded:
        why = errors.get("cpu", "unknown reason")
        fix = "" if "Rebuild" in why else " Reinstall with `pip install .` to build it."
        warnings.warn(
            f"mxfp8_jax: the compiled extension is not usable ({why}); only backend='jax' is available.{fix}",
            RuntimeWarning,
            stacklevel=3,
        )
    return loaded, errors


def available_backends() -> tuple[str, ...]:
    """Platforms whose handlers the installed extension carries, e.g. ``('cpu', 'cuda')``.

    Returns:
      The platform names (``'cpu'``, ``'cuda'``, ``'rocm'``, in that order) whose extension module
      imported here; empty without the extension.
    """
    return tuple(_load()[0])


def architectures(platform: str) -> str | None:
    """The GPU architectures the installed module of ``platform`` was built for (CMake's list,
    e.g. ``"90-real"`` or ``"gfx942"``), or None where it is not installed."""
    _load()
    return _ARCHS.get(platform)


def has_target(name: str, platform: str = "cpu") -> bool:
    return name in _load()[0].get(platform, {})


def require(name: str, platform: str) -> None:
    """Raises a clear error when target ``name`` has no handler for ``platform``."""
    loaded, errors = _load()
    if name in loaded.get(platform, {}):
        if (why := unsupported_devices(platform)) is not None:
            raise ExtensionMissingError(f"{name} cannot run on this machine's {platform} devices: {why}")
        return
    why = errors.get(platform, f"the {platform} part does not provide {name!r}")
    raise ExtensionMissingError(
        f"{name} needs the compiled mxfp8_jax extension for platform {platform!r}, which is not "
        f"available ({why}). Use backend='jax' for the pure-JAX path."
    )


def default_platform() -> str:
    """The lowering platform of this process's default device (``"cpu"``, ``"cuda"``,
    ``"rocm"``): what an eagerly run op executes on. Programs over a mesh take the mesh's."""
    return platforms.default()


def extension_platform(platform: str) -> str:
    """The extension's platform name (``'cpu'``, ``'cuda'``, ``'rocm'``) for a jax platform name:
    jax calls CUDA and ROCm devices alike ``'gpu'``, resolved here by the default device."""
    if platform == "gpu":
        return gpu_platform() or "cuda"
    return platform


def gpu_platform() -> str | None:
    """'cuda' or 'rocm' when jax's default device is a GPU, else None."""
    try:
        platform = platforms.default()
    except RuntimeError:
        return None
    return platform if platform in platforms.GPU_PLATFORMS else None


_CUDA_ARCH = re.compile(r"^(\d+)([af]?)(?:-(real|virtual))?$")


def arch_runs(archs: str, capability: str, platform: str) -> bool:
    """Whether kernels built for ``archs`` (the module's list, e.g. ``"80-real,90-virtual"`` or
    ``"gfx942,gfx950"``) run on a device of ``capability`` (``"10.3"``; ``"gfx942:xnack-"``).

    CUDA: SASS for X.Y runs on X.Z with Z >= Y (an ``a`` target on X.Y only; an ``f`` target on
    its family, X.Z with Z >= Y); PTX is compiled by the driver for any later GPU. ROCm: a code
    object runs on its own gfx target. Anything this function does not know counts as running.
    """
    entries = [a.strip() for a in archs.replace(";", ",").split(",") if a.strip()]
    if not entries or not capability:
        return True
    if platform == "rocm":
        gfx = capability.split(":")[0].strip().lower()
        return any(e.split(":")[0].lower() == gfx or e.endswith("-generic") for e in entries)
    try:
        major, minor = (int(v) for v in capability.split(".")[:2])
    except ValueError:
        return True
    for e in entries:
        m = _CUDA_ARCH.match(e)
        if not m:
            return True  # "all", "native", ...: not ours to judge
        num, suffix, kind = int(m.group(1)), m.group(2), m.group(3)
        a_major, a_minor = divmod(num, 10)
        if suffix == "a":
            ok = (major, minor) == (a_major, a_minor)
        elif kind == "virtual" and not suffix:
            ok = (major, minor) >= (a_major, a_minor)
        elif kind is None and not suffix:  # "90": SASS and PTX
            ok = (major, minor) >= (a_major, a_minor)
        else:  # SASS, or family PTX: same major, same or later minor
            ok = major == a_major and minor >= a_minor
        if ok:
            return True
    return False


def _platform_devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend in this process
        return []


@functools.cache
def unsupported_devices(platform: str) -> str | None:
    """None when the extension's kernels for ``platform`` run on all of its visible devices (or
    none is visible: cross-platform lowering), else the reason, warned once."""
    archs = _ARCHS.get(platform)
    if not archs or platform not in ("cuda", "rocm"):
        return None
    for d in _platform_devices(platform):
        cap = str(getattr(d, "compute_capability", "") or "")
        if arch_runs(archs, cap, platform):
            continue
        hint = cap.split(":")[0] if platform == "rocm" else cap.replace(".", "") + "-real"
        var = "MXFP8_HIP_ARCHS" if platform == "rocm" else "MXFP8_CUDA_ARCHS"
        why = (
            f"device {d.id} ({d.device_kind}, compute capability {cap}) has no code in "
            f"{_MODULES[platform]}, which is built for {archs}"
        )
        warnings.warn(
            f"mxfp8_jax: {why}; the mxfp8 ops use the pure-JAX reference on {platform} (same bytes, "
            f"slower). To add it, rebuild with CMAKE_ARGS='-D{var}=...;{hint}'.",
            GpuFallbackWarning,
            stacklevel=4,
        )
        return why
    return None


def platform_dispatch(target: str, kernel, reference, *args):
    """``kernel`` on every platform whose handler for ``target`` is installed, else ``reference``.

    Chosen per lowering platform (``lax.platform_dependent``), so a function lowered for several
    platforms picks correctly on each.
    """
    loaded, _ = _load()
    if not any(target in regs for regs in loaded.values()):
        return reference(*args)
    # Under shard_map(check_vma=True) both branches must give the same types: each result is
    # typed as varying along every axis its inputs vary along.
    axes = vma.union(*args)
    kernel_, reference_ = (lambda *a: vma.vary_tree(kernel(*a), axes)), (lambda *a: vma.vary_tree(reference(*a), axes))
    branches = {p: kernel_ for p, regs in loaded.items() if target in regs and unsupported_devices(p) is None}
    return jax.lax.platform_dependent(*args, default=reference_, **branches)
