"""Loads the compiled XLA FFI extension(s) and registers their targets with jax.

The extension is optional: without it the package imports, says so once, and only the pure-JAX
paths (``backend="jax"``) work. Each platform lives in its own module (``_mxfp8_cpu``,
``_mxfp8_cuda``, ``_mxfp8_rocm``) so that a GPU part that cannot load on this machine (no driver,
no ROCm runtime) never stops the CPU part from loading.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import jax

from mxfp8_jax._src import vma

# platform name as jax spells it for register_ffi_target -> extension module
_MODULES = {"cpu": "_mxfp8_cpu", "cuda": "_mxfp8_cuda", "rocm": "_mxfp8_rocm"}
_FFI_PLATFORM = {"cpu": "cpu", "cuda": "CUDA", "rocm": "ROCM"}


class ExtensionMissingError(RuntimeError):
    """The compiled extension (or the platform part a call needs) is not installed."""


@functools.cache
def _load() -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Imports every platform module present; returns (targets per backend, load errors)."""
    loaded: dict[str, dict[str, object]] = {}
    errors: dict[str, str] = {}
    for backend, module in _MODULES.items():
        try:
            mod = importlib.import_module(f"mxfp8_jax.{module}")
        except ImportError as e:  # not built, or its runtime library is absent
            errors[backend] = str(e)
            continue
        regs = mod.registrations()
        for name, capsule in regs.items():
            jax.ffi.register_ffi_target(name, capsule, platform=_FFI_PLATFORM[backend])
        loaded[backend] = dict(regs)
    if "cpu" not in loaded:
        warnings.warn(
            "mxfp8_jax: the compiled extension is not installed "
            f"({errors.get('cpu', 'unknown reason')}); only backend='jax' is available. "
            "Reinstall with `pip install .` to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
    return loaded, errors


def available_backends() -> tuple[str, ...]:
    """Platforms whose handlers the installed extension carries, e.g. ``('cpu', 'cuda')``."""
    return tuple(_load()[0])


def has_target(name: str, platform: str = "cpu") -> bool:
    return name in _load()[0].get(platform, {})


def require(name: str, platform: str) -> None:
    """Raises a clear error when target ``name`` has no handler for ``platform``."""
    loaded, errors = _load()
    if name in loaded.get(platform, {}):
        return
    why = errors.get(platform, f"the {platform} part does not provide {name!r}")
    raise ExtensionMissingError(
        f"{name} needs the compiled mxfp8_jax extension for platform {platform!r}, which is not "
        f"available ({why}). Use backend='jax' for the pure-JAX path."
    )


def default_platform() -> str:
    return jax.default_backend()


def extension_platform(platform: str) -> str:
    """The extension's platform name (``'cpu'``, ``'cuda'``, ``'rocm'``) for a jax platform name:
    jax calls CUDA and ROCm devices alike ``'gpu'``."""
    if platform == "gpu":
        return gpu_platform() or "cuda"
    return platform


def gpu_platform() -> str | None:
    """'cuda' or 'rocm' when jax's default device is a GPU, else None."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform not in ("gpu", "cuda", "rocm"):
        return None
    version = str(getattr(dev.client, "platform_version", "")).lower()
    return "rocm" if ("rocm" in version or "hip" in version) else "cuda"


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
    branches = {p: kernel_ for p, regs in loaded.items() if target in regs}
    return jax.lax.platform_dependent(*args, default=reference_, **branches)
