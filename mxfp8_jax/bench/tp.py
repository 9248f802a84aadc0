"""Sequence/tensor parallelism: the transformer's step time with the fused all-gather + RMSNorm
+ MXFP8 quantize, with the unfused path, and with FSDP alone, in one run.

    python -m mxfp8_jax.bench.tp [--hidden 256] [--layers 2] [--seq 128] [--batch 16]
                                 [--devices 8] [--tp 2] [--iters 5] [--json out.json]

The model is ``mxfp8_jax.models.TransformerLM`` with ``norm="mxfp8"`` (its norms are MXFP8
RMSNorm + quantize ops), trained with adam. Cases, all with the same weights and batch:

- ``fused``: ``(devices/tp, tp)`` mesh, each norm ``allgather_rmsnorm_quant`` over tp (strategy
  ``"auto"``: ``"p2p"`` on one CPU host), column/row-parallel projections;
- ``unfused``: the same, each norm ``lax.all_gather`` of the bf16 rows then the local op;
- ``fsdp``: ``(devices,)`` mesh, FSDP alone: no tp, the local ``rmsnorm_quant``.

Per case: the median step time after one warm-up step, compile time, per-device temp memory
and the bytes each collective kind moves per step (read from the compiled HLO), and the ratio of
each step time to the ``fused`` one. The fused op must be the compiled kernel: a missing
extension is an error, never a silent fallback.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

CASES = ("fused", "unfused", "fsdp")


def run(hidden: int, layers: int, seq: int, batch: int, devices: int, tp: int, iters: int, json_path=None) -> dict:
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from mxfp8_jax import models
    from mxfp8_jax._src.compiled import hlo
    from mxfp8_jax._src.core import platforms
    from mxfp8_jax._src.kernels import _ffi
    from mxfp8_jax.bench._timing import environment, print_table, time_fn, write_json
    from mxfp8_jax.flax import FSDP

    devs = jax.devices()[:devices]
    platform = platforms.of_device(devs[0])  # 'cuda'/'rocm', not jax's 'gpu'
    if not _ffi.has_target("mxfp8_allgather_rmsnorm_quantize", platform):
        raise SystemExit(f"the fused op's kernel is not installed for {platform}: nothing to measure")
    cfg = models.TransformerConfig(
        vocab=256, hidden=hidden, heads=hidden // 64, head_dim=64, mlp=4 * hidden, layers=layers, norm="mxfp8"
    )
    model = models.init_transformer(cfg, seed=0)
    tokens = next(models.SequenceTask(cfg.vocab, seq + 1, seed=1).batches(1, batch))
    pairs = models.next_token_pairs(tokens)
    tx = optax.adam(1e-3)
    results = {}
    for case in CASES:
        if case == "fsdp":
            fsdp = FSDP(model, Mesh(np.array(devs), ("fsdp",)))
            m = model
        else:
            m = models.init_transformer(dataclasses.replace(cfg, norm_path=case), seed=0)
            fsdp = FSDP(m, Mesh(np.array(devs).reshape(devices // tp, tp), ("fsdp", "tp")), tp_axis="tp")
        state = fsdp.init(m, tx)
        t0 = time.perf_counter()
        compiled = fsdp.lower_train_step(models.next_token_loss, tx, state, pairs).compile()
        compile_s = time.perf_counter() - t0
        text = compiled.as_text()
        placed = fsdp.place_batch(pairs)
        box = [state]

        def step(compiled=compiled, placed=placed, box=box):
            box[0], loss = compiled(box[0], placed)
            return loss

        seconds = time_fn(step, warmup=1, iters=iters)
        by_op = hlo.bytes_by_op(text)
        fused_calls = sum(c.target == "mxfp8_allgather_rmsnorm_quantize" for c in hlo.custom_calls(text))
        results[case] = {
            "step_s": seconds,
            "compile_s": compile_s,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "bytes_by_op": by_op,
            "fused_calls": fused_calls,
        }
    base = results["fused"]["step_s"]
    rows = []
    for case, r in results.items():
        r["vs_fused"] = r["step_s"] / base
        mib = lambda op, r=r: f"{r['bytes_by_op'].get(op, 0) / 2**20:.2f}"
        rows.append(
            (
                case,
                f"{1e3 * r['step_s']:.1f}",
                f"{r['vs_fused']:.2f}",
                f"{r['compile_s']:.1f}",
                f"{r['temp_bytes'] / 2**20:.1f}",
                r["fused_calls"],
                mib("all-gather"),
                mib("reduce-scatter"),
                mib("all-to-all"),
                mib("all-reduce"),
            )
        )
    title = (
        f"transformer step, hidden {hidden}, {layers} layers, seq {seq}, batch {batch}, {devices} {platform} "
        f"devices (tp={tp} for fused/unfused)"
    )
    print_table(
        title,
        (
            "case",
            "step ms",
            "vs fused",
            "compile s",
            "temp MiB",
            "fused calls",
            "all-gather MiB",
            "reduce-scatter MiB",
            "all-to-all MiB",
            "all-reduce MiB",
        ),
        rows,
    )
    payload = {
        "config": dict(hidden=hidden, layers=layers, seq=seq, batch=batch, devices=devices, tp=tp, iters=iters),
        "environment": environment(),
        "results": results,
    }
    write_json(json_path, payload)
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mxfp8_jax.bench.tp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=256, help="model width, a multiple of 64 (default 256)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--devices", type=int, default=8, help="devices (default 8)")
    p.add_argument("--tp", type=int, default=2, help="tp degree of the fused/unfused cases (default 2)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--json", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    if args.hidden % 64 or args.hidden < 64:
        p.error(f"--hidden={args.hidden} must be a positive multiple of 64")
    if args.devices % args.tp or args.seq % args.tp or args.batch % (args.devices // args.tp):
        p.error("--tp must divide --devices and --seq; devices/tp must divide --batch")
    if args.batch % args.devices:
        p.error(f"--batch={args.batch} must be divisible by --devices={args.devices} (the fsdp case)")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:
        pass
    run(args.hidden, args.layers, args.seq, args.batch, args.devices, args.tp, args.iters, args.json)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
