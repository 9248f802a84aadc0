"""Quantize throughput: the FFI kernel vs the jitted pure-JAX reference vs a plain copy.

    python -m mxfp8_jax.bench.quantize [--m 4096 --k 4096 --dtype bfloat16 --isa avx2 --json out.json]

All three run in the same process on the same input. GB/s counts the bytes each one must move
(input read + planes written; the copy reads and writes the input once), and the floor is the
time the kernel's bytes would take at the measured copy bandwidth. On CPU the kernel runs the
best instruction set of the machine (named in the title) unless --isa picks a lower one.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import mxfp8_jax as mx
from mxfp8_jax._src import _ffi, cpu_isa
from mxfp8_jax.bench._timing import (
    add_fresh_pages_flag,
    environment,
    print_table,
    reuse_freed_memory,
    time_fn,
    write_json,
)


def run(
    m: int = 4096,
    k: int = 4096,
    dtype: str = "bfloat16",
    rowwise: bool = True,
    columnwise: bool = True,
    iters: int = 10,
    json_path: str | None = None,
    isa: str | None = None,
) -> dict:
    platform = jax.default_backend()
    _ffi.require("mxfp8_quantize", platform)  # never silently benchmark the fallback
    if platform != "cpu" and isa is not None:
        raise ValueError(f"isa={isa!r} selects a CPU instruction set; the default backend is {platform!r}")
    if platform == "cpu":
        if isa is not None:
            cpu_isa.set_cpu_isa(isa)
        isa = cpu_isa.cpu_isa()
    x = (jax.random.normal(jax.random.key(0), (m, k), jnp.float32) * 3).astype(dtype)
    in_bytes = x.size * x.dtype.itemsize
    planes = int(rowwise) + int(columnwise)
    out_bytes = planes * (m * k + m * k // 32)
    kernel = jax.jit(lambda a: mx.quantize(a, rowwise=rowwise, columnwise=columnwise, backend="ffi"))
    reference = jax.jit(lambda a: mx.quantize(a, rowwise=rowwise, columnwise=columnwise, backend="jax"))
    copy = jax.jit(lambda a: jnp.copy(a))
    # The kernel and the reference must agree before either is timed.
    a, b = kernel(x), reference(x)
    for pa, pb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if not bool(
            jnp.all(jax.lax.bitcast_convert_type(pa, jnp.uint8) == jax.lax.bitcast_convert_type(pb, jnp.uint8))
        ):
            raise AssertionError("kernel and reference disagree; refusing to benchmark")
    t_kernel = time_fn(kernel, x, iters=iters)
    t_ref = time_fn(reference, x, iters=max(3, iters // 3))
    t_copy = time_fn(copy, x, iters=iters)
    copy_bw = 2 * in_bytes / t_copy
    moved = in_bytes + out_bytes
    floor = moved / copy_bw
    rows = [
        ("ffi kernel", f"{t_kernel * 1e3:.2f}", f"{moved / t_kernel / 1e9:.2f}", "1.00", f"{floor / t_kernel:.2f}"),
        (
            "pure-JAX reference (jit)",
            f"{t_ref * 1e3:.2f}",
            f"{moved / t_ref / 1e9:.2f}",
            f"{t_ref / t_kernel:.2f}",
            f"{floor / t_ref:.2f}",
        ),
        ("copy of the input", f"{t_copy * 1e3:.2f}", f"{copy_bw / 1e9:.2f}", f"{t_copy / t_kernel:.2f}", "-"),
    ]
    print_table(
        f"MXFP8 quantize {m}x{k} {dtype}, planes: {'rowwise ' if rowwise else ''}{'columnwise' if columnwise else ''} "
        f"({platform}{', ' + isa if isa else ''})",
        ["path", "ms", "GB/s", "time / kernel", "copy-floor / time"],
        rows,
    )
    result = {
        "bench": "quantize",
        "m": m,
        "k": k,
        "dtype": dtype,
        "rowwise": rowwise,
        "columnwise": columnwise,
        "isa": isa,
        "bytes_moved": moved,
        "kernel_s": t_kernel,
        "reference_s": t_ref,
        "copy_s": t_copy,
        "copy_GBps": copy_bw / 1e9,
        "kernel_GBps": moved / t_kernel / 1e9,
        "reference_GBps": moved / t_ref / 1e9,
        "speedup_vs_reference": t_ref / t_kernel,
        "fraction_of_copy_floor": floor / t_kernel,
        "env": environment(),
    }
    write_json(json_path, result)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--planes", default="both", choices=["rowwise", "columnwise", "both"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--isa",
        choices=["baseline", "avx2", "avx512"],
        help="CPU instruction set of the kernel (default: the best this CPU has)",
    )
    p.add_argument("--json", dest="json_path")
    add_fresh_pages_flag(p)
    a = p.parse_args(argv)
    reuse_freed_memory(not a.fresh_pages)
    run(
        a.m,
        a.k,
        a.dtype,
        a.planes in ("rowwise", "both"),
        a.planes in ("columnwise", "both"),
        a.iters,
        a.json_path,
        a.isa,
    )


if __name__ == "__main__":
    main()
