"""``mxfp8-jax bench``: every benchmark in one run, one table per case, one JSON file.

    mxfp8-jax bench [--quick] [--json PATH] [--only CASE ...] [--fresh-pages]

Cases (each calls its benchmark module's own measuring function, so the tables here and
``python -m mxfp8_jax.bench.NAME`` measure the same thing):

- ``quantize``: ``bench.quantize.run``: rowwise / columnwise / both planes, bf16 and fp32 input,
  4096x4096 and 8192x8192; the FFI kernel against XLA's compilation of the pure-JAX reference.
- ``dbuffer``: ``bench.dbuffer.run``: the packed-segment quantize of one transformer block's
  weights in a ``QuantizedDBuffer`` on 8 devices; FFI vs the packed and the per-tensor pure-JAX
  quantize.
- ``fused``: ``bench.fused.run``: all-gather + RMSNorm + MXFP8, strategies ``p2p`` and ``xla``
  against the unfused pure-JAX path, rows 8..8192, H 4096 and 6144, 8 devices.
- ``fsdp``: ``bench.fsdp.run``: a training step of a deep residual stack with MXFP8 FSDP, bf16
  FSDP, XLA's own FSDP (GSPMD) and unsharded data parallelism: step time and per-device memory.

Every time is a median after warm-up (device-synchronised). GB/s counts the bytes a path must
read and write. The copy floor is the time ``numpy.copyto`` takes to move the same bytes between
preallocated buffers, measured in this run (``_timing.memcpy_seconds``). ``--quick`` runs every
case at small sizes (a smoke test; its numbers say little). A case whose kernel is not built
for the platform is reported as such in its table and in the JSON, never measured on a fallback;
the command then exits with status 1.

On a GPU host the quantize, dbuffer and fsdp cases measure the GPUs (up to 8); the fused case
measures 8 CPU devices. ``mxfp8-jax bench NAME [ARGS...]`` runs one module with its own flags.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from collections.abc import Callable

CASES = ("quantize", "dbuffer", "fused", "fsdp")
DEVICES = 8  # simulated CPU devices of the multi-device cases


def _mesh_size() -> int:
    """Devices of the dbuffer and fsdp meshes: 8 simulated CPU devices, or up to 8 accelerators."""
    import jax

    return DEVICES if jax.default_backend() == "cpu" else min(DEVICES, len(jax.devices()))


@contextlib.contextmanager
def _quiet():
    """The modules print their own tables; here they are folded into one table per case."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _ms(s):
    return "-" if s is None else f"{s * 1e3:.3f}"


def _ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


# ------------------------------------------------------------------------------------------------
# The cases: each is a list of points; a point is a callable returning one record (a dict)


def _quantize_points(quick: bool):
    from mxfp8_jax.bench import quantize

    sizes = ((256, 256),) if quick else ((4096, 4096), (8192, 8192))
    iters = 3 if quick else 10
    points = []
    for m, k in sizes:
        for dtype in ("bfloat16", "float32"):
            for planes, row, col in (("rowwise", True, False), ("columnwise", False, True), ("both", True, True)):

                def point(m=m, k=k, dtype=dtype, planes=planes, row=row, col=col):
                    r = quantize.run(m, k, dtype, row, col, iters)
                    return {
                        "size": f"{m}x{k}",
                        "dtype": dtype,
                        "planes": planes,
                        "isa": r["isa"],
                        "bytes": r["bytes_moved"],
                        "kernel_s": r["kernel_s"],
                        "xla_s": r["reference_s"],
                    }

                points.append((f"quantize {m}x{k} {dtype} {planes}", point))
    return points


def _quantize_table(records):
    rows = [
        (
            r["size"],
            r["dtype"],
            r["planes"],
            f"{r['bytes'] / 2**20:.1f}",
            _ms(r["kernel_s"]),
            _ms(r["xla_s"]),
            f"{r['kernel_GBps']:.2f}",
            f"{r['xla_GBps']:.2f}",
            _ratio(r["xla_s"], r["kernel_s"]),
            f"{r['floor_fraction']:.2f}",
        )
        for r in records
    ]
    isa = records[0].get("isa") if records else None
    return (
        f"quantize (FFI kernel{', ' + isa if isa else ''}) vs XLA-compiled pure-JAX reference",
        [
            "size",
            "input",
            "planes",
            "MiB moved",
            "kernel ms",
            "XLA ms",
            "kernel GB/s",
            "XLA GB/s",
            "XLA/kernel",
            "floor/kernel",
        ],
        rows,
    )


def _dbuffer_points(quick: bool):
    from mxfp8_jax.bench import dbuffer

    hidden, mlp, iters = (256, 1024, 2) if quick else (2048, 8192, 5)
    n = _mesh_size()

    def point():
        r = dbuffer.run(hidden, mlp, n, "float32", "padded", iters)
        q = r["quantize_s"]
        return {
            "hidden": hidden,
            "mlp": mlp,
            "devices": n,
            "weights": r["numel"],
            "padding_overhead": r["padding_overhead"],
            "bytes": r["bytes_moved"],
            "kernel_s": q["packed_ffi"],
            "xla_s": q["per_tensor_jax"],
            "packed_jax_s": q["packed_jax"],
            "rowwise_gather_vs_bf16": r["rowwise_vs_bf16"],
        }

    return [(f"dbuffer block h={hidden} mlp={mlp}", point)]


def _dbuffer_table(records):
    rows = [
        (
            f"h={r['hidden']}, mlp={r['mlp']}",
            f"{r['weights'] / 1e6:.2f} M",
            f"{r['bytes'] / 2**20:.1f}",
            _ms(r["kernel_s"]),
            _ms(r["packed_jax_s"]),
            _ms(r["xla_s"]),
            f"{r['kernel_GBps']:.2f}",
            _ratio(r["xla_s"], r["kernel_s"]),
            f"{r['floor_fraction']:.2f}",
            f"{r['rowwise_gather_vs_bf16']:.4f}",
        )
        for r in records
    ]
    return (
        f"packed-buffer quantize of one transformer block (QKV, out, up, down; fp32 master), "
        f"{records[0]['devices'] if records else '?'} devices",
        [
            "block",
            "weights",
            "MiB moved",
            "FFI ms",
            "packed JAX ms",
            "per-tensor XLA ms",
            "FFI GB/s",
            "XLA/FFI",
            "floor/FFI",
            "fwd gather / bf16",
        ],
        rows,
    )


def _fused_points(quick: bool):
    from mxfp8_jax.bench import fused

    hiddens, rows, min_time = ((4096,), (8, 64), 0.02) if quick else ((4096, 6144), (8, 32, 128, 1024, 8192), 1.0)
    points = []
    for h in hiddens:
        for r in rows:

            def point(h=h, r=r):
                res = fused.run((r,), h, DEVICES, min_time)["results"][0]
                return {
                    "rows": r,
                    "hidden": h,
                    "devices": DEVICES,
                    "bytes": res["bytes"],
                    "kernel_s": res["p2p_s"],  # the fused custom call
                    "xla_strategy_s": res["xla_s"],  # lax.all_gather + the local fused kernel
                    "xla_s": res["unfused_s"],  # all_gather + jnp RMSNorm + pure-JAX quantize
                }

            points.append((f"fused H={h} rows={r}", point))
    return points


def _fused_table(records):
    rows = [
        (
            r["hidden"],
            r["rows"],
            f"{r['bytes'] / 2**20:.2f}",
            _ms(r["kernel_s"]),
            _ms(r["xla_strategy_s"]),
            _ms(r["xla_s"]),
            _ratio(r["xla_s"], r["kernel_s"]),
            _ratio(r["xla_s"], r["xla_strategy_s"]),
            _ms(r["floor_s"]),
            f"{r['floor_fraction']:.2f}",
        )
        for r in records
    ]
    return (
        f"all-gather + RMSNorm + MXFP8 quantize, {DEVICES} CPU devices: strategies vs unfused pure JAX",
        [
            "H",
            "rows",
            "MiB moved",
            "p2p ms",
            "xla ms",
            "unfused ms",
            "unfused/p2p",
            "unfused/xla",
            "floor ms",
            "floor/p2p",
        ],
        rows,
    )


def _fsdp_points(quick: bool):
    from mxfp8_jax.bench import fsdp

    # Full: step times up to depth 16; depth 64 compiled only (memory and bytes gathered), since
    # its unsharded variant alone would hold several GiB of simulated devices on a small host.
    plan = [(2, True)] if quick else [(4, True), (16, True), (64, False)]
    width, iters = (256, 1) if quick else (1024, 3)  # 256 rows: whole 32-row blocks on 8 devices
    n = _mesh_size()
    points = []
    for depth, timed in plan:
        for v in fsdp.VARIANTS:

            def point(v=v, depth=depth, timed=timed):
                r = fsdp.run((depth,), width, n, iters, timed, (v,), progress=False)["results"][0]
                return {
                    "variant": v,
                    "depth": depth,
                    "width": width,
                    "devices": n,
                    "model_fp32_bytes": r["model_fp32_bytes"],
                    "argument_bytes": r["argument_bytes"],
                    "temp_bytes": r["temp_bytes"],
                    "all_gather_bytes": r["all_gather_bytes"],
                    "reduced_bytes": r["reduce_scatter_bytes"] + r["all_reduce_bytes"],
                    "step_s": r["step_s"],
                    "compile_s": r["compile_s"],
                }

            points.append((f"fsdp {v} depth {depth}", point))
    return points


def _fsdp_table(records):
    by = {(r["variant"], r["depth"]): r for r in records}
    rows = []
    for r in records:
        xla = by.get(("gspmd", r["depth"]))
        rows.append(
            (
                r["variant"],
                r["depth"],
                f"{r['model_fp32_bytes'] / 2**20:.2f}",
                f"{(r['argument_bytes'] + r['temp_bytes']) / r['model_fp32_bytes']:.3f}",
                f"{r['temp_bytes'] / r['model_fp32_bytes']:.3f}",
                f"{r['all_gather_bytes'] / 2**20:.2f}",
                f"{r['reduced_bytes'] / 2**20:.2f}",
                _ms(r["step_s"]),
                _ratio(r["step_s"], xla and xla["step_s"]),
                _ratio(r["temp_bytes"], xla and xla["temp_bytes"]),
            )
        )
    width = records[0]["width"] if records else "?"
    n = records[0]["devices"] if records else "?"
    return (
        f"FSDP training step, {width}x{width} residual layers, {n} devices, adam (per device; "
        f"gspmd = XLA's own FSDP, dp = unsharded)",
        [
            "variant",
            "depth",
            "model MiB",
            "(args+temp)/model",
            "temp/model",
            "gathered MiB",
            "reduced MiB",
            "step ms",
            "step / gspmd",
            "temp / gspmd",
        ],
        rows,
    )


_CASES: dict[str, tuple[Callable, Callable]] = {
    "quantize": (_quantize_points, _quantize_table),
    "dbuffer": (_dbuffer_points, _dbuffer_table),
    "fused": (_fused_points, _fused_table),
    "fsdp": (_fsdp_points, _fsdp_table),
}


def _with_floor(record: dict) -> dict:
    """GB/s of the kernel and XLA paths, and the memcpy floor of the same bytes (this run)."""
    if "bytes" in record:
        from mxfp8_jax.bench._timing import memcpy_seconds

        floor = memcpy_seconds(record["bytes"])
        record["floor_s"] = floor
        record["floor_fraction"] = floor / record["kernel_s"]
        record["kernel_GBps"] = record["bytes"] / record["kernel_s"] / 1e9
        record["xla_GBps"] = record["bytes"] / record["xla_s"] / 1e9
        record["speedup_vs_xla"] = record["xla_s"] / record["kernel_s"]
    return record


# ------------------------------------------------------------------------------------------------


def run(cases=CASES, *, quick: bool = False, json_path: str | None = None, console=None) -> dict:
    """Runs the ``cases``, prints one table per case, writes the JSON; returns the payload."""
    import jax
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax.bench._timing import cpu_model, environment, memcpy_seconds, print_table, write_json

    console = console or Console(width=max(160, Console().width))
    plans = {name: _CASES[name][0](quick) for name in cases}
    payload = {
        "command": "mxfp8-jax bench" + (" --quick" if quick else ""),
        "quick": quick,
        "environment": {
            **environment(),
            "cpu": cpu_model(),
            "kernel_backends": list(_ffi.available_backends()),
            "memcpy_GBps_128MiB": 2 * (128 << 20) / memcpy_seconds(2 * (128 << 20)) / 1e9,
        },
        "cases": {},
    }
    if jax.default_backend() == "cpu":
        from mxfp8_jax._src.kernels import cpu_isa

        payload["environment"]["cpu_isa"] = cpu_isa.cpu_isa() if _ffi.available_backends() else None
    start = time.perf_counter()
    with Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("mxfp8-jax bench", total=sum(len(p) for p in plans.values()))
        for name, points in plans.items():
            records, failure, t0 = [], None, time.perf_counter()
            for label, point in points:
                bar.update(task, description=label)
                if failure is None:
                    try:
                        with _quiet():
                            records.append(_with_floor(point()))
                    except _ffi.ExtensionMissingError as e:
                        failure = ("kernel missing", str(e))
                bar.advance(task)
            title, header, rows = _CASES[name][1](records)
            if failure is not None:
                rows = [*rows, (f"{failure[0].upper()}: {failure[1]}", *("-",) * (len(header) - 1))]
            print_table(title, header, rows, console)
            payload["cases"][name] = {
                "status": "ok" if failure is None else failure[0],
                "message": None if failure is None else failure[1],
                "title": title,
                "header": header,
                "rows": [list(map(str, r)) for r in rows],
                "results": records,
                "seconds": time.perf_counter() - t0,
            }
    payload["seconds"] = time.perf_counter() - start
    console.print(f"{len(cases)} cases in {payload['seconds']:.0f} s")
    write_json(json_path, payload)
    return payload


def main(argv=None) -> int:
    from mxfp8_jax.bench._timing import add_fresh_pages_flag, reuse_freed_memory

    p = argparse.ArgumentParser(
        prog="mxfp8-jax bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="every case at small sizes (a smoke test, under 2 minutes)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every case's results here")
    p.add_argument("--only", nargs="+", choices=CASES, metavar="CASE", help=f"run only these cases: {', '.join(CASES)}")
    add_fresh_pages_flag(p)
    a = p.parse_args(argv)
    reuse_freed_memory(not a.fresh_pages)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", DEVICES)  # before the CPU backend starts
    except RuntimeError:  # already running: the cases check the devices they need
        pass
    cases = tuple(c for c in CASES if c in (a.only or CASES))
    payload = run(cases, quick=a.quick, json_path=a.json_path)
    return 0 if all(c["status"] == "ok" for c in payload["cases"].values()) else 1
