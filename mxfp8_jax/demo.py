"""``mxfp8-jax demo``: a small Flax model trained with MXFP8 FSDP, against a bf16 baseline.

``--model transformer`` (the default): a Llama-style decoder LM (``mxfp8_jax.models``: RoPE
attention, SwiGLU MLP, blocks stacked with ``nnx.vmap`` and run with ``nnx.scan`` under
``nnx.remat``) learns a synthetic sequence task, ``x[t+1] = perm[x[t-1]]`` for a fixed random
permutation. ``--model mlp``: a residual MLP classifies points labelled by a fixed random
"teacher" network.

Each model is trained twice, identically (same initial weights, batches and optimizer), once
with MXFP8 FSDP weights and once with bf16 FSDP weights, on every local device (8 simulated CPU
devices when there is no accelerator). FSDP traces the loss on the first batch to find its units
(every parameter a GEMM contracts or a lookup reads): MXFP8 for the projections, bf16 for the
embedding and the output head in both runs. The table shows the losses and what each step
communicates, read from the compiled HLO of the step (collectives inside the scanned layers
count once per layer): MXFP8 units gather each weight as 8-bit codes plus one scale byte per 32
(8.25 bits), bf16 units as 16 bits, in the forward, the backward and the recomputation alike.
MXFP8 units are stored in whole 32-row blocks on every device: a projection with fewer than 32
rows per device is padded (at ``--hidden 128`` on 8 devices, half of q/k/v/o and down's rows;
the default ``--hidden 256`` fills every block).

``--data text`` trains the transformer on real text instead: byte-level language modelling of a
fixed, hash-checked list of the Python standard library's own sources (``models.TextTask``; no
download), and reports the loss on held-out files. ``--gemm mxfp8`` runs the MXFP8 run's GEMMs in
MXFP8 too (``FSDP(gemm="mxfp8")``: forward, dgrad and wgrad on E4M3 operands, the weights' the
gathered planes; a native block-scaled GEMM on CUDA and ROCm, the exact path on CPUs).

``--tp 2`` runs the transformer sequence- and tensor-parallel on a ``(devices/2, 2)`` mesh:
each block's norms are the fused all-gather + RMSNorm + MXFP8 quantize over the tp axis,
feeding column-parallel q/k/v and gate/up GEMMs; the row-parallel o and down GEMMs end in a
reduce-scatter back to sequence shards (``--norm-path unfused``: ``lax.all_gather`` + the local
RMSNorm + quantize instead). ``--tp 1`` (default) is FSDP alone.

    mxfp8-jax demo [--model transformer|mlp] [--steps 100] [--devices 8] [--hidden 256]
                   [--layers 2] [--seed 0] [--tp 1] [--norm-path fused|unfused]
                   [--data permutation|text] [--gemm dequantized|mxfp8] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mxfp8_jax.training import DATA, MODELS, Workload, configure_devices, progress_bar, select_devices, train


def run(
    steps: int = 100,
    devices: int | None = None,
    hidden: int = 256,
    seed: int = 0,
    show_progress: bool = True,
    console=None,
    model: str = "transformer",
    layers: int = 2,
    tp: int = 1,
    norm_path: str = "fused",
    data: str = "permutation",
    gemm: str = "dequantized",
) -> dict:
    """Both runs on ``devices`` local devices (default all); returns the report dict."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import mxfp8_jax as mx
    from mxfp8_jax._src.core import checks, platforms
    from mxfp8_jax._src.kernels import _ffi

    steps = checks.positive_int(steps, "steps")
    if not isinstance(hidden, int) or hidden < 32 or hidden % 32:
        raise ValueError(f"hidden={hidden!r} must be a positive multiple of 32 (MXFP8 blocks are 32 wide)")
    layers = checks.positive_int(layers, "layers")
    if model not in MODELS:
        raise ValueError(f"model={model!r} must be one of {MODELS}")
    devs = select_devices(devices)
    tp = checks.positive_int(tp, "tp")
    if len(devs) % tp:
        raise ValueError(f"tp={tp} must divide the {len(devs)} devices")
    if tp > 1:
        mesh = Mesh(np.array(devs).reshape(len(devs) // tp, tp), ("fsdp", "tp"))
    else:
        mesh = Mesh(np.array(devs), ("data",))
    platform = platforms.of_device(devs[0])  # 'cuda'/'rocm', not jax's 'gpu'
    if gemm not in ("dequantized", "mxfp8"):
        raise ValueError(f"gemm={gemm!r} must be 'dequantized' or 'mxfp8'")
    work = Workload(model, hidden=hidden, layers=layers, seed=seed, steps=steps, tp=tp, norm_path=norm_path, data=data)
    report = {
        "model": model,
        "description": work.describe,
        "steps": steps,
        "hidden": hidden,
        "layers": layers,
        "seed": seed,
        "devices": len(devs),
        "mesh": dict(mesh.shape),
        "tp": tp,
        "norm_path": norm_path if tp > 1 else None,
        "data": data,
        "gemm": gemm,
        "platform": platform,
        "batch": work.per_device_batch * (len(devs) // tp),
        "mxfp8_jax": mx.__version__,
        "jax": jax.__version__,
        "quantize_path": "ffi" if _ffi.has_target("mxfp8_quantize", platform) else "pure-JAX reference",
        "runs": {},
    }
    progress = progress_bar(console) if show_progress else None
    try:
        for precision in ("mxfp8", "bf16"):
            mode = gemm if precision == "mxfp8" else "dequantized"
            label = "mxfp8 gemm" if mode == "mxfp8" else precision
            report["runs"][precision] = train(work, precision, mesh=mesh, progress=progress, gemm=mode, label=label)
    finally:
        if progress is not None:
            progress.stop()
    m, b = report["runs"]["mxfp8"], report["runs"]["bf16"]
    report["weight_gather_ratio"] = m["weight_all_gather_bytes"] / b["weight_all_gather_bytes"]
    report["final_loss_difference"] = m["final_loss"] - b["final_loss"]
    if m["validation_loss"] is not None:
        report["validation_loss_difference"] = m["validation_loss"] - b["validation_loss"]
    return report


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = report["runs"]["mxfp8"]
    console.print(
        f"[bold]MXFP8 FSDP demo[/]: {report['description']}; {m['mxfp8_units']} MXFP8 units and "
        f"{m['bf16_units']} bf16 units ({m['eligible_elements']:,} weights) + {m['plain_elements']:,} other "
        f"params (fp32); {report['devices']} {report['platform']} devices, batch {report['batch']}, "
        f"{report['steps']} steps, quantize: {report['quantize_path']}"
        + ("; the mxfp8 run's GEMMs in MXFP8" if report.get("gemm") == "mxfp8" else "")
    )
    runs = report["runs"]
    table = Table(title="per step and device; collectives read from the compiled HLO (loops counted per iteration)")
    table.add_column("")
    for name in runs:
        table.add_column(name, justify="right")
    rows = [
        ("first loss", lambda n, r: f"{r['first_loss']:.4f}"),
        ("final loss (mean of last 10)", lambda n, r: f"{r['final_loss']:.4f}"),
        *(
            [("validation loss (held-out files)", lambda n, r: f"{r['validation_loss']:.4f}")]
            if report["runs"]["mxfp8"].get("validation_loss") is not None
            else []
        ),
        ("weights all-gathered", lambda n, r: _kib(r["weight_all_gather_bytes"])),
        ("  as MXFP8 planes (8.25 bits)", lambda n, r: _kib(r["mxfp8_gather_bytes"])),
        ("  as bf16 (16 bits)", lambda n, r: _kib(r["bf16_gather_bytes"])),
        ("all-gathers incl. fp32 params", lambda n, r: _kib(r["all_gather_bytes"])),
        ("gradients reduce-scattered", lambda n, r: _kib(r["reduce_scatter_bytes"])),
        ("temp memory (compiled)", lambda n, r: _kib(r["temp_bytes"])),
        ("compile s (CPU s)", lambda n, r: f"{r['compile_s']:.1f} ({r['compile_cpu_s']:.1f})"),
        ("step ms (CPU ms)", lambda n, r: f"{1e3 * r['step_s']:.0f} ({1e3 * r['step_cpu_s']:.0f})"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(n, r) for n, r in runs.items()))
    console.print(table)
    console.print(
        f"MXFP8 gathers {report['weight_gather_ratio']:.3f}x the weight bytes of bf16 FSDP (its embedding "
        f"and head are bf16 units in both runs; MXFP8 units are padded to whole 32-row blocks per device; "
        f"a bf16 weight serves both GEMM directions, while a 1x32 MXFP8 layer's backward gathers its "
        f'columnwise plane too: FSDP(weight_blocks="32x32") gathers one plane for both); '
        f"final loss differs by {report['final_loss_difference']:+.4f} from the bf16 baseline"
        + (
            f", validation loss by {report['validation_loss_difference']:+.4f}."
            if "validation_loss_difference" in report
            else "."
        )
    )


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="mxfp8-jax demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        default="transformer",
        help="transformer (scanned Llama-style LM, default) or mlp (residual MLP)",
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices to use (default: all local accelerators, or 8 simulated CPU devices)",
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden width, a multiple of 32 (default 256)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="sequence/tensor-parallel degree of the transformer (mesh devices/tp x tp; default 1: FSDP alone)",
    )
    p.add_argument(
        "--norm-path",
        choices=("fused", "unfused"),
        default="fused",
        help="under --tp > 1: the fused all-gather + RMSNorm + quantize (default) or all_gather then the local op",
    )
    p.add_argument(
        "--data",
        choices=DATA,
        default="permutation",
        help="the transformer's task: the synthetic permutation (default) or text (bytes of stdlib sources)",
    )
    p.add_argument(
        "--gemm",
        choices=("dequantized", "mxfp8"),
        default="dequantized",
        help="the MXFP8 run's GEMMs: on dequantized weights (default) or MXFP8 (E4M3 operands, block-scaled)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the report as JSON to PATH, or to stdout (without the table) if no PATH",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps={args.steps} must be at least 1")
    if args.hidden < 32 or args.hidden % 32:
        p.error(f"--hidden={args.hidden} must be a positive multiple of 32 (MXFP8 blocks are 32 wide)")
    if args.layers < 1:
        p.error(f"--layers={args.layers} must be at least 1")
    if args.tp < 1:
        p.error(f"--tp={args.tp} must be at least 1")
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices={args.devices} must be at least 1")
    configure_devices(args.devices)

    from rich.console import Console

    to_stdout = args.json == "-"
    console = Console(stderr=to_stdout)
    try:
        report = run(
            args.steps,
            args.devices,
            args.hidden,
            args.seed,
            show_progress=True,
            console=console,
            model=args.model,
            layers=args.layers,
            tp=args.tp,
            norm_path=args.norm_path,
            data=args.data,
            gemm=args.gemm,
        )
    except ValueError as e:
        p.error(str(e))
    if to_stdout:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_report(report, console)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            console.print(f"report written to {args.json}")
    return 0


# ------------------------------------------------------------------------------------------------
# mxfp8-jax demo --processes N


def run_in_processes(argv: Sequence[str]) -> int:
    """``mxfp8-jax demo --processes N [--devices D] [demo flags]``: the demo in N local processes
    of one distributed job (``D`` CPU devices in all, default 8, split evenly); process 0
    prints (and writes ``--json``), the others' output is shown only if they fail."""
    from mxfp8_jax._src.tooling.launch import launch

    p = argparse.ArgumentParser(prog="mxfp8-jax demo", add_help=False)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--timeout", type=float, default=3600.0)
    known, rest = p.parse_known_args(list(argv))
    n = known.processes
    if n < 1:
        p.error(f"--processes={n} must be at least 1")
    total = 8 if known.devices is None else known.devices
    if total < n or total % n:
        p.error(f"--devices={total} must be a multiple of --processes={n} (each process gets {total}/{n})")
    results = launch(
        "mxfp8_jax.demo:_process_main",
        n,
        args=[rest],
        devices_per_process=total // n,
        timeout=known.timeout,
        echo=0,
        check=False,
    )
    failed = [r for r in results if not r.ok]
    for r in failed:
        state = "killed (still running)" if r.returncode is None else f"exit code {r.returncode}"
        print(f"--- process {r.process_id}: {state}\n{r.stderr[-3000:]}", file=sys.stderr)
    if failed:
        return 1
    return int(results[0].result or 0)


def _process_main(argv: list[str]) -> int:
    import jax

    if jax.process_index() != 0:  # one process writes the report
        argv = _without_json(argv)
    return main(argv)


def _without_json(argv: list[str]) -> list[str]:
    out, skip = [], False
    for j, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--json":
            skip = j + 1 < len(argv) and not argv[j + 1].startswith("-")
        elif not a.startswith("--json="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
