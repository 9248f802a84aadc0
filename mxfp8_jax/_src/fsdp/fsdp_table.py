"""The FSDP plan as a table (``print(fsdp)``): every parameter, what it became and why, its
bytes stored per device and gathered per step, the totals, and how the units multiply.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mxfp8_jax._src.fsdp.fsdp_plan import KINDS, ParamInfo, Plan
from mxfp8_jax._src.fsdp.fsdp_trace import describe_shape

_BACKWARD = {
    "auto": "fp32 where lowered for CPUs, the layer's dtype (fp32 accumulation) for GPUs",
    "fp32": "fp32 operands",
    "layer": "the layer's dtype, fp32 accumulation",
}


def summary(plan: Plan) -> str:
    """The plan's table (``describe``) and, on its last line, how the units multiply on the
    platform of its mesh."""
    topology = plan.topology
    table = describe(plan.params, topology.fsdp_size, traced=plan.traced, trainable=plan.trainable)
    capability = topology.capability
    where = f"{topology.platform} mesh" + (f", compute capability {capability}" if capability else "")
    line = f"GEMMs ({where}): forward in the layer's dtype; dgrad and wgrad: {_BACKWARD[plan.gemms.backward]}"
    if plan.gemms.mxfp8 is not None:
        path = plan.gemms.mxfp8.path
        line += f"; MXFP8 units' GEMMs in MXFP8, path {path}" + (" (by lowering platform)" if path == "auto" else "")
    lines = [table, line]
    if plan.constraints:
        lines.append(constraints_line(plan.constraints, plan.model_constraints))
    return "\n".join(lines)


def constraints_line(constraints, mode: str) -> str:
    """What the model's own sharding constraints that replicate the batch split cost, or that the
    step drops them (``model_constraints``)."""
    n = len(constraints)
    head = (
        f"model sharding constraints: {n} replicate activations the step splits over the batch; the first "
        f"{constraints[0].describe()}"
    )
    if mode == "drop":
        return head + ". Dropped (model_constraints='drop'): the batch split carries through them"
    total = sum(c.nbytes for c in constraints)
    return (
        head + f". Kept: each all-gathers its activation to every device ({_fmt(total)} for one run of each), and "
        "the ops after it run on the whole batch on every device; FSDP(..., model_constraints='drop') ignores them"
    )


def describe(infos, mesh_size: int, *, traced: bool, trainable=None) -> str:
    """``print(fsdp)``: every parameter with what it became, stored bytes per device, bytes
    gathered per step, and totals (those of the frozen parameters on a line of their own,
    ``trainable`` naming the filter that left them out)."""
    rows = []
    for p in infos:
        rows.append(
            (
                p.name,
                describe_shape(p.shape),
                _what(p),
                _fmt(stored_bytes(p, mesh_size)),
                _fmt(gathered_bytes(p, mesh_size)) + (" a while trip" if p.in_while else ""),
                p.reason,
            )
        )
    header = ("parameter", "shape", "kind", "stored/device", "gathered/step", "why")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    total = lambda kinds: sum(int(np.prod(p.shape)) * 4 for p in infos if p.kind in kinds and p.trained)
    model = total(("mxfp8", "bf16", "plain"))
    out = [
        f"FSDP plan over {mesh_size} devices ("
        + ("units found by tracing the loss" if traced else "units found by layer class: no example batch was traced")
        + ")",
        line(header),
        line(tuple("-" * w for w in widths)),
        *map(line, rows),
        "",
    ]
    by_kind = {k: sum(1 for p in infos if p.kind == k) for k in KINDS}
    unit_bytes = total(("mxfp8", "bf16"))
    out.append(
        "parameters: "
        + ", ".join(f"{by_kind[k]} {k}" for k in KINDS if by_kind[k])
        + f"; units hold {unit_bytes / max(model, 1):.1%} of the {_fmt(model)} of trained fp32 parameters"
    )
    out.append(
        f"per device: {_fmt(sum(stored_bytes(p, mesh_size) for p in infos))} stored (masters, planes, plain "
        f"slices; optimizer state not included), {_fmt(sum(gathered_bytes(p, mesh_size) for p in infos))} "
        "gathered per step (each GEMM forward and backward, each lookup, each rematerialised read; XLA drops "
        "the backward gather of a GEMM whose input needs no gradient)"
    )
    frozen = [p for p in infos if not p.trained]
    if frozen:
        units = [p for p in frozen if p.is_unit]
        label = "" if trainable is None else f" (trainable={trainable!r} leaves them out)"
        out.append(
            f"frozen{label}: {len(frozen)} parameters, {len(units)} of them units "
            f"({sum(p.kind == 'mxfp8' for p in units)} mxfp8, {sum(p.kind == 'bf16' for p in units)} bf16); "
            f"{_fmt(sum(stored_bytes(p, mesh_size) for p in frozen))} stored per device in their own dtypes "
            "(with the planes), 0 optimizer state, no gradient"
        )
    return "\n".join(out)


def _what(p: ParamInfo) -> str:
    if p.unit is None:
        if p.kind == "plain" and p.gathers == 0 and p.reason.startswith("unused"):
            return "unused (plain fp32)"
        if p.kind == "plain":
            return "plain fp32" + ("" if p.shard_axis is not None else ", whole on every device")
        return p.kind
    g = p.unit
    stack = f"{describe_shape(g.stack)} x " if g.stack else ""
    tp = f", {p.tp}-parallel" if p.tp else ""
    frozen = "" if p.trained else ", frozen"
    tiles = ", 32x32 blocks" if p.kind == "mxfp8" and g.tiled else ""
    return f"{p.kind} {p.role} {stack}N={g.out_features} K={g.in_features}{tiles}{tp}{frozen}"


def stored_bytes(p: ParamInfo, n: int) -> int:
    """Bytes one device stores for ``p`` (master, planes; optimizer state not included). A
    frozen unit's rows are in the parameter's own dtype instead of fp32."""
    if p.kind == "frozen":
        return int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize
    if p.unit is None:
        whole = int(np.prod(p.shape)) * 4
        return whole if p.shard_axis is None else whole // n
    elements = int(np.prod(p.stored_shape)) // (p.unit.num_shards * p.tp_size)
    master = 4 if p.trained else jnp.dtype(p.dtype).itemsize
    if p.kind == "mxfp8":  # master rows + its planes (two of 1x32 blocks, or one of 32x32)
        return elements * (master + (1 if p.unit.tiled else 2) * p.unit.plane_bytes)
    return elements * master


def gathered_bytes(p: ParamInfo, n: int) -> int:
    """Bytes gathered into one device per step for ``p`` (its whole stack), from the reads the
    trace found (``ParamInfo.gathers``): each GEMM once forward and once backward, each lookup
    once, each read inside a rematerialised region once more, each as many times as the loops
    around it run, of the layer it reads. A read in a ``cond`` branch counts as if taken."""
    if p.kind == "frozen":
        return 0
    if p.unit is None:
        if p.shard_axis is None:
            return 0
        return int(int(np.prod(p.shape)) * 4 * p.gathers)
    g = p.unit
    per_gather = int(np.prod(g.padded_shape())) * (g.plane_bytes if p.kind == "mxfp8" else 2)
    return int(per_gather * p.gathers)


def _fmt(b: float) -> str:
    if b < 1024:
        return f"{b:.0f} B"
    for unit in ("KiB", "MiB"):
        b /= 1024
        if b < 1024:
            return f"{b:.1f} {unit}"
    return f"{b / 1024:.1f} GiB"
