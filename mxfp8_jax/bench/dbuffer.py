"""QuantizedDBuffer: local quantize of one transformer block's weights, and bytes gathered per step.

    python -m mxfp8_jax.bench.dbuffer [--hidden 2048 --mlp 8192 --devices 8 --json out.json]

Weights of one block (QKV [3h, h], output [h, h], up [mlp, h], down [h, mlp]) live as fp32 master
shards in one flat buffer over a 1-D mesh (BlockAtomic(32)). Quantize paths, same run, same input:

- packed-segment FFI: ``QuantizedDBuffer.quantize(backend="ffi")``, one kernel call per device
  over its whole local segment, driven by the per-shard descriptor table;
- packed-segment pure JAX: the same descriptor logic in jnp (``backend="jax"``);
- per-tensor pure JAX: each weight as its own row-sharded array, ``mx.quantize(backend="jax")``
  under jit (XLA partitions it; no packing);
- floor: the bytes the kernel must move (master read + planes written) at the bandwidth of a
  sharded copy of the master buffer, measured here.

All paths must produce the same bytes before any is timed. The gather table counts the bytes
of every all-gather in the compiled HLO of each gather, against a bf16 buffer of the same tensors
on the same layout: one MXFP8 plane is (1 + 1/32) / 2 of it.
"""

from __future__ import annotations

import argparse

from mxfp8_jax._src import hlo


def _shapes(hidden: int, mlp: int) -> list[tuple[int, int]]:
    return [(3 * hidden, hidden), (hidden, hidden), (mlp, hidden), (hidden, mlp)]


def gathered_bytes(compiled_text: str) -> tuple[int, set[str]]:
    """Total result bytes of the all-gathers in compiled HLO, and their element types."""
    gathers = [c for c in hlo.collectives(compiled_text) if c.op == "all-gather"]
    return sum(c.bytes_per_step for c in gathers), {d for c in gathers for d in c.dtypes}


def run(
    hidden: int = 2048,
    mlp: int = 8192,
    devices: int = 8,
    dtype: str = "float32",
    shard_layout: str = "padded",
    iters: int = 5,
    json_path: str | None = None,
) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mxfp8_jax as mx
    from mxfp8_jax._src import _ffi
    from mxfp8_jax.bench._timing import environment, print_table, time_fn, write_json

    platform = jax.default_backend()
    _ffi.require("mxfp8_quantize_segments", platform)  # never silently benchmark a fallback
    devs = jax.devices()
    if len(devs) < devices:
        raise SystemExit(f"--devices {devices}: only {len(devs)} {platform} devices are visible")
    mesh = jax.make_mesh((devices,), ("fsdp",), devices=devs[:devices])
    placements = (mx.BlockAtomic(32),)
    shapes = _shapes(hidden, mlp)
    layout_kind = mx.ShardLayout(shard_layout)
    q = mx.QuantizedDBuffer.empty(mesh, placements, shapes, shard_layout=layout_kind)
    keys = jax.random.split(jax.random.key(0), len(shapes))
    tensors = [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype) for k, s in zip(keys, shapes)]
    master = mx.DBuffer.distribute_tensors(tensors, mesh, placements, layout=q.layout)
    numel = sum(m * k for m, k in shapes)

    # -- quantize paths -------------------------------------------------------------------------
    packed_ffi = jax.jit(lambda q, w: q.quantize(w, backend="ffi"))
    packed_jax = jax.jit(lambda q, w: q.quantize(w, backend="jax"))
    row_sharded = NamedSharding(mesh, P("fsdp", None))
    sharded_tensors = [jax.device_put(t, row_sharded) for t in tensors]
    per_tensor = jax.jit(lambda ts: [mx.quantize(t, backend="jax") for t in ts])
    copy = jax.jit(lambda x: x + jnp.zeros((), x.dtype))  # a sharded read + write of the master

    a = packed_ffi(q, master)
    b = packed_jax(q, master)
    for pa, pb in zip(a.planes, b.planes):
        if not bool(jnp.array_equal(pa.data, pb.data)):
            raise AssertionError("packed FFI and pure-JAX paths disagree; refusing to benchmark")
    views = jax.jit(lambda f: [f.get_tensor_view(i) for i in range(len(shapes))])(a.allgather())
    for v, ref in zip(views, per_tensor(sharded_tensors)):
        for x, y in zip(jax.tree.leaves(v), jax.tree.leaves(ref)):
            if not bool(
                jnp.array_equal(jax.lax.bitcast_convert_type(x, jnp.uint8), jax.lax.bitcast_convert_type(y, jnp.uint8))
            ):
                raise AssertionError("packed buffer and per-tensor quantize disagree; refusing to benchmark")

    t_ffi = time_fn(packed_ffi, q, master, iters=iters)
    t_jax = time_fn(packed_jax, q, master, iters=max(2, iters // 2))
    t_tensor = time_fn(per_tensor, sharded_tensors, iters=max(2, iters // 2))
    t_copy = time_fn(copy, master.data, iters=iters)
    in_bytes = q.layout.physical_size * jnp.dtype(dtype).itemsize
    out_bytes = 2 * (q.layout.physical_size + q.layout.physical_size // 32)
    copy_bw = 2 * in_bytes / t_copy
    floor = (in_bytes + out_bytes) / copy_bw
    rows = [
        ("packed-segment FFI (1 call/device)", t_ffi),
        ("packed-segment pure JAX", t_jax),
        ("per-tensor pure JAX (sharded, jit)", t_tensor),
        ("bandwidth floor (copy-rate)", floor),
    ]
    print_table(
        f"Quantize one block (h={hidden}, mlp={mlp}; {numel / 1e6:.1f} M weights, {dtype} master), "
        f"{devices} {platform} devices, {layout_kind.value}",
        ["path", "ms", "GB/s moved", "time / FFI"],
        [(n, f"{t * 1e3:.2f}", f"{(in_bytes + out_bytes) / t / 1e9:.2f}", f"{t / t_ffi:.2f}") for n, t in rows],
    )

    # -- bytes gathered per step ----------------------------------------------------------------
    qq = a
    bf16 = mx.DBuffer.distribute_tensors(tensors, mesh, placements, layout=q.layout, dtype=jnp.bfloat16)
    gathers = {
        "bf16 buffer (same layout)": (jax.jit(lambda b: b.allgather()), bf16),
        "MXFP8 rowwise (forward)": (jax.jit(lambda q: q.allgather(rowwise=True, columnwise=False)), qq),
        "MXFP8 columnwise (backward)": (jax.jit(lambda q: q.allgather(rowwise=False, columnwise=True)), qq),
        "MXFP8 both planes": (jax.jit(lambda q: q.allgather()), qq),
    }
    table, measured = [], {}
    for name, (fn, arg) in gathers.items():
        nbytes, types = gathered_bytes(fn.lower(arg).compile().as_text())
        measured[name] = {"bytes": nbytes, "types": sorted(types), "s": time_fn(fn, arg, iters=iters)}
    base = measured["bf16 buffer (same layout)"]["bytes"]
    for name, m in measured.items():
        table.append(
            (
                name,
                f"{m['bytes'] / 2**20:.2f}",
                f"{m['bytes'] / numel:.4f}",
                f"{m['bytes'] / base:.4f}",
                ",".join(m["types"]),
                f"{m['s'] * 1e3:.2f}",
            )
        )
    print_table(
        "All-gather per step (bytes of the gathered result per device, from the compiled HLO)",
        ["gather", "MiB", "bytes/weight", "vs bf16", "HLO types", "ms"],
        table,
    )
    ratio = measured["MXFP8 rowwise (forward)"]["bytes"] / base
    print(
        f"rowwise gathered bytes / bf16 = {ratio:.4f} (expected (1 + 1/32) / 2 = {(1 + 1 / 32) / 2:.4f}); "
        f"padding overhead of the layout: {q.layout.padding_overhead:.4f}"
    )
    result = {
        "bench": "dbuffer",
        "hidden": hidden,
        "mlp": mlp,
        "devices": devices,
        "dtype": dtype,
        "shard_layout": layout_kind.value,
        "numel": numel,
        "physical_size": q.layout.physical_size,
        "padding_overhead": q.layout.padding_overhead,
        "bytes_moved": in_bytes + out_bytes,
        "quantize_s": {
            "packed_ffi": t_ffi,
            "packed_jax": t_jax,
            "per_tensor_jax": t_tensor,
            "bandwidth_floor": floor,
            "copy": t_copy,
        },
        "copy_GBps": copy_bw / 1e9,
        "gathers": measured,
        "rowwise_vs_bf16": ratio,
        "env": environment(),
    }
    write_json(json_path, result)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=8192)
    p.add_argument(
        "--devices", type=int, default=8, help="mesh size; on CPU this many devices are simulated (jax_num_cpu_devices)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="master weights")
    p.add_argument("--shard-layout", default="padded", choices=["padded", "unpadded"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", dest="json_path")
    from mxfp8_jax.bench._timing import add_fresh_pages_flag, reuse_freed_memory

    add_fresh_pages_flag(p)
    a = p.parse_args(argv)
    reuse_freed_memory(not a.fresh_pages)
    import jax

    jax.config.update("jax_num_cpu_devices", a.devices)  # before the CPU backend starts
    run(a.hidden, a.mlp, a.devices, a.dtype, a.shard_layout, a.iters, a.json_path)


if __name__ == "__main__":
    main()
