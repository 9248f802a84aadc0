"""Quantize throughput: the FFI kernel vs the jitted pure-JAX reference vs a plain memcpy.

    python -m mxfp8_jax.bench.quantize [--m 4096 --k 4096 --dtype bfloat16 float32 --isa avx2
                                        --planes both|rowwise|columnwise|tiles --repeats 3
                                        --json out.json]

``--planes tiles`` times the 32x32-block quantize (``blocks="32x32"``: one plane, one scale per
tile, the kernel ``mxfp8_quantize_tiles``), what an FSDP unit of 32x32 blocks runs after each
optimizer step in place of the two 1x32 planes.

All run in the same process on the same input. GB/s counts the bytes each one must move (input
read + planes written; the memcpy reads and writes its buffer once), and the floor is the time the
kernel's bytes would take at the memcpy's rate. The memcpy is a real one between two preallocated
host buffers (on CPU) of at least 64 MiB, not a jitted XLA copy (XLA:CPU's elementwise loops run
below memory speed). On a shared machine the memcpy and the kernel are timed alternately,
``--repeats`` rounds, and the ratio is reported per round. On CPU the kernel runs the best
instruction set of the machine (named in the title) unless --isa picks a lower one.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import _ffi, cpu_isa
from mxfp8_jax.bench._timing import (
    Memcpy,
    add_fresh_pages_flag,
    environment,
    interleaved_ratios,
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
    repeats: int = 3,
    reference: bool = True,
    blocks: str = "1x32",
) -> dict:
    from mxfp8_jax._src.core import platforms

    platform = platforms.default()  # "cuda" / "rocm", as the extension names them
    tiles = blocks == "32x32"
    _ffi.require("mxfp8_quantize_tiles" if tiles else "mxfp8_quantize", platform)  # never the fallback
    if platform != "cpu" and isa is not None:
        raise ValueError(f"isa={isa!r} selects a CPU instruction set; the default backend is {platform!r}")
    if platform == "cpu":
        if isa is not None:
            cpu_isa.set_cpu_isa(isa)
        isa = cpu_isa.cpu_isa()
    x = (jax.random.normal(jax.random.key(0), (m, k), jnp.float32) * 3).astype(dtype)
    in_bytes = x.size * x.dtype.itemsize
    planes = int(rowwise) + int(columnwise)
    out_bytes = m * k + (m // 32) * (k // 32) if tiles else planes * (m * k + m * k // 32)
    which = {"blocks": "32x32"} if tiles else {"rowwise": rowwise, "columnwise": columnwise}
    kernel = jax.jit(lambda a: mx.quantize(a, backend="ffi", **which))
    ref_fn = jax.jit(lambda a: mx.quantize(a, backend="jax", **which))
    # The kernel and the reference must agree before either is timed.
    a, b = kernel(x), ref_fn(x)
    for pa, pb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if not bool(
            jnp.all(jax.lax.bitcast_convert_type(pa, jnp.uint8) == jax.lax.bitcast_convert_type(pb, jnp.uint8))
        ):
            raise AssertionError("kernel and reference disagree; refusing to benchmark")
    moved = in_bytes + out_bytes
    memcpy = Memcpy(max(in_bytes, 64 << 20))
    t_kernel, copy_bw, ratios = interleaved_ratios(kernel, (x,), moved, memcpy, repeats, iters)
    t_ref = time_fn(ref_fn, x, iters=max(3, iters // 3)) if reference else float("nan")
    t_copy = memcpy.nbytes * 2 / copy_bw
    floor = moved / copy_bw
    ratio = ratios[len(ratios) // 2]
    rows = [
        (
            "ffi kernel",
            f"{t_kernel * 1e3:.2f}",
            f"{moved / t_kernel / 1e9:.2f}",
            "1.00",
            f"{ratio:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})",
        ),
        (
            "pure-JAX reference (jit)",
            f"{t_ref * 1e3:.2f}",
            f"{moved / t_ref / 1e9:.2f}",
            f"{t_ref / t_kernel:.2f}",
            f"{floor / t_ref:.2f}",
        ),
        (f"memcpy, {memcpy.nbytes >> 20} MiB", f"{t_copy * 1e3:.2f}", f"{copy_bw / 1e9:.2f}", "-", "1.00"),
    ]
    print_table(
        f"MXFP8 quantize {m}x{k} {dtype}, planes: "
        + ("one of 32x32 tiles " if tiles else f"{'rowwise ' if rowwise else ''}{'columnwise' if columnwise else ''} ")
        + f"({platform}{', ' + isa if isa else ''}; {len(ratios)} rounds)",
        ["path", "ms", "GB/s", "time / kernel", "rate / memcpy rate"],
        rows,
    )
    result = {
        "bench": "quantize",
        "m": m,
        "k": k,
        "dtype": dtype,
        "rowwise": rowwise,
        "columnwise": columnwise,
        "blocks": blocks,
        "isa": isa,
        "bytes_moved": moved,
        "kernel_s": t_kernel,
        "reference_s": t_ref,
        "memcpy_bytes": memcpy.nbytes,
        "memcpy_GBps": copy_bw / 1e9,
        "kernel_GBps": moved / t_kernel / 1e9,
        "reference_GBps": moved / t_ref / 1e9,
        "speedup_vs_reference": t_ref / t_kernel,
        "fraction_of_memcpy": ratio,
        "fraction_of_memcpy_rounds": ratios,
        "env": environment(),
    }
    write_json(json_path, result)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument(
        "--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"], help="one run each"
    )
    p.add_argument(
        "--planes", default="both", choices=["rowwise", "columnwise", "both", "tiles"], help="tiles: 32x32 blocks"
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="rounds of memcpy / kernel timing, alternating")
    p.add_argument("--no-reference", action="store_true", help="skip timing the (slow) pure-JAX reference")
    p.add_argument(
        "--isa",
        choices=["baseline", "avx2", "avx512"],
        help="CPU instruction set of the kernel (default: the best this CPU has)",
    )
    p.add_argument("--json", dest="json_path")
    add_fresh_pages_flag(p)
    a = p.parse_args(argv)
    reuse_freed_memory(not a.fresh_pages)
    results = [
        run(
            a.m,
            a.k,
            dtype,
            a.planes in ("rowwise", "both"),
            a.planes in ("columnwise", "both"),
            a.iters,
            None,
            a.isa,
            a.repeats,
            not a.no_reference,
            "32x32" if a.planes == "tiles" else "1x32",
        )
        for dtype in a.dtype
    ]
    write_json(a.json_path, results[0] if len(results) == 1 else {"bench": "quantize", "runs": results})


if __name__ == "__main__":
    main()
