"""GPU benchmark: GB/s of the MXFP8 kernels against copy bandwidth and XLA's compiled reference.

    python -m mxfp8_jax.bench.gpu [--sizes-mb 1,16,256,1024] [--json out.json]

For each input size (bf16 bytes of the input tensor), in one run on one GPU:
  - copy: an XLA elementwise pass that reads and writes every byte (the bandwidth floor's
    counterpart; measured at each size);
  - quantize rowwise / columnwise / both, packed-segment quantize (both planes), and RMSNorm +
    rowwise quantize: the FFI kernel, and XLA's own compilation of the pure-JAX reference.
GB/s counts the bytes a kernel must move: its input plus its outputs. Times are medians of
device-synchronised runs after warm-up. Each kernel program is checked to call its GPU
handler (no silent fallback) and, at the smallest size, to produce the reference's bytes.
The table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mxfp8_jax as mx
from mxfp8_jax._src.buffers.segments import quantize_segments_reference
from mxfp8_jax._src.kernels import _ffi, ffi_calls
from mxfp8_jax.bench._timing import environment, print_table, time_fn, write_json

K = 4096  # row length of the quantize inputs
H = 8192  # hidden size of the RMSNorm inputs
SEGMENT_ROW_LENS = (4096, 1024, 11008 // 32 * 32, 512)  # pieces of the packed segment


def _checked(fn, target: str | None, *args):
    """Jit fn for the GPU; refuse a program that does not call ``target`` (when given)."""
    jitted = jax.jit(fn)
    if target is not None:
        hlo = jitted.lower(*args).compile().as_text()
        if target not in hlo:
            raise RuntimeError(f"the benchmarked program does not call {target}: refusing to time it")
    return jitted


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _segment_table(n: int) -> np.ndarray:
    """Pieces of the segment back to back (offset, rows, row_len), 32-row multiples, a small gap
    between pieces, the tail uncovered: a QuantizedDBuffer shard's shape."""
    rows, at, i = [], 0, 0
    while True:
        k = SEGMENT_ROW_LENS[i % len(SEGMENT_ROW_LENS)]
        r = 32 * max(1, (n // 8) // (32 * k))
        if at + r * k > n:
            break
        rows.append((at, r, k))
        at += r * k + 32 * 4
        i += 1
    return np.array(sorted(rows) or [(0, 0, 32)], np.int32)


def _cases(mb: int, rng):
    """(name, kernel fn, reference fn, target, args) for one input size."""
    bf16 = jnp.bfloat16
    m = max(32, (mb << 20) // (2 * K) // 32 * 32)
    x = jnp.asarray(rng.standard_normal((m, K), np.float32), bf16)
    cases = []
    for name, row, col in (
        ("quantize rowwise", True, False),
        ("quantize columnwise", False, True),
        ("quantize both", True, True),
    ):
        cases.append(
            (
                name,
                functools.partial(mx.quantize, rowwise=row, columnwise=col, backend="auto"),
                functools.partial(mx.quantize, rowwise=row, columnwise=col, backend="jax"),
                "mxfp8_quantize",
                (x,),
            )
        )
    n = m * K
    seg = x.reshape(n)
    table = _segment_table(n)
    desc = jnp.asarray(table)

    def seg_kernel(x, d):
        (rq, rs), (cq, cs) = ffi_calls.quantize_segments(x, d, scale_rule=0, rowwise=True, columnwise=True)
        return rq, rs, cq, cs

    cases.append(
        (
            "segments both",
            seg_kernel,
            lambda x, d: quantize_segments_reference(x, d, mx.ScaleRule.RCEIL, True, True),
            "mxfp8_quantize_segments",
            (seg, desc),
        )
    )
    r = max(1, (mb << 20) // (2 * H))
    xn = jnp.asarray(rng.standard_normal((r, H), np.float32), bf16)
    gamma = jnp.asarray(rng.standard_normal(H, np.float32) * 0.5 + 1, bf16)
    cases.append(
        (
            "rmsnorm+quantize",
            functools.partial(mx.rmsnorm_quant, backend="auto"),
            functools.partial(mx.rmsnorm_quant, backend="jax"),
            "mxfp8_rmsnorm_quantize",
            (xn, gamma),
        )
    )
    return cases


def _copy(x):
    u = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return u ^ jnp.uint16(1)  # reads and writes every byte; XLA cannot elide it


def run(sizes_mb, *, iters: int, json_path: str | None) -> list[dict]:
    platform = _ffi.gpu_platform()
    if platform is None:
        sys.exit("no GPU visible to jax: this benchmark measures the GPU kernels only")
    for t in ("mxfp8_quantize", "mxfp8_quantize_segments", "mxfp8_rmsnorm_quantize"):
        _ffi.require(t, platform)
    print(f"platform {platform}: {jax.devices()[0].device_kind}", flush=True)
    rng = np.random.default_rng(0)
    results = []
    for mb in sizes_mb:
        for name, kernel, reference, target, args in _cases(mb, rng):
            k = _checked(kernel, target, *args)
            ref = _checked(reference, None, *args)
            out = k(*args)
            if mb == min(sizes_mb):  # the kernel's bytes are the reference's
                want = ref(*args)
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
                    if not np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
                        raise AssertionError(f"{name}: kernel bytes differ from the reference")
            moved = _nbytes(args) + _nbytes(out)
            t_k = time_fn(k, *args, warmup=3, iters=iters)
            t_r = time_fn(ref, *args, warmup=2, iters=max(3, iters // 4))
            t_c = time_fn(jax.jit(_copy), args[0], warmup=3, iters=iters)
            copy_gbs = 2 * _nbytes(args[0]) / t_c / 1e9
            row = dict(
                op=name,
                mb=mb,
                bytes=moved,
                kernel_s=t_k,
                xla_s=t_r,
                copy_s=t_c,
                kernel_gbs=moved / t_k / 1e9,
                xla_gbs=moved / t_r / 1e9,
                copy_gbs=copy_gbs,
            )
            results.append(row)
            print(
                f"{name:20s} {mb:6d} MB  kernel {row['kernel_gbs']:8.1f} GB/s  "
                f"xla {row['xla_gbs']:8.1f} GB/s  copy {copy_gbs:8.1f} GB/s",
                flush=True,
            )
    write_json(json_path, dict(environment=environment(), results=results))
    print_table(
        f"MXFP8 GPU kernels ({platform}, {jax.devices()[0].device_kind})",
        ["op", "input MB", "kernel GB/s", "% of copy", "XLA ref GB/s", "speedup vs XLA"],
        [
            [
                r["op"],
                r["mb"],
                f"{r['kernel_gbs']:.0f}",
                f"{100 * r['kernel_gbs'] / r['copy_gbs']:.0f}%",
                f"{r['xla_gbs']:.0f}",
                f"{r['xla_s'] / r['kernel_s']:.1f}x",
            ]
            for r in results
        ],
    )
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,16,256,1024", help="comma-separated input sizes in MB (bf16 input bytes)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    run([int(s) for s in a.sizes_mb.split(",")], iters=a.iters, json_path=a.json)


if __name__ == "__main__":
    main()
