"""The ``mxfp8-jax`` command.

mxfp8-jax demo [--steps N --devices N --hidden N --seed N --json [PATH]]
mxfp8-jax demo --processes P [--devices N] [...]   P local processes on 127.0.0.1, N devices in all
mxfp8-jax info
mxfp8-jax bench NAME [ARGS...]     runs mxfp8_jax.bench.NAME's main(ARGS)
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        prog="mxfp8-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small Flax model with MXFP8 FSDP vs a bf16 baseline", add_help=False)
    sub.add_parser("info", help="versions, devices and the available kernel backends")
    b = sub.add_parser("bench", help="run a benchmark: mxfp8-jax bench NAME [ARGS...]", add_help=False)
    b.add_argument("name", nargs="?")
    args, rest = p.parse_known_args(argv)
    if args.command == "demo":
        if any(a == "--processes" or a.startswith("--processes=") for a in rest):
            from mxfp8_jax._src import launch  # N local processes of one jax.distributed job

            return launch.run_demo(rest)
        from mxfp8_jax import demo  # parses its own flags; sets up devices before jax starts

        return demo.main(rest)
    if args.command == "info":
        if rest:
            p.error(f"info takes no arguments, got {rest}")
        return info()
    if args.name in (None, "-h", "--help"):
        print(f"usage: mxfp8-jax bench NAME [ARGS...]\navailable: {', '.join(bench_names())}")
        return 0 if args.name else 2
    return bench(args.name, rest)


if __name__ == "__main__":
    sys.exit(main())
