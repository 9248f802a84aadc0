"""QuantizedDBuffer: local quantize of one transformer block's weights, and bytes gathered per step.

    python -m mxfp8_jax.bench.dbuffer [--hidden 2048 --mlp 8192 --devices 8 --isa avx2 --repeats 3
                                       --json out.json]

Weights of one block (QKV [3h, h], output [h, h], up [mlp, h], down [h, mlp]) live as fp32 master
shards in one flat buffer over a 1-D mesh (BlockAtomic(32)). Quantize paths, same run, same input:

- packed-segment FFI: ``QuantizedDBuffer.quantize(backend="ffi")``, one kernel call per device
  over its whole local segment, driven by the per-shard descriptor table;
- packed-segment pure JAX: the same descriptor logic in jnp (``backend="jax"``);
- per-tensor pure JAX: each weight as its own row-sharded array, ``mx.quantize(backend="jax")``
  under jit (XLA partitions it; no packing);
- floor: the bytes the kernel must move (master read + planes written) at the rate of a real
  memcpy between two preallocated host buffers (at least 64 MiB), measured in the same process
  and timed alternately with the FFI path (``--repeats`` rounds; the ratio is given per round).
  A jitted XLA copy is no floor: XLA:CPU's elementwise loops run below memory speed.

All paths must produce the same bytes before any is timed. The gather table counts the bytes
of every all-gather in the compiled HLO of each gather, against a bf16 buffer of the same tensors
on the same layout: one MXFP8 plane is (1 + 1/32) / 2 of it.
"""

from __future__ import annotations

import argparse

from mxfp8_jax._src.compiled import hlo


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
    isa: str | None = None,
    repeats: int = 3,
    others: bool = True,
) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mxfp8_jax as mx
    from mxfp8_jax._src.core import platforms
    from mxfp8_jax._src.kernels import _ffi, cpu_isa
    from mxfp8_jax.bench._timing import Memcpy, environment, interleaved_ratios, print_table, time_fn, write_json

    platform = platforms.default()  # "cuda" / "rocm", as the extension names them
    _ffi.require("mxfp8_quantize_segments", platform)  # never silently benchmark a fallback
    if isa is not None:
        if platform != "cpu":
            raise ValueError(f"isa={isa!r} selects a CPU instruction set; the default backend is {platform!r}")
        cpu_isa.set_cpu_isa(isa)
    isa = cpu_isa.cpu_isa() if platform == "cpu" else None
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

    in_bytes = q.layout.physical_size * jnp.dtype(dtype).itemsize
    out_bytes = 2 * (q.layout.physical_size + q.layout.physical_size // 32)
    moved = in_bytes + out_bytes
    memcpy = Memcpy(max(64 << 20, in_bytes // devices))
    t_ffi, copy_bw, ratios = interleaved_ratios(packed_ffi, (q, master), moved, memcpy, repeats, iters)
    nan = float("nan")
    t_jax = time_fn(packed_jax, q, master, iters=max(2, iters // 2)) if others else nan
    t_tensor = time_fn(per_tensor, sharded_tensors, iters=max(2, iters // 2)) if others else nan
    floor = moved / copy_bw
    ratio = ratios[len(ratios) // 2]
    rows = [
        ("packed-segment FFI (1 call/device)", t_ffi),
        ("packed-segment pure JAX", t_jax),
        ("per-tensor pure JAX (sharded, jit)", t_tensor),
        (f"floor: memcpy rate ({memcpy.nbytes >> 20} MiB buffers)", floor),
    ]
    print_table(
        f"Quantize one block (h={hidden}, mlp={mlp}; {numel / 1e6:.1f} M weights, {dtype} master), "
        f"{devices} {platform} devices, {layout_kind.value}{', ' + isa if isa else ''}; "
        f"FFI rate / memcpy rate {ratio:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}, {len(ratios)} rounds)",
        ["path", "ms", "GB/s moved", "time / FFI"],
        [(n, f"{t * 1e3:.2f}", f"{moved / t / 1e9:.2f}", f"{t / t_ffi:.2f}") for n, t in rows],
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
        seconds = time_fn(fn, arg, iters=iters) if others else nan
        measured[name] = {"bytes": nbytes, "types": sorted(types), "s": seconds}
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
        },
        "isa": isa,
        "memcpy_GBps": copy_bw / 1e9,
        "ffi_fraction_of_memcpy": ratio,
        "ffi_fraction_of_memcpy_rounds": ratios,
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
    p.add_argument("--repeats", type=int, default=3, help="rounds of memcpy / FFI timing, alternating")
    p.add_argument(
        "--isa",
        choices=["baseline", "avx2", "avx512"],
        help="CPU instruction set of the kernel (default: the best this CPU has)",
    )
    p.add_argument(
        "--ffi-only",
        action="store_true",
        help="time only the FFI quantize (and the memcpy floor); gathers are counted, not timed",
    )
    p.add_argument("--json", dest="json_path")
    from mxfp8_jax.bench._timing import add_fresh_pages_flag, reuse_freed_memory

    add_fresh_pages_flag(p)
    a = p.parse_args(argv)
    reuse_freed_memory(not a.fresh_pages)
    import jax

    jax.config.update("jax_num_cpu_devices", a.devices)  # before the CPU backend starts
    run(a.hidden, a.mlp, a.devices, a.dtype, a.shard_layout, a.iters, a.json_path, a.isa, a.repeats, not a.ffi_only)


if __name__ == "__main__":
    main()
