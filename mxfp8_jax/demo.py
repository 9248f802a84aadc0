"""``mxfp8-jax demo``: a small Flax model trained with MXFP8 FSDP, against a bf16 baseline.

A residual MLP classifies points labelled by a fixed random "teacher" network. It is trained
twice, identically (same initial weights, batches and optimizer), once with MXFP8 FSDP weights
and once with bf16 FSDP weights, on every local device (8 simulated CPU devices when there is no
accelerator). The table shows the losses and what each step communicates, read from the
compiled HLO of the step: MXFP8 gathers 8.25 bits per weight for the forward (rowwise planes)
and 8.25 for the backward (columnwise planes); bf16 FSDP gathers 16 + 16.

    mxfp8-jax demo [--steps 100] [--devices 8] [--hidden 128] [--seed 0] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

DEFAULT_CPU_DEVICES = 8
PER_DEVICE_BATCH = 32
IN_FEATURES, CLASSES, DEPTH = 64, 10, 2


def configure_devices(devices: int | None) -> None:
    """Ask for ``devices`` simulated CPU devices (default 8) before jax starts its backends.

    Accelerators are unaffected; if the backends are already running, this does nothing.
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", devices or DEFAULT_CPU_DEVICES)
    except RuntimeError:  # backends already initialised: use what exists
        pass


def select_devices(devices: int | None):
    import jax

    available = jax.devices()
    if devices is None:
        return available
    if devices < 1 or devices > len(available):
        raise ValueError(
            f"--devices={devices}: must be between 1 and the {len(available)} "
            f"{available[0].platform} devices available"
        )
    return available[:devices]


# ------------------------------------------------------------------------------------------------
# Model and data


def make_model(hidden: int, seed: int):
    """The demo's residual MLP, initialised on the host from ``seed`` (LeCun-normal kernels,
    zero biases, unit norm scales): no XLA program is compiled to build it."""
    import numpy as np
    from flax import nnx

    from mxfp8_jax.flax import Linear

    class ResidualMLP(nnx.Module):
        """in -> hidden, DEPTH residual blocks x + gelu(Linear(LayerNorm(x))), -> classes."""

        def __init__(self, rngs: nnx.Rngs):
            self.embed = Linear(IN_FEATURES, hidden, rngs=rngs)
            self.norms = nnx.List([nnx.LayerNorm(hidden, rngs=rngs) for _ in range(DEPTH)])
            self.blocks = nnx.List([Linear(hidden, hidden, rngs=rngs) for _ in range(DEPTH)])
            self.head = Linear(hidden, CLASSES, rngs=rngs)  # 10 outputs: not MXFP8-eligible

        def __call__(self, x):
            import jax

            h = self.embed(x)
            for norm, block in zip(self.norms, self.blocks):
                h = h + jax.nn.gelu(block(norm(h)))
            return self.head(h)

    model = nnx.eval_shape(lambda: ResidualMLP(nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape, name = var.get_value().shape, path[-1]
        if name == "kernel":
            value = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif name == "scale":
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        var.set_value(value.astype(np.float32))
    return model


def loss_fn(model, batch):
    import jax.numpy as jnp
    import optax

    x, labels = batch
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Teacher:
    """Labels from a fixed random tanh network; batches drawn from a seeded numpy stream."""

    def __init__(self, seed: int, hidden: int = 128):
        import numpy as np

        rng = np.random.default_rng(seed + 1_000_003)
        self.a = rng.standard_normal((IN_FEATURES, hidden)).astype(np.float32) / np.sqrt(IN_FEATURES)
        self.b = rng.standard_normal((hidden, CLASSES)).astype(np.float32) / np.sqrt(hidden)
        self.seed = seed

    def batches(self, steps: int, batch: int):
        import numpy as np

        rng = np.random.default_rng(self.seed)
        for _ in range(steps):
            x = rng.standard_normal((batch, IN_FEATURES)).astype(np.float32)
            yield x, np.argmax(np.tanh(x @ self.a) @ self.b, axis=-1).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Training


def train(model, precision: str, *, steps: int, seed: int, mesh, progress=None) -> dict:
    """Trains ``model``'s weights (the module is not modified) with ``precision`` FSDP weights;
    returns losses, timings and the step's collectives (read from its compiled HLO)."""
    import jax
    import optax

    from mxfp8_jax._src import hlo
    from mxfp8_jax.flax import FSDP

    fsdp = FSDP(model, mesh, precision=precision)
    tx = optax.adam(optax.cosine_decay_schedule(3e-3, steps, alpha=0.1))
    state = fsdp.init(model, tx)
    batch = PER_DEVICE_BATCH * mesh.size
    data = Teacher(seed).batches(steps, batch)
    first = next(data)

    t0, c0 = time.perf_counter(), time.process_time()
    compiled = fsdp.lower_train_step(loss_fn, tx, state, first).compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    found = hlo.collectives(compiled.as_text())

    task = None if progress is None else progress.add_task(precision, total=steps, loss=float("nan"))
    losses, started = [], None
    for b in itertools.chain([first], data):
        state, loss = compiled(state, fsdp.place_batch(b))
        losses.append(float(loss))
        started = started or (time.perf_counter(), time.process_time())  # later steps are timed
        if task is not None:
            progress.update(task, advance=1, loss=losses[-1])
    timed = max(1, len(losses) - 1)
    step_s = (time.perf_counter() - started[0]) / timed
    step_cpu_s = (time.process_time() - started[1]) / timed

    gathers = [c for c in found if c.op == "all-gather"]
    weight_gather = sum(c.bytes for c in gathers if max(map(hlo.dtype_bytes, c.dtypes)) <= 2)
    return {
        "precision": precision,
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "final_loss": _tail_mean(losses),
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "all_gather_bytes": sum(c.bytes for c in gathers),
        "weight_all_gather_bytes": weight_gather,
        "weight_bits_per_element": 8 * weight_gather / fsdp.layout.physical_size,
        "reduce_scatter_bytes": sum(c.bytes for c in found if c.op == "reduce-scatter"),
        "collectives": [{"op": c.op, "outputs": [[d, list(s)] for d, s in c.outputs], "bytes": c.bytes} for c in found],
        "eligible_elements": fsdp.layout.numel_total,
        "master_physical_elements": fsdp.layout.physical_size,
        "plain_elements": 0 if fsdp.plain_layout is None else fsdp.plain_layout.numel_total,
    }


def _tail_mean(losses, n: int = 10):
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else None


def run(steps: int = 100, devices: int | None = None, hidden: int = 128, seed: int = 0,
        show_progress: bool = True, console=None) -> dict:
    """Both runs on ``devices`` local devices (default all); returns the report dict."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import mxfp8_jax as mx
    from mxfp8_jax._src import _ffi

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive int")
    if not isinstance(hidden, int) or hidden < 32 or hidden % 32:
        raise ValueError(f"hidden={hidden!r} must be a positive multiple of 32 (MXFP8 blocks are 32 wide)")
    devs = select_devices(devices)
    mesh = Mesh(np.array(devs), ("data",))
    platform = devs[0].platform
    report = {
        "steps": steps, "hidden": hidden, "seed": seed, "devices": len(devs), "platform": platform,
        "batch": PER_DEVICE_BATCH * len(devs), "mxfp8_jax": mx.__version__, "jax": jax.__version__,
        "quantize_path": "ffi" if _ffi.has_target("mxfp8_quantize_segments", platform) else "pure-JAX reference",
        "runs": {},
    }
    progress = None
    if show_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn("{task.description:>6}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), console=console,
        )
        progress.start()
    model = make_model(hidden, seed)
    try:
        for precision in ("mxfp8", "bf16"):
            report["runs"][precision] = train(model, precision, steps=steps, seed=seed, mesh=mesh,
                                              progress=progress)
    finally:
        if progress is not None:
            progress.stop()
    m, b = report["runs"]["mxfp8"], report["runs"]["bf16"]
    report["weight_gather_ratio"] = m["weight_all_gather_bytes"] / b["weight_all_gather_bytes"]
    report["final_loss_difference"] = m["final_loss"] - b["final_loss"]
    return report


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = report["runs"]["mxfp8"]
    console.print(
        f"[bold]MXFP8 FSDP demo[/]: residual MLP {IN_FEATURES}->{report['hidden']}x{DEPTH + 1}->{CLASSES}, "
        f"{m['eligible_elements']:,} weights as MXFP8 + {m['plain_elements']:,} other params (fp32), "
        f"{report['devices']} {report['platform']} devices, batch {report['batch']}, {report['steps']} steps, "
        f"quantize: {report['quantize_path']}"
    )
    runs = report["runs"]
    table = Table(title="per step and device; collectives read from the compiled HLO")
    table.add_column("")
    for name in runs:
        table.add_column(name, justify="right")
    rows = [
        ("first loss", lambda r: f"{r['first_loss']:.4f}"),
        ("final loss (mean of last 10)", lambda r: f"{r['final_loss']:.4f}"),
        ("weights all-gathered", lambda r: _kib(r["weight_all_gather_bytes"])),
        ("  bits per weight", lambda r: f"{r['weight_bits_per_element']:.2f}"),
        ("all-gathers incl. fp32 params", lambda r: _kib(r["all_gather_bytes"])),
        ("gradients reduce-scattered", lambda r: _kib(r["reduce_scatter_bytes"])),
        ("compile s (CPU s)", lambda r: f"{r['compile_s']:.1f} ({r['compile_cpu_s']:.1f})"),
        ("step ms (CPU ms)", lambda r: f"{1e3 * r['step_s']:.0f} ({1e3 * r['step_cpu_s']:.0f})"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in runs.values()))
    console.print(table)
    console.print(
        f"MXFP8 gathers {report['weight_gather_ratio']:.3f}x the weight bytes of bf16 FSDP; final loss "
        f"differs by {report['final_loss_difference']:+.4f} from the bf16 baseline."
    )


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="mxfp8-jax demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to use (default: all local accelerators, or 8 simulated CPU devices)")
    p.add_argument("--hidden", type=int, default=128, help="hidden width, a multiple of 32 (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH, or to stdout (without the table) if no PATH")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps={args.steps} must be at least 1")
    if args.hidden < 32 or args.hidden % 32:
        p.error(f"--hidden={args.hidden} must be a positive multiple of 32 (MXFP8 blocks are 32 wide)")
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices={args.devices} must be at least 1")
    configure_devices(args.devices)

    from rich.console import Console

    to_stdout = args.json == "-"
    console = Console(stderr=to_stdout)
    try:
        report = run(args.steps, args.devices, args.hidden, args.seed, show_progress=True, console=console)
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


if __name__ == "__main__":
    sys.exit(main())
