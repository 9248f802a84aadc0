"""FSDP at depth: per-device memory, bytes all-gathered and step time against the alternatives.

    python -m mxfp8_jax.bench.fsdp [--model stack] [--depths 4,8,16,32,64] [--width 1024]
                                   [--devices 8] [--tokens 16] [--iters 3] [--no-time] [--json out.json]

``--model stack`` (default): ``depth`` residual blocks ``x + tanh(nnx.Linear(width, width)(x))``
(bf16 compute, fp32 parameters, no bias), created with ``nnx.vmap`` and run with ``nnx.scan``,
8 rows per device. ``--model`` one of the Flax model styles of ``mxfp8_jax.bench.styles.model_styles``
(``mha``, ``gemma``, ``maxtext``, ``einsum``, ``moe``, ``dropout``: decoder LMs written the ways
public Flax NNX code writes them; ``--width`` their model width, default 256) with ``--tokens``
tokens per device (sequences of 16). Trained with ``optax.adam``. In one run, for every depth:

- ``mxfp8``: ``mxfp8_jax.flax.FSDP`` with the loss traced on the batch (units by operation):
  per-unit 8-bit gathers of rowwise (forward) and columnwise (dgrad) planes when each layer
  runs, one reduce-scatter per unit; embeddings and heads as bf16 units; ``prefetch=1``: each
  layer's gathers free to run while the layer before computes (in a scan: not waiting for the
  carried activation);
- ``mxfp8-p0``: the same with ``prefetch=0``, each gather waiting for its op's input. On CPU the
  step time barely moves (simulated devices share the host's cores and a gather is a copy, so
  there is nothing to hide); the temp memory shows what gathering ahead holds;
- ``bf16``: the same FSDP with ``precision="bf16"`` (16-bit gathers, same structure);
- ``gspmd``: what a JAX user writes instead (as MaxText does): the same nnx model under
  ``jax.jit`` with parameters and optimizer state sharded by ``NamedSharding`` over the FSDP
  axis (each weight's largest axis the devices divide, after a stack axis), XLA inserting the
  gathers;
- ``dp``: unsharded data parallelism: parameters and optimizer state replicated, gradients
  all-reduced.

Memory is the compiled step's own accounting (``memory_analysis()``: arguments = parameters,
optimizer state and batch held by one device; temp = everything else the step allocates);
communication is read from its HLO (collectives in the scan loops counted once per layer); the
model's fp32 bytes are the reference for both. Step time is the median over ``--iters`` steps
after one warm-up step (``--no-time`` skips execution: compiles only, for deep models on small
hosts). The MXFP8 path needs the compiled quantize kernel for the platform and refuses to run
on the pure-JAX fallback.
"""

from __future__ import annotations

import argparse
import time

VARIANTS = ("mxfp8", "mxfp8-p0", "bf16", "gspmd", "dp")
SEQ = 16  # tokens per sequence of the style models


def _model(width: int, depth: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(width, width, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.l(x)).astype(x.dtype)

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.split_rngs(splits=depth)(nnx.vmap(Block, in_axes=(0,), out_axes=0))(rngs)

        def __call__(self, x):
            return nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)

    return Stack, jax


def build_model(width: int, depth: int, seed: int = 0, abstract: bool = False):
    """The stack, with host-drawn LeCun-normal kernels (or abstract, for compiling only)."""
    import numpy as np
    from flax import nnx

    Stack, _ = _model(width, depth)
    model = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
    if abstract:
        return model
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        shape = var.get_value().shape
        var.set_value((rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])).astype(np.float32))
    return model


def loss_fn(model, batch):
    import jax.numpy as jnp

    x, y = batch
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def models() -> tuple[str, ...]:
    from mxfp8_jax.bench.styles import model_styles

    return ("stack", *model_styles.STYLES)


def workload(name: str, width: int, depth: int, devices: int, tokens: int, abstract: bool):
    """``(model, loss_fn, batch)`` of ``--model name``: arrays, or shapes when ``abstract``."""
    import jax
    import numpy as np

    rng = np.random.default_rng(1)
    if name == "stack":
        rows = 8 * devices
        model = build_model(width, depth, abstract=abstract)
        shapes = [((rows, width), np.float32)] * 2
        make = lambda shape, dtype: rng.standard_normal(shape, np.float32)
        fn = loss_fn
    else:
        from mxfp8_jax.bench.styles import model_styles as ms

        if width % 64:
            raise SystemExit(f"--width {width} must be a multiple of 64 for --model {name} (heads of 64)")
        cfg = ms.StyleConfig(width=width, heads=width // 64, head_dim=64, mlp=2 * width, depth=depth)
        model = ms.abstract(name, cfg) if abstract else ms.build(name, cfg)
        seqs = max(1, tokens * devices // SEQ)
        shapes = [((seqs, SEQ), np.int32)] * 2
        make = lambda shape, dtype: rng.integers(0, cfg.vocab, shape).astype(np.int32)
        fn = ms.loss_fn
    if abstract:
        return model, fn, tuple(jax.ShapeDtypeStruct(s, d) for s, d in shapes)
    return model, fn, tuple(make(s, d) for s, d in shapes)


# ------------------------------------------------------------------------------------------------
# The variants: each returns (compiled step, state, batch) or, with abstract=True, compiled only


def _fsdp(model, loss_fn, mesh, precision, tx, batch, abstract, prefetch=1):
    from mxfp8_jax.flax import FSDP

    fsdp = FSDP(model, mesh, precision=precision, loss_fn=loss_fn, example_batch=batch, prefetch=prefetch)
    state = fsdp.abstract_state(tx) if abstract else fsdp.init(model, tx)
    compiled = fsdp.lower_train_step(loss_fn, tx, state, batch).compile()
    run = None
    if not abstract:
        placed = fsdp.place_batch(batch)
        box = [state]

        def run():
            box[0], loss = compiled(box[0], placed)
            return loss

    return compiled, run


def gspmd_step(model, loss_fn, mesh, tx, batch, sharded: bool = True):
    """What a JAX user writes instead of FSDP (as MaxText does): a jitted nnx train step with
    parameters and optimizer state sharded by ``NamedSharding`` over the mesh's first axis
    (each weight's largest axis the devices divide, after a leading stack axis; replicated with
    ``sharded=False``), the batch split over it, XLA inserting the collectives. The model's
    other state (RNG streams) is replicated and carried from step to step.

    Returns:
      ``(jitted, abstract_args)``: the step ``(params, rest, opt_state, batch) -> (params,
      rest, opt_state, loss)`` and its arguments as ``jax.ShapeDtypeStruct``s on ``mesh``
      (``model`` and ``batch`` may be abstract).
    """
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    axis, n = mesh.axis_names[0], mesh.size

    def spec(a):
        """The largest axis the devices divide, after a leading stack axis (MaxText shards a
        kernel's embedding axis over fsdp); vectors replicated."""
        shape = tuple(a.shape)
        if sharded and len(shape) >= 2:
            first = 1 if len(shape) >= 3 else 0
            axes = [i for i in range(first, len(shape)) if shape[i] % n == 0]
            if axes:
                i = max(axes, key=lambda i: shape[i])
                return NamedSharding(mesh, P(*(None,) * i, axis))
        return NamedSharding(mesh, P())

    param_shardings = jax.tree.map(spec, params)
    rest_shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), rest)
    opt_shapes = jax.eval_shape(tx.init, params)
    by_shape = {tuple(a.shape): spec(a) for a in jax.tree.leaves(params)}
    opt_shardings = jax.tree.map(lambda a: by_shape.get(tuple(a.shape), NamedSharding(mesh, P())), opt_shapes)
    batch_sharding = NamedSharding(mesh, P(axis))

    def step(params, rest, opt_state, batch):
        def loss(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return loss_fn(m, batch), nnx.state(m, nnx.Not(nnx.Param))

        (loss, rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    jitted = jax.jit(
        step,
        in_shardings=(param_shardings, rest_shardings, opt_shardings, batch_sharding),
        out_shardings=(param_shardings, rest_shardings, opt_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0, 1, 2),
    )
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    args = (
        jax.tree.map(sds, params, param_shardings),
        jax.tree.map(sds, rest, rest_shardings),
        jax.tree.map(sds, opt_shapes, opt_shardings),
        jax.tree.map(lambda a: sds(a, batch_sharding), batch),
    )
    return jitted, args


def _jit(model, loss_fn, mesh, sharded: bool, tx, batch, abstract):
    """``gspmd_step`` compiled, and with arrays (not ``abstract``) a function running one step."""
    import jax
    from flax import nnx

    jitted, args = gspmd_step(model, loss_fn, mesh, tx, batch, sharded)
    if abstract:
        return jitted.lower(*args).compile(), None
    shardings = [jax.tree.map(lambda a: a.sharding, x) for x in args]
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, shardings[0])
    rest = jax.device_put(rest, shardings[1])
    opt_state = jax.jit(tx.init, out_shardings=shardings[2])(params)
    placed = jax.device_put(batch, shardings[3])
    compiled = jitted.lower(params, rest, opt_state, placed).compile()
    box = [params, rest, opt_state]

    def run():
        box[0], box[1], box[2], loss = compiled(*box, placed)
        return loss

    return compiled, run


def measure(
    variant: str, width: int, depth: int, mesh, *, iters: int, timed: bool, model: str = "stack", tokens: int = 16
) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from mxfp8_jax._src.compiled import hlo

    tx = optax.adam(1e-4)
    module, fn, batch = workload(model, width, depth, mesh.size, tokens, abstract=not timed)
    t0 = time.perf_counter()
    if variant in ("mxfp8", "mxfp8-p0", "bf16"):
        precision, prefetch = variant.split("-")[0], 0 if variant.endswith("-p0") else 1
        compiled, run = _fsdp(module, fn, mesh, precision, tx, batch, abstract=not timed, prefetch=prefetch)
    else:
        compiled, run = _jit(module, fn, mesh, variant == "gspmd", tx, batch, abstract=not timed)
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    found = hlo.collectives(compiled.as_text())
    per_op = {}
    for c in found:
        per_op[c.op] = per_op.get(c.op, 0) + c.bytes_per_step
    gather_types = sorted({d for c in found if c.op == "all-gather" for d in c.dtypes})
    step_s = None
    if run is not None:
        jax.block_until_ready(run())  # warm-up
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - t)
        step_s = float(np.median(times))
    params = jax.tree.leaves(nnx.state(module, nnx.Param))
    model_bytes = sum(int(np.prod(np.shape(p))) * 4 for p in params)
    return {
        "variant": variant,
        "model": model,
        "depth": depth,
        "width": width,
        "devices": mesh.size,
        "model_fp32_bytes": model_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "all_gather_bytes": per_op.get("all-gather", 0),
        "all_gather_types": gather_types,
        "reduce_scatter_bytes": per_op.get("reduce-scatter", 0),
        "all_reduce_bytes": per_op.get("all-reduce", 0),
        "loops": [trip for _, trip in hlo.while_loops(compiled.as_text())],
        "compile_s": compile_s,
        "step_s": step_s,
    }


def run(
    depths=(4, 8, 16, 32, 64),
    width: int | None = None,
    devices: int = 8,
    iters: int = 3,
    timed: bool = True,
    variants=VARIANTS,
    json_path: str | None = None,
    progress: bool = True,
    model: str = "stack",
    tokens: int = 16,
) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from mxfp8_jax._src.core import platforms
    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax.bench._timing import environment, print_table, write_json

    platform = platforms.default()  # "cuda" / "rocm", as the extension names them
    if any(v.startswith("mxfp8") for v in variants):
        _ffi.require("mxfp8_quantize", platform)  # never silently benchmark the reference quantize
    devs = jax.devices()
    if len(devs) < devices:
        raise SystemExit(f"--devices {devices}: only {len(devs)} {platform} devices are visible")
    if model not in models():
        raise SystemExit(f"--model {model!r} must be one of {models()}")
    width = width or (1024 if model == "stack" else 256)
    if width % 32:
        raise SystemExit(f"--width {width} must be a multiple of 32")
    mesh = Mesh(np.array(devs[:devices]), ("fsdp",))
    cases = [(v, d) for d in depths for v in variants]
    results = []
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress()
        bar.start()
        task = bar.add_task("fsdp bench", total=len(cases))
    try:
        for v, d in cases:
            if bar is not None:
                bar.update(task, description=f"{v} depth {d}")
            results.append(measure(v, width, d, mesh, iters=iters, timed=timed, model=model, tokens=tokens))
            if bar is not None:
                bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()

    mib = lambda n: f"{n / 2**20:,.1f}"
    rows = []
    for r in results:
        comm = r["reduce_scatter_bytes"] + r["all_reduce_bytes"]
        rows.append(
            [
                r["variant"],
                r["depth"],
                mib(r["model_fp32_bytes"]),
                mib(r["argument_bytes"]),
                mib(r["temp_bytes"]),
                f"{r['temp_bytes'] / r['model_fp32_bytes']:.3f}",
                f"{(r['argument_bytes'] + r['temp_bytes']) / r['model_fp32_bytes']:.3f}",
                mib(r["all_gather_bytes"]),
                ",".join(r["all_gather_types"]) or "-",
                mib(comm),
                "-" if r["step_s"] is None else f"{1e3 * r['step_s']:.0f}",
            ]
        )
    from rich.console import Console

    console = Console(width=max(150, Console().width))
    what = (
        f"{width}x{width} layers, 8 rows/device"
        if model == "stack"
        else f"--model {model} (width {width}), {tokens} tokens/device"
    )
    print_table(
        f"FSDP step vs depth: {what}, {devices} {platform} devices, adam (per device; MiB)",
        [
            "variant",
            "depth",
            "model fp32",
            "args",
            "temp",
            "temp/model",
            "(args+temp)/model",
            "all-gathered/step",
            "gather types",
            "reduced/step",
            "step ms",
        ],
        rows,
        console,
    )
    by = {(r["variant"], r["depth"]): r for r in results}
    ratios = []
    for d in depths:
        if ("mxfp8", d) in by and ("bf16", d) in by:
            m, b = by["mxfp8", d], by["bf16", d]
            ratios.append(
                [
                    d,
                    f"{m['all_gather_bytes'] / b['all_gather_bytes']:.4f}",
                    *(
                        f"{m['temp_bytes'] / by[v, d]['temp_bytes']:.3f}" if (v, d) in by else "-"
                        for v in ("bf16", "gspmd", "dp")
                    ),
                ]
            )
    if ratios:
        print_table(
            "MXFP8 FSDP relative to the others",
            ["depth", "gathered bytes / bf16 FSDP", "temp / bf16 FSDP", "temp / gspmd", "temp / dp"],
            ratios,
            console,
        )
    payload = {"benchmark": "fsdp", "environment": environment(), "results": results}
    write_json(json_path, payload)
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mxfp8_jax.bench.fsdp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--depths", default="4,8,16,32,64", help="comma-separated depths (default 4,8,16,32,64)")
    p.add_argument("--model", default="stack", help="stack (default) or a model style: " + ", ".join(models()[1:]))
    p.add_argument("--width", type=int, default=None, help="model width (default 1024 for stack, 256 for the styles)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per device for the model styles (default 16)")
    p.add_argument("--devices", type=int, default=8, help="devices in the FSDP mesh (default 8)")
    p.add_argument("--iters", type=int, default=3, help="timed steps per case (default 3)")
    p.add_argument("--no-time", action="store_true", help="compile only: memory and communication, no steps")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--json", default=None, help="write the results as JSON")
    from mxfp8_jax.bench._timing import add_fresh_pages_flag, reuse_freed_memory

    add_fresh_pages_flag(p)
    args = p.parse_args(argv)
    reuse_freed_memory(not args.fresh_pages)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before the CPU backend starts
    except RuntimeError:  # backends already running: use the devices there are
        pass
    try:
        depths = tuple(int(d) for d in args.depths.split(","))
    except ValueError:
        p.error(f"--depths={args.depths!r} must be comma-separated ints")
    variants = tuple(v for v in args.variants.split(",") if v)
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants: {bad or args.variants!r} not in {VARIANTS}")
    if any(d < 1 for d in depths) or args.iters < 1:
        p.error("--depths and --iters must be positive")
    if args.model not in models():
        p.error(f"--model={args.model!r} must be one of {models()}")
    run(
        depths,
        args.width,
        args.devices,
        args.iters,
        not args.no_time,
        variants,
        args.json,
        model=args.model,
        tokens=args.tokens,
    )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
