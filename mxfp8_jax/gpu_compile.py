"""``mxfp8-jax gpu-compile``: a training step compiled for a GPU cluster, on a host without one.

    mxfp8-jax gpu-compile --gpu h100,b200 --devices 8 --model transformer --hidden 2048 \\
        --layers 8 --tokens-per-device 4096 --variants mxfp8,mxfp8-gemm,bf16,gspmd [--json out.json]
    mxfp8-jax gpu-compile --model my_package.my_module:workload ...   # a model of one's own

XLA compiles a sharded program for GPUs it cannot see ("deviceless" ahead-of-time compilation)
from its description of the GPU (``tooling.gpu_targets``): the whole XLA:GPU pipeline runs
(SPMD partitioning, fusion, the latency-hiding scheduler, cuBLAS/cuDNN lowering, memory
assignment), for a mesh of compile-only devices. What it gives, before renting the cluster:
per-device memory, what the step communicates and how XLA scheduled it, the precision of every
GEMM, and XLA's own estimate of the step and of the communication it leaves exposed.

Every figure comes from the compiler, not from a run. GEMM autotuning needs a device, so
XLA's fusions keep their default tilings, which its cost model then prices; the schedule,
fusions, collectives and memory are XLA:GPU's own.

The variants: ``mxfp8`` (``FSDP``, MXFP8 units, GEMMs in the layer's dtype on dequantized
weights), ``mxfp8-gemm`` (``FSDP(gemm="mxfp8")``: block-scaled MXFP8 GEMMs forward and
backward), ``bf16`` (``FSDP(precision="bf16")``) and ``gspmd`` (the model jitted with its
parameters and optimizer state sharded by ``NamedSharding``, XLA inserting the collectives);
on request ``mxfp8-p0`` (``FSDP(prefetch=0)``: every gather waits for its op's input, the
baseline the overlap's memory is measured against), ``mxfp8-32x32`` and ``mxfp8-gemm-32x32``
(``FSDP(weight_blocks="32x32")``: one plane of 32x32 blocks a unit, GEMMs as ``mxfp8`` and
``mxfp8-gemm``).

A model of one's own: ``--model module:function``, where ``function()`` returns
``(make_model, loss_fn, batch)``: ``make_model()`` builds the ``nnx.Module`` (run under
``nnx.eval_shape``: no parameter is allocated, so an 8B configuration costs no host memory),
``loss_fn(model, batch)`` is the loss as ``FSDP`` takes it, and ``batch`` the global batch as
``jax.ShapeDtypeStruct``s (leading axis split over the devices).

Needs jax's CUDA plugin at jax's version (``pip install "jax[cuda13]==<jax>"``); no GPU and no
driver. It sets ``JAX_PLATFORMS=cpu`` (when unset) so that jax registers the plugin without
starting a GPU client.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("mxfp8", "mxfp8-gemm", "mxfp8-p0", "bf16", "gspmd", "mxfp8-32x32", "mxfp8-gemm-32x32")
MODELS = ("transformer", "transformer-loop", "transformer-fori")
# how each builtin model runs its blocks (``TransformerConfig.layer_loop``), as its description says
_LOOPS = {"transformer": ("scan", "nnx.scan over"), "transformer-loop": ("python", "a Python loop over"),
          "transformer-fori": ("fori", "a lax.fori_loop, by its counter, over")}  # fmt: skip
NOTE = "figures from XLA:GPU's compilation of the step (deviceless, default GEMM tilings), not from a run"


@dataclasses.dataclass(frozen=True)
class Workload:
    """What to compile: ``make()`` builds the model (abstractly), ``loss_fn(model, batch)``, and
    the global ``batch`` of ``jax.ShapeDtypeStruct``s."""

    name: str
    make: Callable[[], Any]
    loss_fn: Callable
    batch: Any
    description: str


def builtin_workload(name: str, *, hidden: int, layers: int, heads: int | None, mlp: int | None, vocab: int,
                     seq: int, tokens_per_device: int, devices: int, remat: bool = True) -> Workload:  # fmt: skip
    """The package's Llama-style transformer (``models.TransformerLM``, bf16, blocks under remat
    unless ``remat`` is False): blocks scanned (``transformer``), run by a Python loop
    (``transformer-loop``) or picked by a ``fori_loop``'s counter (``transformer-fori``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxfp8_jax import models

    if name not in MODELS:
        raise ValueError(f"--model {name!r}: one of {MODELS}, or module:function for a model of your own")
    if tokens_per_device % seq:
        raise ValueError(f"--tokens-per-device {tokens_per_device} must be a multiple of --seq {seq}")
    heads = heads or max(1, hidden // 128)
    cfg = models.TransformerConfig(
        vocab=vocab,
        hidden=hidden,
        heads=heads,
        head_dim=hidden // heads,
        mlp=mlp or 4 * hidden,
        layers=layers,
        layer_loop=_LOOPS[name][0],
        remat=remat,
    )
    sequences = tokens_per_device // seq * devices
    batch = jax.ShapeDtypeStruct((sequences, seq + 1), jnp.int32)
    blocks = "remat blocks" if remat else "blocks, no remat"
    what = (
        f"TransformerLM: hidden {hidden}, {layers} layers ({_LOOPS[name][1]} {blocks}), {heads} heads, mlp "
        f"{cfg.mlp}, vocab {vocab}, bf16; {sequences} sequences of {seq} tokens ({tokens_per_device} per device)"
    )
    return Workload(name, lambda: models.TransformerLM(cfg, rngs=nnx.Rngs(0)), models.next_token_loss, batch, what)


def user_workload(spec: str) -> Workload:
    """``module:function`` -> the ``Workload`` that ``function()`` describes (module docstring)."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"--model {spec!r}: give module:function (e.g. my_pkg.models:workload)")
    sys.path.insert(0, os.getcwd())  # a module beside the caller, as `python -m` would find it
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {spec!r}: cannot load {fn_name} from {module_name}: {e}") from e
    finally:
        sys.path.pop(0)
    out = fn()
    if not (isinstance(out, tuple) and len(out) == 3 and callable(out[0]) and callable(out[1])):
        raise ValueError(
            f"--model {spec!r}: {fn_name}() must return (make_model, loss_fn, batch): a function building the "
            f"nnx model, loss_fn(model, batch), and the global batch as jax.ShapeDtypeStructs; got {type(out)}"
        )
    make, loss_fn, batch = out
    return Workload(spec, make, loss_fn, batch, f"{spec}: a model of your own")


# ------------------------------------------------------------------------------------------------
# One compilation


@contextlib.contextmanager
def _captured_stderr():
    """What native code writes to stderr while compiling (XLA's log), kept in a list of lines
    and written back afterwards: the estimator's fallbacks are read from it."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", "replace")
            lines.extend(text.splitlines())
            if text.strip():
                sys.stderr.write(text if text.endswith("\n") else text + "\n")


def estimator_of(options: dict, log: list[str], corrections=None) -> str:
    """Which latency estimator XLA:GPU's scheduler ran, from the options the compile got and
    what it logged (a profile-guided one is used whenever a profile is given; the analytical
    estimators are chosen by flags; a failed one falls back to the approximate one), and the
    prices ``xla_costs`` gave it."""
    text = "\n".join(log)
    if options.get("xla_gpu_pgle_profile_file_or_directory_path"):
        return "profile-guided (PGLE), the user's profile"
    if corrections:
        return (
            estimator_of(options, log)
            + f", with {len(corrections.gemms)} fp32-result GEMMs and {len(corrections.copies)} asynchronous"
            " copies repriced by a profile (xla_costs)"
        )
    if "SolLatencyEstimator creation failed" in text or "fallback: using GpuLatencyEstimator" in text:
        return "approximate (GpuLatencyEstimator, fixed costs), the SoL estimator having failed"
    if options.get("xla_gpu_enable_analytical_latency_estimator"):
        return "analytical (AnalyticalLatencyEstimator)"
    if options.get("xla_gpu_enable_analytical_sol_latency_estimator", True):
        return (
            "speed-of-light (SolLatencyEstimator: collectives from their bytes and the interconnect, "
            "kernels from the GPU cost model)"
        )
    return "approximate (GpuLatencyEstimator: fixed costs per kind of op, whatever the bytes)"


def parse_xla_flags(flags: list[str]) -> dict[str, Any]:
    """``--xla_name=value`` strings -> compiler options (``true``/``false`` -> bool, ints)."""
    out: dict[str, Any] = {}
    for f in flags:
        name, eq, value = f.lstrip("-").partition("=")
        if not name.startswith("xla_") or not eq:
            raise ValueError(f"--xla-flag {f!r}: give an XLA option as --xla_name=value")
        low = value.lower()
        out[name] = (
            True
            if low == "true"
            else False
            if low == "false"
            else int(value)
            if re.fullmatch(r"-?\d+", value)
            else value
        )
    return out


def compile_variant(
    work: Workload, mesh, variant: str, options: dict, tx, costs: str = "corrected", keep_layers: int = 1
) -> tuple[Any, Any, list[str], pathlib.Path, Any]:
    """``(compiled, fsdp or None, XLA's log lines, dump folder, xla_costs.Corrections or None)``
    of one variant's step; ``costs``: ``"corrected"`` (``xla_costs.compile``, as the FSDP steps
    compile for GPUs; GSPMD's step alike) or ``"xla"`` (XLA's own prices); ``keep_layers``:
    the FSDP variants' ``FSDP(keep_layers=)``."""
    import jax
    from flax import nnx

    from mxfp8_jax._src.compiled import xla_costs

    model = nnx.eval_shape(work.make)
    dump = pathlib.Path(tempfile.mkdtemp(prefix="mxfp8-gpu-compile-"))
    opts = {"xla_dump_to": str(dump), "xla_dump_latency_hiding_schedule": True, **options}
    fsdp = None
    if variant == "gspmd":
        from mxfp8_jax.bench.fsdp import gspmd_step

        jitted, args = gspmd_step(model, work.loss_fn, mesh, tx, work.batch)
        lowered = jitted.lower(*args)
    else:
        from mxfp8_jax.flax import FSDP

        kwargs: dict = {"xla_costs": costs, "keep_layers": keep_layers}
        if variant == "bf16":
            kwargs["precision"] = "bf16"
        if variant.startswith("mxfp8-gemm"):
            kwargs["gemm"] = "mxfp8"
        if variant.endswith("-32x32"):
            kwargs["weight_blocks"] = "32x32"
        if variant == "mxfp8-p0":
            kwargs["prefetch"] = 0
        fsdp = FSDP(model, mesh, loss_fn=work.loss_fn, example_batch=work.batch, **kwargs)
        lowered = fsdp.lower_train_step(work.loss_fn, tx, fsdp.abstract_state(tx), work.batch)
    with _captured_stderr() as log:
        try:
            if costs == "corrected":
                compiled, corrections = xla_costs.compile(lowered, opts)
            else:
                compiled, corrections = xla_costs.compile_lowered(lowered, opts), None
        except xla_costs.NeedsDevice:
            shutil.rmtree(dump, ignore_errors=True)
            raise
    jax.block_until_ready(())
    return compiled, fsdp, log, dump, corrections


def analyse(compiled, fsdp, dump: pathlib.Path, options: dict, log: list[str], mesh, corrections=None) -> dict:
    """The figures of one compiled step (the command's table row); ``mesh`` the one it was
    compiled for (the replay probes its collectives' latencies on it); ``corrections``: the
    prices ``xla_costs.compile`` gave its scheduler, if any."""
    from mxfp8_jax._src.compiled import hlo, hlo_replay, hlo_schedule
    from mxfp8_jax._src.fsdp import fsdp_table

    text = compiled.as_text()
    mem = compiled.memory_analysis()
    collectives: dict[str, dict] = {}
    for c in hlo_schedule.async_collectives(text):
        runs = c.count or 0
        d = collectives.setdefault(c.op, {"count": 0, "bytes": 0, "async": 0, "sync": 0})
        d["count"] += runs
        d["bytes"] += c.bytes * runs
        d["sync" if c.sync else "async"] += runs
    gathers = [c for c in hlo_schedule.async_collectives(text, "all-gather")]
    eight_bit = sum(c.bytes_of(8) * (c.count or 0) for c in gathers)
    plan = None
    if fsdp is not None:
        n = fsdp.mesh.size // fsdp.tp_size
        plan = int(sum(fsdp_table.gathered_bytes(p, n) for p in fsdp.params if p.kind == "mxfp8"))
    gemms = hlo_schedule.gemms(text)
    by_precision = collections.Counter()
    for g in gemms:
        by_precision[g.precision] += g.count or 0
    dumps = sorted(dump.glob("*.schedule.txt"))
    schedule = dumps[0].read_text() if dumps else ""
    stats = hlo_schedule.schedule_stats(schedule, text) if dumps else []
    estimate = hlo_schedule.step_estimate(stats) if stats else {}
    replayed, pricing = hlo_replay.replay_step(schedule, text, mesh, options) if dumps else (None, None)
    cost = hlo_schedule.cost_analysis(compiled)
    return {
        "memory": {
            "argument_bytes": mem.argument_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes,
            "peak_bytes": mem.argument_size_in_bytes
            + mem.temp_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes,
        },
        "step_options": (fsdp.compiler_options or {}) if fsdp is not None else {},
        "collectives": collectives,
        "all_gather_8bit_bytes": eight_bit,
        "plan_8bit_bytes": plan,
        "gathers": {
            "async": sum(c.count or 0 for c in gathers if not c.sync),
            "sync": sum(c.count or 0 for c in gathers if c.sync),
            "gemm_between": sum(c.count or 0 for c in gathers if c.overlapped),
            "8bit_async": sum(c.count or 0 for c in gathers if not c.sync and c.bytes_of(8)),
            "8bit_gemm_between": sum(c.count or 0 for c in gathers if c.overlapped and c.bytes_of(8)),
        },
        "schedule": {
            "estimator": (
                estimator_of(options, log, corrections) if stats else "none (the latency-hiding scheduler did not run)"
            ),
            "repriced": {"gemms": len(corrections.gemms), "copies": len(corrections.copies)} if corrections else None,
            "step_us": estimate.get("total_us"),
            "all_gather_wasted_us": estimate.get("all_gather_wasted_us", 0.0) if stats else None,
            "reduce_scatter_wasted_us": estimate.get("reduce_scatter_wasted_us", 0.0) if stats else None,
            "gemm_pricing": dataclasses.asdict(pricing) if pricing else None,
            "computations": [dataclasses.asdict(s) for s in stats],
        },
        "replay": replay_summary(replayed) if replayed else None,
        "gemms": {
            "per_step": dict(by_precision),
            "fp32": sum(g.count or 0 for g in gemms if g.fp32),
            # FSDP reads every unit in a shard_map island: its GEMMs carry that in their name
            "fp32_of_units": sum(g.count or 0 for g in gemms if g.fp32 and "shard_map" in g.op_name),
            "block_scaled": sum(g.count or 0 for g in gemms if g.block_scaled),
            "flops": sum(g.flops * (g.count or 0) for g in gemms),
        },
        "custom_calls": dict(collections.Counter(c.target for c in hlo.custom_calls(text))),
        "cost_analysis": cost,
    }


def replay_summary(r) -> dict:
    """The JSON of a replay (``hlo_replay.Result``): the step, exposed time per collective, and
    for the all-gathers how many runs had GEMMs at least as long as their latency between start
    and done, each start's runs listed, and those figures for the weight gathers by pass
    (``hlo_replay.weight_gathers``)."""
    from mxfp8_jax._src.compiled import hlo_replay

    gathers = r.gathers()
    starts: dict[tuple[str, str], dict] = {}
    for g in gathers:
        d = starts.setdefault(
            (g.computation, g.name),
            {
                "computation": g.computation,
                "name": g.name,
                "op_name": g.op_name,
                "bytes": g.nbytes,
                "dtypes": list(g.dtypes),
                "latency_us": g.latency,
                "runs": 0,
                "hidden": 0,
                "gemm_between_us": [],
                "stall_us": [],
            },
        )
        d["runs"] += 1
        d["hidden"] += int(g.hidden)
        d["gemm_between_us"].append(g.gemm_between)
        d["stall_us"].append(g.stall)
    return {
        "step_us": r.step_us,
        "exposed_us": r.exposed_us,
        "gemm_us": r.gemm_us,
        "all_gathers": len(gathers),
        "all_gathers_hidden": sum(g.hidden for g in gathers),
        "weight_gathers": hlo_replay.weight_gathers(gathers),
        "per_computation": r.per_computation,
        "gathers": list(starts.values()),
    }


# ------------------------------------------------------------------------------------------------
# The command


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _us(n) -> str:
    return "-" if n is None else f"{n:,.0f}"


def fsdp_row(r: dict) -> bool:
    return r["variant"] != "gspmd"


def _replay_cells(r: dict | None) -> list[str]:
    if not r:
        return ["-"] * 5
    ag = r["exposed_us"].get("all-gather", 0.0)
    share = f" ({100 * ag / r['step_us']:.1f}%)" if r["step_us"] else ""
    return [
        _us(r["step_us"]),
        _us(ag) + share,
        _us(r["exposed_us"].get("reduce-scatter", 0.0)),
        f"{r['all_gathers_hidden']}/{r['all_gathers']}",
        _by_pass(r.get("weight_gathers") or {}),
    ]


def _by_pass(w: dict) -> str:
    """Weight gather runs hidden by GEMMs, forward / backward, each pass's first left out."""
    cell = lambda p: "-" if p not in w else f"{w[p]['later_hidden']}/{w[p]['later']}"
    return f"{cell('forward')} / {cell('backward')}"


def print_tables(results: list[dict], header: str) -> None:
    from rich.console import Console

    from mxfp8_jax.bench._timing import print_table

    console = Console(width=max(160, Console().width))
    console.print(header)
    rows = []
    for r in results:
        m, g = r["memory"], r["gathers"]
        rows.append(
            [
                r["gpu"],
                r["variant"],
                _gib(m["argument_bytes"]),
                _gib(m["temp_bytes"]),
                _gib(m["peak_bytes"]),
                _mib(r["all_gather_8bit_bytes"]),
                _mib(r["plan_8bit_bytes"]),
                f"{g['gemm_between']}/{g['async']}",
                str(g["sync"]),
                _us(r["schedule"]["step_us"]),
                _us(r["schedule"]["all_gather_wasted_us"]),
                *_replay_cells(r.get("replay")),
            ]
        )
    print_table(
        f"Memory, weight gathers and XLA's estimate per device and step ({NOTE})",
        [
            "gpu",
            "variant",
            "args GiB",
            "temp GiB",
            "peak GiB",
            "8-bit AG MiB",
            "plan's 8-bit MiB",
            "AG w/ GEMM between / async AG",
            "sync AG",
            "XLA est. step µs",
            "XLA AG exposed µs",
            "replayed step µs",
            "replayed AG exposed µs (% of step)",
            "replayed RS exposed µs",
            "AG hidden by GEMMs",
            "weight AG hidden, fwd / bwd, but each pass's first",
        ],
        rows,
        console,
    )
    rows = []
    for r in results:
        c = r["collectives"]
        cell = lambda op: "-" if op not in c else f"{c[op]['count']} ({c[op]['async']} async) {_mib(c[op]['bytes'])}"
        rows.append(
            [
                r["gpu"],
                r["variant"],
                *(
                    cell(op)
                    for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
                ),
            ]
        )
    print_table(
        f"Collectives per step: count (asynchronous), MiB per device ({NOTE})",
        ["gpu", "variant", "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"],
        rows,
        console,
    )
    rows = []
    for r in results:
        gm, cost = r["gemms"], r["cost_analysis"] or {}
        precisions = ", ".join(f"{k} {v}" for k, v in sorted(gm["per_step"].items(), key=lambda kv: -kv[1]))
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["custom_calls"].items()))
        rows.append(
            [
                r["gpu"],
                r["variant"],
                precisions or "-",
                f"{gm['fp32']} ({gm['fp32_of_units']} of units)" if fsdp_row(r) else str(gm["fp32"]),
                str(gm["block_scaled"]),
                f"{gm['flops'] / 1e12:.2f}",
                "-" if cost.get("flops") is None else f"{cost['flops'] / 1e12:.2f}",
                "-" if cost.get("bytes accessed") is None else _gib(cost["bytes accessed"]),
                calls or "-",
            ]
        )
    print_table(
        f"GEMMs per step by operand precision, and the program's custom calls ({NOTE})",
        [
            "gpu",
            "variant",
            "GEMMs",
            "fp32 GEMMs",
            "block-scaled",
            "GEMM TFLOP",
            "cost-analysis TFLOP",
            "cost-analysis GiB",
            "custom calls (as written)",
        ],
        rows,
        console,
    )
    rows = []
    for r in results:
        replayed = (r.get("replay") or {}).get("per_computation", {})
        for c in r["schedule"]["computations"]:
            per_us = c["cycles_per_us"] or 1.0
            mine = replayed.get(c["computation"], {})
            runs = mine.get("runs") or 1
            rows.append(
                [
                    r["gpu"],
                    r["variant"],
                    c["computation"],
                    "?" if c["runs"] is None else str(c["runs"]),
                    _us(c["total_cycles"] / per_us),
                    _us(c["wasted"].get("all_gather", 0.0) / per_us),
                    _us(mine["us"] / runs) if mine else "-",
                    _us(mine.get("all-gather exposed", 0.0) / runs) if mine else "-",
                    _us(mine.get("reduce-scatter exposed", 0.0) / runs) if mine else "-",
                ]
            )
    print_table(
        f"Per scheduled computation, per run: XLA's estimate and the replay ({NOTE})",
        [
            "gpu",
            "variant",
            "computation",
            "runs per step",
            "XLA est. µs",
            "XLA AG exposed µs",
            "replayed µs (loops inside)",
            "replayed AG exposed µs",
            "replayed RS exposed µs",
        ],
        rows,
        console,
    )
    estimators = sorted({r["schedule"]["estimator"] for r in results})
    console.print("Latency estimator: " + "; ".join(estimators))
    console.print(
        "AG w/ GEMM between: asynchronous all-gathers with a GEMM scheduled between start and done "
        "(mxfp8_jax._src.compiled.hlo_schedule); exposed µs: the scheduler's wasted cycles (µs), loop bodies "
        "times their trip counts; cost analysis: XLA's HLO cost analysis of the optimized module (loop "
        "bodies counted once, library GEMMs without FLOPs); GEMM TFLOP: from the GEMMs' shapes, loops unrolled. "
        "Replayed: XLA's schedule walked on one compute and one collective stream (mxfp8_jax._src.compiled."
        "hlo_replay) with each GEMM of 16-bit operands and an fp32 result that XLA priced above its FLOPs at the "
        "rate of those with a 16-bit result repriced so (XLA's cost model prices many about 60x slower), "
        "asynchronous copies at no cost (the estimator gives each a fixed 5000 cycles, which makes every loop "
        "body at least that long), and "
        "collective latencies probed alone on the same mesh; AG hidden by GEMMs: gather runs with at least their "
        "latency of GEMM time between start and done, of all gather runs; weight AG: the runs of gathers of at least "
        "1 MiB (weights: units' planes, bf16 or fp32 weights; not a norm's scale) so hidden, of those runs, "
        "forward and backward (a recomputed forward runs in the backward), each pass's first run (nothing of its "
        "pass before it) left out."
    )


def kernels_run(capability: str | None) -> bool | None:
    """Whether the installed CUDA module has code for a GPU of ``capability`` (None: no CUDA
    module, or the capability is unknown). A compile-only mesh has no device to check it
    against at dispatch, so the program calls the kernel whatever the module holds."""
    from mxfp8_jax._src.kernels import _ffi

    archs = _ffi.architectures("cuda")
    if not archs or not capability:
        return None
    return _ffi.arch_runs(archs, capability, "cuda")


def run(args) -> list[dict]:
    import jax
    import optax

    from mxfp8_jax._src.compiled import xla_costs
    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax._src.tooling import gpu_targets

    gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"--variants {args.variants!r}: choose from {VARIANTS}")
    options = parse_xla_flags(args.xla_flag or [])
    if ":" in args.model:
        work = user_workload(args.model)
    else:
        work = builtin_workload(
            args.model,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            mlp=args.mlp,
            vocab=args.vocab,
            seq=args.seq,
            tokens_per_device=args.tokens_per_device,
            devices=args.devices,
            remat=args.remat,
        )
    configs = {g: gpu_targets.target_config(g, args.target_config) for g in gpus}
    tx = optax.adamw(1e-4)
    kernels = ", ".join(_ffi.available_backends()) or "none"
    results, notes, skipped = [], [], []
    from rich.progress import Progress

    with Progress(transient=False) as bar:
        task = bar.add_task("gpu-compile", total=len(gpus) * len(variants))
        for gpu in gpus:
            desc = gpu_targets.describe(configs[gpu])
            runs = kernels_run(desc["compute_capability"])
            if runs is False:
                notes.append(
                    f"{gpu}: the installed _mxfp8_cuda is built for {_ffi.architectures('cuda')}: no code for this GPU "
                    f"(compute capability {desc['compute_capability']}); the program compiled here calls the kernel, a "
                    "run there would fall back to the pure-JAX quantize (the same bytes, slower). Rebuild with "
                    "CMAKE_ARGS=-DMXFP8_CUDA_ARCHS=... (a default install builds every target)"
                )
            mesh = gpu_targets.topology_mesh(configs[gpu], args.devices, hosts=args.hosts)
            for variant in variants:
                bar.update(task, description=f"{gpu} {variant}: compiling")
                t0 = time.perf_counter()
                try:
                    compiled, fsdp, log, dump, corrections = compile_variant(
                        work, mesh, variant, options, tx, args.xla_costs, args.keep_layers
                    )
                except xla_costs.NeedsDevice as e:  # the other variants still compile
                    skipped.append({"gpu": gpu, "variant": variant, "reason": str(e)})
                    notes.append(f"{gpu} {variant}: not compiled here: {e}")
                    bar.advance(task)
                    continue
                seconds = time.perf_counter() - t0
                bar.update(task, description=f"{gpu} {variant}: replaying the schedule")
                row = analyse(compiled, fsdp, dump, options, log, mesh, corrections)
                row.update(
                    gpu=gpu,
                    device=desc["name"],
                    compute_capability=desc["compute_capability"],
                    variant=variant,
                    devices=args.devices,
                    hosts=args.hosts,
                    keep_layers=None if variant == "gspmd" else args.keep_layers,
                    compile_s=seconds,
                    kernels_run_on_target=runs,
                    dump=str(dump) if args.keep_dumps else None,
                )
                if not args.keep_dumps:
                    shutil.rmtree(dump, ignore_errors=True)
                results.append(row)
                bar.advance(task)
    header = (
        f"{work.description}\n{args.devices} GPUs ({args.hosts} host(s)), adamw; FSDP keep_layers={args.keep_layers}; "
        f"jax {jax.__version__}; "
        f"mxfp8 kernels built: {kernels}; extra XLA options: {options or 'none'}"
    )
    own = next((r["step_options"] for r in results if r.get("step_options")), None)
    if own:
        header += f"\nFSDP steps' own XLA options (gspmd: XLA's defaults): {own}"
    print_tables(results, header)
    for note in notes:
        print(note)
    if args.json:
        from mxfp8_jax.bench._timing import write_json

        write_json(
            args.json,
            {
                "command": "gpu-compile",
                "note": NOTE,
                "workload": work.description,
                "options": options,
                "results": results,
                "not_compiled": skipped,
            },
        )
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mxfp8-jax gpu-compile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpu", default="h100", help="comma-separated: h100, h200, b200, b300, gb200, a100 (default h100)")
    p.add_argument("--target-config", help="a GpuTargetConfigProto text file to compile for instead of --gpu's")
    p.add_argument("--devices", type=int, default=8, help="GPUs in the mesh, all FSDP (default 8)")
    p.add_argument("--hosts", type=int, default=1, help="hosts they sit on (default 1)")
    p.add_argument("--model", default="transformer", help=f"{', '.join(MODELS)}, or module:function (see above)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=None, help="default hidden / 128")
    p.add_argument("--mlp", type=int, default=None, help="default 4 * hidden")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--tokens-per-device", type=int, default=4096)
    p.add_argument(
        "--no-remat", dest="remat", action="store_false", help="the builtin model's blocks without nnx.remat"
    )
    p.add_argument(
        "--variants",
        default="mxfp8,mxfp8-gemm,bf16,gspmd",
        help=f"subset of {','.join(VARIANTS)}",
    )
    p.add_argument(
        "--xla-flag", action="append", help="an XLA option for the compile, --xla-flag=--xla_name=value (repeatable)"
    )
    from mxfp8_jax._src.fsdp.fsdp_plan import XLA_COSTS

    p.add_argument(
        "--xla-costs",
        choices=XLA_COSTS,
        default="corrected",
        help="the scheduler's prices: corrected (default: as FSDP's GPU steps compile, GSPMD's alike; "
        "see xla_costs) or xla (XLA's cost model as it is)",
    )
    p.add_argument(
        "--keep-layers",
        type=int,
        default=1,
        help="the FSDP variants' keep_layers: a remat scan's last layers whose forward-gathered weights "
        "serve their backward (default 1, as FSDP's)",
    )
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--keep-dumps", action="store_true", help="keep XLA's dump folders (the schedule, the HLO)")
    return p


def main(argv=None) -> int:
    from mxfp8_jax._src.tooling import gpu_targets

    gpu_targets.ensure_compile_only()  # before jax starts its backends
    p = parser()
    args = p.parse_args(argv)
    try:
        run(args)
    except (ValueError, gpu_targets.TargetError) as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
