"""Validation loss curves on real text: bf16 FSDP (several seeds), MXFP8-gather FSDP, MXFP8-GEMM FSDP.

    python -m mxfp8_jax.bench.convergence [--steps 300] [--seeds 3] [--eval-every 25]
                                          [--devices 8] [--hidden 256] [--layers 2]
                                          [--png curves.png] [--json out.json]

The demo's transformer (``mxfp8-jax demo --data text``: byte-level language modelling of a
fixed list of the Python standard library's sources, validation on held-out files) is trained
with the same schedule in every run of one invocation:

- ``bf16 seed s``: ``FSDP(precision="bf16")`` for seeds ``0 .. --seeds - 1`` (weights and batch
  order change with the seed): the seed-to-seed spread the MXFP8 runs are judged against;
- ``mxfp8 gather``: ``FSDP(precision="mxfp8")``, seed 0: MXFP8 weight gathers, GEMMs on the
  exactly dequantized weights in bf16;
- ``mxfp8 gemm``: ``FSDP(precision="mxfp8", gemm="mxfp8")``, seed 0: the forward, dgrad and
  wgrad GEMMs on E4M3 operands (the native block-scaled GEMM on CUDA/ROCm, the exact path on
  CPUs: the path is printed);
- ``mxfp8 32x32``: ``FSDP(precision="mxfp8", weight_blocks="32x32")``, seed 0: the gather run
  with one plane of 32x32 weight blocks per unit.

The table gives the validation loss at steps 0, 100, 300 and the end, and each run's step time
(on a GPU host also tokens/s); ``--png`` draws the curves, the bf16 seeds as a band. Embeddings
and the output head are bf16 units in every run. Nothing falls back silently: a run whose
quantize kernel is missing stops (``--allow-reference`` runs the pure-JAX quantize instead and
says so).
"""

from __future__ import annotations

import argparse
import json

MARKS = (0, 100, 300)


def run(
    steps: int = 300,
    seeds: int = 3,
    eval_every: int = 25,
    devices: int | None = None,
    hidden: int = 256,
    layers: int = 2,
    allow_reference: bool = False,
    show_progress: bool = True,
) -> dict:
    """Every run of the comparison; returns ``{"runs": [...], ...}`` (losses, curves, times)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from mxfp8_jax import training
    from mxfp8_jax._src.core import platforms
    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax._src.ops import mxfp8_gemm

    devs = training.select_devices(devices)
    platform = platforms.of_device(devs[0])  # 'cuda'/'rocm', not jax's 'gpu'
    if not _ffi.has_target("mxfp8_quantize", platform) and not allow_reference:
        raise RuntimeError(
            f"the compiled quantize kernel is missing for {platform}; the runs would use the pure-JAX "
            f"reference (pass --allow-reference to accept that)"
        )
    mesh = Mesh(np.array(devs), ("data",))
    plan = [(f"bf16 seed {s}", "bf16", "dequantized", s, "1x32") for s in range(seeds)]
    plan += [("mxfp8 gather", "mxfp8", "dequantized", 0, "1x32"), ("mxfp8 gemm", "mxfp8", "mxfp8", 0, "1x32")]
    plan += [("mxfp8 32x32", "mxfp8", "dequantized", 0, "32x32")]
    progress = training.progress_bar(width=12) if show_progress else None
    works: dict[int, training.Workload] = {}
    runs = []
    try:
        for label, precision, gemm, seed, blocks in plan:
            if seed not in works:
                works[seed] = training.Workload(
                    "transformer", hidden=hidden, layers=layers, seed=seed, steps=steps, data="text"
                )
            r = training.train(
                works[seed],
                precision,
                mesh=mesh,
                progress=progress,
                gemm=gemm,
                label=label,
                eval_every=eval_every,
                weight_blocks=blocks,
            )
            tokens = works[seed].per_device_batch * mesh.size * training.SEQ_LEN
            runs.append(
                {
                    "label": label,
                    "precision": precision,
                    "gemm": gemm,
                    "weight_blocks": blocks,
                    "seed": seed,
                    "validation": r["validation"],
                    "losses": r["losses"],
                    "step_s": r["step_s"],
                    "tokens_per_s": tokens / r["step_s"],
                    "temp_bytes": r["temp_bytes"],
                    "weight_all_gather_bytes": r["weight_all_gather_bytes"],
                }
            )
    finally:
        if progress is not None:
            progress.stop()
    return {
        "description": works[0].describe,
        "steps": steps,
        "eval_every": eval_every,
        "devices": len(devs),
        "platform": platform,
        "gemm_path": mxfp8_gemm.resolve_path("auto", platform, platforms.capability(devs[0])),
        "jax": jax.__version__,
        "runs": runs,
    }


def at(curve, step: int) -> float | None:
    """The validation loss recorded at ``step`` (None if that step was not evaluated)."""
    return next((v for s, v in curve if s == step), None)


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    steps = report["steps"]
    marks = [m for m in MARKS if m < steps] + [steps]
    console.print(
        f"[bold]Validation loss on held-out text[/]: {report['description']}; {report['devices']} "
        f"{report['platform']} devices; MXFP8 GEMM path: {report['gemm_path']}"
    )
    table = Table(title="validation loss (nats/byte) at step; step time")
    table.add_column("run")
    for m in marks:
        table.add_column(f"step {m}", justify="right")
    table.add_column("step ms", justify="right")
    table.add_column("tokens/s", justify="right")
    for r in report["runs"]:
        cells = [at(r["validation"], m) for m in marks]
        table.add_row(
            r["label"],
            *("-" if c is None else f"{c:.4f}" for c in cells),
            f"{1e3 * r['step_s']:.0f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    console.print(table)
    bf16 = [at(r["validation"], steps) for r in report["runs"] if r["precision"] == "bf16"]
    if len(bf16) > 1:
        lo, hi = min(bf16), max(bf16)
        console.print(f"bf16 seeds at step {steps}: {lo:.4f} .. {hi:.4f} (spread {hi - lo:.4f})")
        for r in report["runs"]:
            if r["precision"] == "mxfp8":
                v = at(r["validation"], steps)
                where = "inside" if lo <= v <= hi else f"{v - (hi if v > hi else lo):+.4f} outside"
                console.print(f"  {r['label']}: {v:.4f} ({where} the bf16 seeds' range)")


def draw(report: dict, path: str) -> None:
    """The validation curves as a PNG: the whole run, and from step 100 on with the bf16 seeds'
    range as a band (the MXFP8 runs are judged against it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    bf16 = [r for r in report["runs"] if r["precision"] == "bf16"]
    colors = {"mxfp8 gather": "tab:blue", "mxfp8 gemm": "tab:red", "mxfp8 32x32": "tab:green"}
    late = min(100, report["steps"] // 3)
    for ax, start in zip(axes, (0, late)):
        if bf16:
            steps = np.array([s for s, _ in bf16[0]["validation"]])
            values = np.array([[v for _, v in r["validation"]] for r in bf16])
            keep = steps >= start
            ax.fill_between(
                steps[keep], values.min(0)[keep], values.max(0)[keep], color="0.82", label=f"bf16, {len(bf16)} seeds"
            )
            for row in values:
                ax.plot(steps[keep], row[keep], color="0.55", lw=0.8)
        for r in report["runs"]:
            if r["precision"] == "mxfp8":
                s, v = (np.array(a) for a in zip(*r["validation"]))
                ax.plot(s[s >= start], v[s >= start], color=colors.get(r["label"]), lw=1.6, label=r["label"])
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/byte)")
    axes[0].set_title("whole run")
    axes[1].set_title(f"from step {late}")
    axes[1].legend()
    fig.suptitle(
        f"Held-out text: {report['devices']} {report['platform']} devices, MXFP8 GEMM path {report['gemm_path']}"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mxfp8_jax.bench.convergence",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--seeds", type=int, default=3, help="bf16 runs, seeds 0..N-1 (default 3)")
    p.add_argument("--eval-every", type=int, default=25, help="validation every N steps (default 25)")
    p.add_argument("--devices", type=int, default=None, help="devices (default all; 8 simulated CPU devices)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width, a multiple of 32 (default 256)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--allow-reference", action="store_true", help="run without the quantize kernel (pure JAX)")
    p.add_argument("--png", default=None, help="draw the curves into this PNG")
    p.add_argument("--json", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    for name in ("steps", "seeds", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    from mxfp8_jax import training

    training.configure_devices(args.devices)
    report = run(
        args.steps,
        args.seeds,
        args.eval_every,
        args.devices,
        args.hidden,
        args.layers,
        allow_reference=args.allow_reference,
    )
    print_report(report)
    if args.png:
        draw(report, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
