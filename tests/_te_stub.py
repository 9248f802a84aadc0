"""A test-only stand-in that lets Transformer Engine's pure-Python JAX ``quantize`` package import.

The ``transformer-engine`` wheel is pure Python; its JAX extension ``transformer_engine_jax`` is
a compiled CUDA library that cannot load on a CPU host, and the package ``__init__`` files of
``transformer_engine``, ``transformer_engine.common`` and ``transformer_engine.jax`` load CUDA
libraries as they import. ``install()`` therefore puts into ``sys.modules``:

- ``transformer_engine_jax``: the few names TE's ``quantize`` package reads at import time (the
  enums it wraps and the version/device queries, which raise if anything calls them);
- empty package modules for the three packages above whose ``__path__`` is the installed TE
  directory, so that their submodules (``jax.quantize``, ``jax.sharding``, ``common.recipe``...)
  are the real, unmodified TE files while the package ``__init__`` files never run.

Nothing of TE's numerics is replaced: the quantizer, tensor classes and dequantizer are TE's.
``uninstall()`` removes every module added, so later tests see the interpreter as before.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import sys
import types

_PACKAGES = ("transformer_engine", "transformer_engine.common", "transformer_engine.jax")


class TEUnavailable(ImportError):
    """The ``transformer-engine`` wheel (or a module its quantize package needs) is missing."""


def _no_cuda(name):
    def call(*args, **kwargs):
        raise RuntimeError(
            f"transformer_engine_jax.{name} was called, but this is the CPU test stand-in for TE's "
            f"CUDA extension: the code under test reached a GPU-only path"
        )

    call.__name__ = name
    return call


def _extension_module() -> types.ModuleType:
    ext = types.ModuleType("transformer_engine_jax")
    ext.__doc__ = "CPU test stand-in for TE's compiled JAX extension (see tests/_te_stub.py)."
    # The enums are only compared for identity inside TE's Python; the values are arbitrary.
    ext.JAXX_Quantize_Layout = enum.Enum("JAXX_Quantize_Layout", "ROWWISE COLWISE ROWWISE_COLWISE")
    ext.JAXX_Scaling_Mode = enum.Enum(
        "JAXX_Scaling_Mode",
        "NO_SCALING DELAYED_TENSOR_SCALING MXFP8_1D_SCALING CURRENT_TENSOR_SCALING NVFP4_1D_SCALING NVFP4_2D_SCALING",
    )
    ext.DType = enum.Enum(
        "DType", "kByte kInt32 kInt64 kFloat32 kFloat16 kBFloat16 kFloat8E4M3 kFloat8E5M2 kFloat8E8M0 kFloat4E2M1"
    )
    for name in (
        "get_cublasLt_version",
        "get_cuda_version",
        "get_cudnn_version",
        "get_device_compute_capability",
    ):
        setattr(ext, name, _no_cuda(name))
    return ext


def _te_root() -> str:
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):  # e.g. a None entry in sys.modules
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise TEUnavailable(
            "the `transformer-engine` wheel is not installed; install the test extra "
            "(pip install -e '.[test]'), which pins transformer-engine==2.20.2"
        )
    return next(iter(spec.submodule_search_locations))


_added: list[str] = []


def install():
    """Makes ``transformer_engine.jax.quantize`` importable on this host; returns that module.

    If TE's quantize package is already imported (a CUDA host with the real extension), it is
    returned as is and nothing is installed.
    """
    if "transformer_engine.jax.quantize" in sys.modules and not _added:
        return sys.modules["transformer_engine.jax.quantize"]
    root = _te_root()
    modules = {"transformer_engine_jax": _extension_module()}
    for name in _PACKAGES:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
        pkg.__package__ = name
        modules[name] = pkg
    for name, mod in modules.items():
        if name not in sys.modules:
            sys.modules[name] = mod
            _added.append(name)
    before = set(sys.modules)
    try:
        quantize = importlib.import_module("transformer_engine.jax.quantize")
    except ImportError as e:
        uninstall()
        raise TEUnavailable(
            f"Transformer Engine's JAX quantize package did not import with the CPU stand-in: {type(e).__name__}: {e}"
        ) from e
    finally:
        # Only TE's own modules are forgotten again; libraries TE imported (pydantic, flax...)
        # stay, as any import would leave them.
        new = set(sys.modules) - before - set(_added)
        _added.extend(sorted(n for n in new if n.split(".")[0] == "transformer_engine"))
    return quantize


def uninstall() -> None:
    """Removes every module ``install`` added: stand-ins and TE modules loaded through them."""
    while _added:
        sys.modules.pop(_added.pop(), None)
