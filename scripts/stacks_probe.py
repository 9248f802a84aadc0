"""Layer stacks read by index, and frozen weights: what FSDP makes of them, and what the compiled
step costs as the model deepens.

For every model and ``loop=`` form of ``mxfp8_jax.bench.styles.stacked_styles`` (weights stacked
and read by index under ``lax.fori_loop`` / a Python loop / ``lax.scan``; blocks skipped by
``lax.cond``; ``nnx.LoRA`` adapters; base kernels in a custom ``nnx.Variable``; one block shared
by every layer), at two depths, on simulated CPU devices (``--devices``, default 8):

  ``FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch)`` (the LoRA models with
  ``trainable=nnx.LoRAParam``), one sequence of ``--seq`` tokens per device and wide layers
  (``--width``, ``--mlp``) so that the weights, not the activations, grow with depth, the
  adamw step compiled on
  ``fsdp.abstract_state(tx)`` (nothing materialised), and from it:

  - ``temp``: ``compiled.memory_analysis().temp_size_in_bytes`` at each depth;
  - ``bytes``: the model's fp32 bytes (4 x size of every floating ``nnx.Variable``: Params,
    LoRAParams and frozen bases alike);
  - ``growth``: ``(temp_hi - temp_lo) / (bytes_hi - bytes_lo)``: how much temp memory each byte
    of added layers costs (near 0: flat in depth; near 1 or more: the step holds whole layers);
  - the HLO's all-gather / all-reduce / reduce-scatter bytes per device per step (loops counted
    once per iteration, ``compiled.hlo.bytes_by_op``), to see whether a frozen base is gathered
    or all-reduced;
  - what the plan made of each parameter (``fsdp.params``: kind, role, level, reason; layer
    indices of Python-loop models collapsed to ``*``) and the totals line of ``str(fsdp)``.

A failure (an exception from ``FSDP``, lowering or compiling) is printed in its row as the error's
first line; the run goes on.

    python scripts/stacks_probe.py                      # markdown tables on stdout
    python scripts/stacks_probe.py --json /tmp/s.json   # and the numbers as JSON
    python scripts/stacks_probe.py --depths 2,6 --only stacked,lora
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

BATCH, SEQ = 8, 8  # BATCH: one sequence per device (set from --devices); short sequences
WIDTH, MLP = 256, 512  # wide layers: the weights, not the activations, grow with depth


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {line}"[:300]


def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


def main() -> None:
    global BATCH, SEQ
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--depths", default="2,8", help="two depths, comma-separated (default 2,8)")
    parser.add_argument("--only", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the numbers here as JSON")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"hidden width D (default {WIDTH})")
    parser.add_argument("--mlp", type=int, default=MLP, help=f"MLP width F (default {MLP})")
    parser.add_argument("--seq", type=int, default=SEQ, help=f"tokens per sequence (default {SEQ})")
    args = parser.parse_args()
    depths = tuple(int(d) for d in args.depths.split(","))
    if len(depths) != 2 or depths[0] >= depths[1]:
        parser.error("--depths takes two increasing depths, e.g. 2,8")

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from mxfp8_jax._src.compiled import hlo
    from mxfp8_jax.bench.styles import stacked_styles as ss
    from mxfp8_jax.flax import FSDP

    n = len(jax.devices())
    BATCH, SEQ = n, args.seq
    mesh = jax.make_mesh((n,), ("fsdp",))
    notes: list[str] = []
    names = [s for s in args.only.split(",") if s] or list(ss.MODELS)
    tx = optax.adamw(1e-3)
    sds = jax.ShapeDtypeStruct
    batch = (sds((BATCH, SEQ), jnp.int32), sds((BATCH, SEQ), jnp.int32))

    def floating_bytes(model) -> tuple[int, int]:
        """(all floating variables, frozen bases: FrozenWeight values and LoRA base kernels)."""
        total = frozen = 0
        for path, var in nnx.to_flat_state(nnx.state(model)):
            value = var.get_value()
            if not jnp.issubdtype(value.dtype, jnp.floating):
                continue
            b = 4 * int(np.prod(value.shape))
            total += b
            name = "/".join(map(str, path))
            if isinstance(var, ss.FrozenWeight) or "base_module" in name:
                frozen += b
        return total, frozen

    def compact_plan(params) -> list[str]:
        """``name:kind[/role][@level]`` per parameter, layer indices collapsed (``x N``)."""
        seen: dict[str, int] = {}
        for p in params:
            name = re.sub(r"(^|/)\d+(?=/|$)", r"\1*", p.name)
            tag = f"{name}:{p.kind}" + (f"/{p.role}" if p.role else "") + (f"@{p.level}" if p.level else "")
            tag += "" if getattr(p, "trained", True) else "(not trained)"
            seen[tag] = seen.get(tag, 0) + 1
        return [t + (f" x{c}" if c > 1 else "") for t, c in seen.items()]

    def detail_plan(params) -> list[dict]:
        seen: dict[tuple, dict] = {}
        for p in params:
            name = re.sub(r"(^|/)\d+(?=/|$)", r"\1*", p.name)
            trained = getattr(p, "trained", None)  # absent before the plan knew frozen units
            key = (name, p.kind, p.role, p.level, p.reason, trained)
            if key in seen:
                seen[key]["count"] += 1
            else:
                seen[key] = dict(
                    name=name,
                    kind=p.kind,
                    role=p.role,
                    level=p.level,
                    reason=p.reason,
                    trained=trained,
                    count=1,
                    shape=list(p.shape),
                )
        return list(seen.values())

    def per_device_bytes(tree) -> int:
        """Bytes one device holds of the abstract arrays in ``tree`` (from their shardings)."""
        total = 0
        for leaf in jax.tree.leaves(tree):
            shape = tuple(leaf.shape)
            sharding = getattr(leaf, "sharding", None)
            if sharding is not None:
                shape = tuple(sharding.shard_shape(shape))
            total += int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize
        return total

    def unsharded_temp(model) -> int:
        """Temp bytes of the model's own gradient step (plain jax, no optimizer), unsharded on
        one device with one device's share of the batch: its activations and working set."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def grads(params, rest, b):
            return jax.grad(lambda p: ss.loss_fn(nnx.merge(graphdef, p, rest, copy=True), b))(params)

        local = (sds((max(1, BATCH // n), SEQ), jnp.int32),) * 2
        return int(jax.jit(grads).lower(params, rest, local).compile().memory_analysis().temp_size_in_bytes)

    def measure(name: str, loop: str, depth: int) -> dict:
        cfg = ss.StackConfig(depth=depth, width=args.width, mlp=args.mlp)
        out: dict = {"depth": depth}
        model = nnx.eval_shape(lambda: ss.build(name, cfg, 0, loop=loop))
        out["model_bytes"], out["frozen_base_bytes"] = floating_bytes(model)
        try:
            out["ref_temp"] = unsharded_temp(model)
        except Exception as err:  # noqa: BLE001
            out["ref_error"] = first_line(err)
        kwargs = {"trainable": nnx.LoRAParam} if name == "lora" else {}
        t0 = time.perf_counter()
        stage = "FSDP(...)"
        try:
            fsdp = FSDP(model, mesh, loss_fn=ss.loss_fn, example_batch=batch, **kwargs)
            out["plan"] = detail_plan(fsdp.params)
            out["plan_compact"] = compact_plan(fsdp.params)
            out["totals"] = [ln for ln in str(fsdp).splitlines() if ln.startswith(("parameters:", "per device:"))]
            stage = "abstract_state"
            state = fsdp.abstract_state(tx)
            out["state_bytes_per_device"] = per_device_bytes(state)
            out["rest_bytes_per_device"] = per_device_bytes(state.rest)
            stage = "lower_train_step"
            lowered = fsdp.lower_train_step(ss.loss_fn, tx, state, batch)
            stage = "compile"
            compiled = lowered.compile()
            out["temp"] = int(compiled.memory_analysis().temp_size_in_bytes)
            text = compiled.as_text()
            stage = "hlo.bytes_by_op"
            out["collective_bytes"] = hlo.bytes_by_op(text)
            out["collective_counts"] = hlo.counts_by_op(text)
            out["all_reduces"] = [
                dict(outputs=[f"{d}{list(sh)}" for d, sh in c.outputs], loop_depth=c.loop_depth, count=c.count)
                for c in hlo.collectives(text)
                if c.op == "all-reduce"
            ]
        except Exception as err:  # noqa: BLE001 (a row per failure)
            out["error"] = f"[{stage}] {first_line(err)}"
            out["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out

    start = time.perf_counter()
    results = []
    for name in names:
        for loop in ss.loops(name):
            row = {"model": name, "cls": ss.MODELS[name].__name__, "loop": loop, "runs": []}
            for depth in depths:
                print(f"[stacks_probe] {row['cls']} loop={loop} depth={depth} ...", file=sys.stderr, flush=True)
                r = measure(name, loop, depth)
                row["runs"].append(r)
                status = r.get("error") or f"temp {fmt_bytes(r.get('temp'))}"
                print(f"[stacks_probe]   {r['seconds']} s: {status}", file=sys.stderr, flush=True)
            lo, hi = row["runs"]
            if "temp" in lo and "temp" in hi:
                db = hi["model_bytes"] - lo["model_bytes"]
                dt = hi["temp"] - lo["temp"]
                row["temp_delta"] = dt
                row["growth"] = dt / db if db else None
            if "ref_temp" in lo and "ref_temp" in hi:
                db = hi["model_bytes"] - lo["model_bytes"]
                row["ref_temp_delta"] = hi["ref_temp"] - lo["ref_temp"]
                row["ref_growth"] = row["ref_temp_delta"] / db if db else None
            results.append(row)
    elapsed = time.perf_counter() - start

    # -- the tables --------------------------------------------------------------------------------
    lo_d, hi_d = depths
    print(
        f"# stacks_probe: {n} simulated CPU devices, batch {BATCH}x{SEQ}, depths {lo_d} and {hi_d}, "
        f"optax.adamw(1e-3), jax {jax.__version__}\n"
    )
    for note in notes:
        print(f"Note: {note}\n")

    def growth_cell(row, key, delta_key) -> str:
        if row.get(key) is not None:
            return f"{row[key]:.2f}"
        if delta_key in row:
            return f"n/a (Δtemp {fmt_bytes(row[delta_key])})"
        return "-"

    head = [
        "model",
        "loop",
        f"temp@{lo_d}",
        f"temp@{hi_d}",
        f"bytes@{lo_d}",
        f"bytes@{hi_d}",
        "growth",
        "ref growth",
        f"state/dev@{hi_d}",
        f"AG@{hi_d}",
        f"AR@{hi_d}",
        f"RS@{hi_d}",
        "error",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in results:
        lo, hi = row["runs"]
        cb = hi.get("collective_bytes", {})
        errs = "; ".join(f"d{r['depth']}: {r['error']}" for r in row["runs"] if "error" in r)
        cells = [
            row["cls"],
            row["loop"],
            fmt_bytes(lo.get("temp")),
            fmt_bytes(hi.get("temp")),
            fmt_bytes(lo["model_bytes"]),
            fmt_bytes(hi["model_bytes"]),
            growth_cell(row, "growth", "temp_delta"),
            growth_cell(row, "ref_growth", "ref_temp_delta"),
            fmt_bytes(hi.get("state_bytes_per_device")),
            fmt_bytes(cb.get("all-gather", 0)) if cb else "-",
            fmt_bytes(cb.get("all-reduce", 0)) if cb else "-",
            fmt_bytes(cb.get("reduce-scatter", 0)) if cb else "-",
            errs.replace("|", "\\|"),
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        "\ngrowth: (temp@hi - temp@lo) / (bytes@hi - bytes@lo) of the FSDP step; ref growth: the same for the "
        f"model's own gradient step unsharded on one device with one device's batch ({max(1, BATCH // n)}x{SEQ}), "
        "i.e. what its activations alone cost per added parameter byte. n/a: the parameters do not grow with "
        "depth (Δtemp shown). state/dev: the TrainState bytes one device holds (masters, planes, optimizer "
        "state, rest). Collective bytes per device per step, loops unrolled; a collective inside a lax.cond "
        "branch counts once, whether the branch runs or not."
    )

    print("\n## Collectives per device per step (bytes), and frozen bases\n")
    print(
        "| model | loop | depth | frozen base fp32 | rest/dev | all-gather | all-reduce | reduce-scatter | "
        "all-reduce ops (outputs, loop depth, runs) | other |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for r in row["runs"]:
            cb = dict(r.get("collective_bytes", {}))
            if not cb and "error" in r:
                continue
            other = (
                ", ".join(
                    f"{k} {fmt_bytes(v)}"
                    for k, v in cb.items()
                    if k not in ("all-gather", "all-reduce", "reduce-scatter")
                )
                or "-"
            )
            ars = (
                ", ".join(
                    f"{'+'.join(a['outputs'])} d{a['loop_depth']} x{a['count']}" for a in r.get("all_reduces", [])
                )
                or "-"
            )
            print(
                f"| {row['cls']} | {row['loop']} | {r['depth']} | {fmt_bytes(r['frozen_base_bytes'])} | "
                f"{fmt_bytes(r.get('rest_bytes_per_device'))} | "
                f"{fmt_bytes(cb.get('all-gather', 0))} | {fmt_bytes(cb.get('all-reduce', 0))} | "
                f"{fmt_bytes(cb.get('reduce-scatter', 0))} | {ars} | {other} |"
            )

    print(f"\n## Plans at depth {hi_d} (name:kind[/role][@level], layer indices as *)\n")
    for row in results:
        hi = row["runs"][1]
        print(f"### {row['cls']} loop={row['loop']}")
        if "plan" not in hi:
            print(f"- no plan: {hi.get('error')}\n")
            continue
        for p in hi["plan"]:
            count = f" (x{p['count']})" if p["count"] > 1 else ""
            role = f" {p['role']}" if p["role"] else ""
            reason = f": {p['reason']}" if p["reason"] else ""
            trained = {True: ", trained", False: ", NOT trained", None: ""}[p["trained"]]
            print(f"- `{p['name']}` {p['shape']}{count}: {p['kind']}{role}, level {p['level']}{trained}{reason}")
        for line in hi.get("totals", []):
            print(f"- {line}")
        if "error" in hi:
            print(f"- step: {hi['error']}")
        print()
    print(f"run time: {elapsed:.0f} s")

    if args.json:
        payload = {
            "devices": n,
            "batch": [BATCH, SEQ],
            "depths": list(depths),
            "notes": notes,
            "width": args.width,
            "mlp": args.mlp,
            "seconds": round(elapsed, 1),
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)


if __name__ == "__main__":
    main()
