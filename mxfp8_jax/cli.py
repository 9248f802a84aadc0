"""The ``mxfp8-jax`` command.

mxfp8-jax demo [--steps N --devices N --hidden N --seed N --json [PATH]]
mxfp8-jax demo --processes P [--devices N] [...]   P local processes on 127.0.0.1, N devices in all
mxfp8-jax info
mxfp8-jax layout --shapes 128x64,32x128 --devices 4 [--shard-layout unpadded] [--png out.png]
mxfp8-jax bench [--quick] [--json PATH] [--only CASE ...]   every benchmark, one table per case
mxfp8-jax bench NAME [ARGS...]     runs mxfp8_jax.bench.NAME's main(ARGS) (its own flags)
mxfp8-jax gpu-compile [--gpu h100,b200 --devices 8 --model transformer --variants ...]
                                   a training step compiled for a GPU cluster on this host
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def bench_names() -> list[str]:
    """The benchmark modules in ``mxfp8_jax.bench`` (those not starting with ``_``)."""
    import mxfp8_jax.bench as bench

    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def info() -> int:
    import jax
    import jaxlib

    import mxfp8_jax as mx

    print(f"mxfp8_jax {mx.__version__}")
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    try:
        import flax

        print(f"flax {flax.__version__}")
    except ImportError:  # pragma: no cover - flax is a dependency
        print("flax not installed")
    print(f"default backend: {jax.default_backend()}")
    devices = jax.devices()
    print(f"devices ({len(devices)}): {', '.join(str(d) for d in devices)}")
    backends = mx.available_backends()
    kernels = ", ".join(backends) if backends else "none (extension not built; pure-JAX paths only)"
    print(f"mxfp8 kernel backends: {kernels}")
    print(f"benchmarks: {', '.join(bench_names())}")
    return 0


def bench(name: str, argv: list[str]) -> int:
    names = bench_names()
    if name not in names:
        raise SystemExit(f"mxfp8-jax bench: unknown benchmark {name!r}; available: {', '.join(names)}")
    module = importlib.import_module(f"mxfp8_jax.bench.{name}")
    result = module.main(argv)
    return result if isinstance(result, int) else 0


def layout(argv: list[str]) -> int:
    """Prints (and with --png draws) who owns which rows of an MXFP8 QuantizedDBuffer's planes."""
    from mxfp8_jax import viz

    p = argparse.ArgumentParser(
        prog="mxfp8-jax layout",
        description="Which device owns which rows of which tensor in an MXFP8 QuantizedDBuffer on a 1-D "
        "mesh (BlockAtomic(32)): the data planes and both scale planes, with their padding.",
    )
    p.add_argument("--shapes", required=True, help="tensors as MxK, comma-separated, e.g. 128x64,32x128")
    p.add_argument("--devices", type=int, required=True, help="devices of the mesh (segments of the layout)")
    p.add_argument("--shard-layout", default="padded", choices=["padded", "unpadded"])
    p.add_argument("--png", metavar="PATH", help="also draw the three planes into this PNG (needs matplotlib)")
    a = p.parse_args(argv)
    try:
        layouts = viz.planes(viz.parse_shapes(a.shapes), a.devices, a.shard_layout)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    print(viz.format_planes(layouts))
    if a.png:
        try:
            import matplotlib
        except ImportError:
            print(
                "mxfp8-jax layout --png: matplotlib is not installed; it is the [viz] extra: "
                "pip install 'mxfp8-jax[viz]'",
                file=sys.stderr,
            )
            return 1
        matplotlib.use("Agg")
        fig = viz.draw_planes(layouts)
        fig.savefig(a.png, dpi=100)
        print(f"wrote {a.png}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        prog="mxfp8-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small Flax model with MXFP8 FSDP vs a bf16 baseline", add_help=False)
    sub.add_parser("info", help="versions, devices and the available kernel backends")
    sub.add_parser(
        "gpu-compile",
        help="compile a training step for a GPU cluster without one: memory, collectives, schedule",
        add_help=False,
    )
    sub.add_parser("layout", help="print or draw which device owns which rows of an MXFP8 buffer", add_help=False)
    sub.add_parser(
        "bench",
        help="every benchmark in one run (--quick, --json, --only), or one: bench NAME [ARGS...]",
        add_help=False,
    )
    args, rest = p.parse_known_args(argv)
    if args.command == "demo":
        from mxfp8_jax import demo  # parses its own flags; sets up devices before jax starts

        if any(a == "--processes" or a.startswith("--processes=") for a in rest):
            return demo.run_in_processes(rest)  # N local processes of one jax.distributed job
        return demo.main(rest)
    if args.command == "gpu-compile":
        from mxfp8_jax import gpu_compile  # sets up compile-only GPUs before jax starts

        return gpu_compile.main(rest)
    if args.command == "info":
        if rest:
            p.error(f"info takes no arguments, got {rest}")
        return info()
    if args.command == "layout":
        return layout(rest)
    # `bench NAME [ARGS...]` runs one module with its own flags; anything else is the suite's flags
    rest = argv[argv.index("bench") + 1 :]
    if rest and not rest[0].startswith("-"):
        return bench(rest[0], rest[1:])
    from mxfp8_jax.bench import _suite

    return _suite.main(rest)


if __name__ == "__main__":
    sys.exit(main())
