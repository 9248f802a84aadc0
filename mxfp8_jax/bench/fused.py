"""Fused all-gather + RMSNorm + MXFP8: p2p vs xla vs the unfused pure-JAX version.

    python -m mxfp8_jax.bench.fused [--rows 8,32,128,1024,8192 --hidden 6144 --json out.json]

On the simulated CPU devices of one process (8 by default), for each gathered row count R:

- p2p:     ``allgather_rmsnorm_quant(strategy="p2p")``, one in-process custom call per device;
- xla:     ``strategy="xla"``, ``lax.all_gather`` then the local fused RMSNorm+quantize kernel;
- unfused: ``lax.all_gather`` + plain jnp RMSNorm + the pure-JAX ``mx.quantize``.

All three must give the outputs the op promises (p2p and xla byte for byte equal) before they
are timed, and the compiled programs are checked to run the path named (no silent fallback).
The floor is the time the bytes every device must hold (normed, quant, scales and residual for
each of the n devices, plus reading the input once) take at the copy bandwidth measured in the
same run.
"""

from __future__ import annotations

import argparse
import os


def _setup_devices(n: int) -> None:
    """Simulated CPU devices must be requested before jax starts its backends."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def _copy_bandwidth(nbytes: int = 128 << 20, repeats: int = 5) -> float:
    """Bytes/s (read + write) of a memcpy between buffers already touched: best of a few."""
    import time

    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def run(
    rows=(8, 32, 128, 1024, 8192),
    hidden: int = 6144,
    devices: int = 8,
    min_time: float = 1.0,
    json_path: str | None = None,
) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import mxfp8_jax as mx
    from mxfp8_jax._src.core.spmd import shard_map as _shard_map
    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax.bench._timing import environment, print_table, time_fn, write_json

    for target in ("mxfp8_rmsnorm_quantize", "mxfp8_allgather_rmsnorm_quantize"):
        _ffi.require(target, "cpu")  # never benchmark a fallback under the kernel's name
    devs = jax.devices("cpu")
    if len(devs) < devices:
        raise RuntimeError(f"need {devices} CPU devices, jax has {len(devs)}")
    mesh = Mesh(np.array(devs[:devices]), ("x",))
    n, h, eps = devices, hidden, 1e-6

    def fused(strategy):
        return jax.jit(lambda x, g: mx.allgather_rmsnorm_quant(x, g, mesh=mesh, axis="x", eps=eps, strategy=strategy))

    def unfused_local(xl, g):
        xg = jax.lax.all_gather(xl, "x", tiled=True)
        xf = xg.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        normed = (xf * inv * g.astype(jnp.float32)).astype(jnp.bfloat16)
        t = mx.quantize(normed, rowwise=True, columnwise=False, backend="jax")
        return normed, t.rowwise_data, t.rowwise_scale, xg

    unfused = jax.jit(_shard_map(unfused_local, mesh, (P("x"), P()), (P(),) * 4))
    paths = {"p2p": fused("p2p"), "xla": fused("xla"), "unfused": unfused}

    copy_bw = _copy_bandwidth()

    key = jax.random.key(0)
    table, results = [], []
    for r in rows:
        if r % n:
            raise ValueError(f"--rows {r} must be a multiple of the {n} devices")
        x = (jax.random.normal(key, (r, h), jnp.float32) * 2).astype(jnp.bfloat16)
        g = (jax.random.normal(jax.random.key(1), (h,), jnp.float32) * 0.5 + 1).astype(jnp.bfloat16)
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x")))
        hlo = {p: f.lower(x, g).as_text() for p, f in paths.items()}
        if "mxfp8_allgather_rmsnorm_quantize" not in hlo["p2p"] or "all_gather" in hlo["p2p"]:
            raise AssertionError("the p2p program does not run the p2p kernel")
        if "mxfp8_rmsnorm_quantize" not in hlo["xla"] or "all_gather" not in hlo["xla"]:
            raise AssertionError("the xla program does not run all_gather + the fused kernel")
        outs = {p: f(x, g) for p, f in paths.items()}
        for a, b in zip(outs["p2p"], outs["xla"]):
            if not np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
                raise AssertionError("p2p and xla disagree; refusing to benchmark")
        if not np.array_equal(np.asarray(outs["unfused"][3]).view(np.uint8), np.asarray(x).view(np.uint8)):
            raise AssertionError("the unfused residual is not the gathered input")
        del outs
        t = {p: time_fn(f, x, g, warmup=1, iters=3, min_time=min_time) for p, f in paths.items()}
        moved = n * r * h * (2 + 1 + 2) + n * r * (h // 32) + r * h * 2
        floor = moved / copy_bw
        table.append(
            (
                r,
                f"{t['p2p'] * 1e3:.3f}",
                f"{t['xla'] * 1e3:.3f}",
                f"{t['unfused'] * 1e3:.3f}",
                f"{t['unfused'] / t['p2p']:.2f}",
                f"{t['unfused'] / t['xla']:.2f}",
                f"{t['xla'] / t['p2p']:.2f}",
                f"{floor * 1e3:.3f}",
                f"{floor / t['p2p']:.2f}",
            )
        )
        results.append(
            {
                "rows": r,
                "p2p_s": t["p2p"],
                "xla_s": t["xla"],
                "unfused_s": t["unfused"],
                "floor_s": floor,
                "bytes": moved,
            }
        )
    from rich.console import Console

    print_table(
        f"all-gather + RMSNorm + MXFP8, {n} CPU devices, H={h} (copy {copy_bw / 1e9:.1f} GB/s)",
        ["rows R", "p2p ms", "xla ms", "unfused ms", "unfused/p2p", "unfused/xla", "xla/p2p", "floor ms", "floor/p2p"],
        table,
        console=Console(width=160),
    )
    payload = {
        "bench": "fused",
        "hidden": h,
        "devices": n,
        "copy_GBps": copy_bw / 1e9,
        "results": results,
        "env": environment(),
    }
    write_json(json_path, payload)
    return payload


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows", default="8,32,128,1024,8192", help="gathered row counts R, comma-separated (multiples of --devices)"
    )
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per point")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    from mxfp8_jax.bench._timing import add_fresh_pages_flag, reuse_freed_memory

    add_fresh_pages_flag(p)
    a = p.parse_args(argv)
    reuse_freed_memory(not a.fresh_pages)
    _setup_devices(a.devices)
    run(tuple(int(v) for v in a.rows.split(",")), a.hidden, a.devices, a.min_time, a.json)


if __name__ == "__main__":
    main()
