"""The loss evaluated inside an FSDP step, with each parameter as this device's shards.

``FSDP`` traces ``loss_fn(model, batch)`` to a jaxpr and evaluates it op by op here, with every
parameter bound to what this device holds instead of its value:

- a unit (``UnitValue``): its local master rows and MXFP8 planes. Layout ops on it (the
  layer's casts, transposes, reshapes) are recorded, not run; the op that reads it (a GEMM, a
  lookup) becomes that op's unit ``custom_vjp`` (``fsdp_unit``), which gathers the weight just
  in time and drops it after.
- a plain parameter (``PlainValue``): its local slice. The first op that reads it all-gathers
  it, after that op's other operand exists (so a layer's norm scale is gathered when the layer
  runs); the gather's transpose reduce-scatters its gradient.

Every other op runs as traced. ``scan`` bodies are evaluated the same way, one layer at a time
(the stacked shards of units and plain parameters are the scan's inputs, sliced like the
weights they stand for); ``jit`` calls are inlined; a rematerialised region (``nnx.remat``,
``jax.checkpoint`` without a policy) becomes a ``custom_vjp`` that saves its inputs and, in the
backward, recomputes it after the cotangent arrives: a data dependency, so XLA can neither run
the recomputed gathers early nor merge them with the forward's (XLA:CPU expands the
optimization barriers of ``jax.checkpoint`` before common-subexpression elimination).
A region with a policy keeps ``jax.checkpoint``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import INLINED_CALLS, bind
from mxfp8_jax._src.fsdp.fsdp_trace import (
    LOOKUP_PRIMITIVES,
    VIEW_PRIMITIVES,
    P,
    View,
    dot_roles,
    view_through,
)
from mxfp8_jax._src.fsdp.fsdp_unit import UnitGeometry, UnitOp, after, unit_gemm, unit_lookup
from mxfp8_jax._src.ops import mxfp8_gemm


@dataclasses.dataclass(frozen=True, eq=False)
class UnitValue:
    """A unit as the evaluated loss holds it: ``leaves`` = ``(master, *planes)`` of this device,
    the layer axes of enclosing scans sliced off; ``ops`` the layout ops applied since the
    parameter, ``view`` their effect on its axes."""

    name: str
    geometry: UnitGeometry
    dtype: Any
    leaves: tuple
    view: View
    ops: tuple = ()
    gemm: Any = None  # an mxfp8_gemm.GemmMode: its GEMMs run in MXFP8


@dataclasses.dataclass(frozen=True, eq=False)
class PlainValue:
    """A plain parameter's local slice, split along ``shard_axis`` over ``axes`` (None:
    whole on every device), read as ``dtype``. Plain parameters of one ``layer`` (a key: the
    same element of a layer list, or the same scanned stack) are gathered together."""

    name: str
    local: jax.Array
    shard_axis: int | None
    axes: Any
    dtype: Any
    layer: tuple = ()


Symbolic = (UnitValue, PlainValue)


def evaluate(closed: jcore.ClosedJaxpr, args: list) -> list:
    """``closed`` evaluated on ``args`` (arrays, ``UnitValue``s, ``PlainValue``s)."""
    jaxpr, consts = jaxprs.body(closed)
    outs = _Evaluator().eval(jaxpr, consts, args)
    return [_output(x, "returned by the loss function") for x in outs]


def gather_plain(values: list[PlainValue], dep) -> dict[int, jax.Array]:
    """Plain parameters whole on this device, those split over the mesh by ONE all-gather of
    their concatenated local slices that waits for ``dep`` (its transpose: one reduce-scatter
    of their gradients)."""
    out = {id(x): x.local.astype(x.dtype) for x in values if x.shard_axis is None}
    split = [x for x in values if x.shard_axis is not None]
    if not split:
        return out
    flat = jnp.concatenate([x.local.reshape(-1) for x in split])
    full = lax.all_gather(after(flat, dep), split[0].axes, tiled=True)
    full = full.reshape(-1, flat.size)  # [device, local slices]
    # split, not slices: the transpose of a split is one concatenate, the transpose of each
    # slice a zero-padded copy of the whole buffer (one per parameter, all alive at once)
    cuts = np.cumsum([x.local.size for x in split])[:-1].tolist()
    for x, piece in zip(split, jnp.split(full, cuts, axis=1)):
        piece = piece.reshape(full.shape[0], *x.local.shape)
        shape = list(x.local.shape)
        shape[x.shard_axis] *= full.shape[0]
        out[id(x)] = jnp.moveaxis(piece, 0, x.shard_axis).reshape(shape).astype(x.dtype)
    return out


def _output(x, how: str):
    """A value leaving an evaluated region: a plain parameter gathered, never a unit."""
    if isinstance(x, UnitValue):
        raise _misused(x, how)
    if isinstance(x, PlainValue):
        return gather_plain([x], None)[id(x)]
    return x


class _Evaluator:
    def __init__(self) -> None:
        self.operands: dict = {}  # values marked by mxfp8_gemm.gemm_operand: their planes

    def eval(self, jaxpr: jcore.Jaxpr, consts, args, gathered: dict | None = None) -> list:
        """``jaxpr`` on ``consts`` and ``args``. ``gathered``: the plain parameters gathered so
        far in this trace (shared with inlined calls; a scan body or a rematerialised region
        is a trace of its own and gathers again)."""
        env: dict = {}
        gathered = {} if gathered is None else gathered
        plain = [x for x in (*consts, *args) if isinstance(x, PlainValue)]

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        def materialize(x, dep):
            if not isinstance(x, PlainValue):
                return x
            if id(x) not in gathered:
                layer = [y for y in plain if y.layer == x.layer and id(y) not in gathered]
                if x not in layer:
                    layer.append(x)
                gathered.update(gather_plain(layer, dep))
            return gathered[id(x)]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if any(isinstance(x, Symbolic) for x in ins):
                outs = self.symbolic(eqn, ins, materialize, gathered)
            else:
                outs = bind(eqn, ins)
                if eqn.primitive in INLINED_CALLS and eqn.params.get("name") == mxfp8_gemm.OPERAND:
                    self.operands[eqn.outvars[0]] = mxfp8_gemm.GivenOperand.from_call(ins)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def symbolic(self, eqn, ins, materialize, gathered) -> list:
        prim, params = eqn.primitive, eqn.params
        if prim in INLINED_CALLS:
            inner, consts = jaxprs.call_body(eqn)
            return self.eval(inner, consts, ins, gathered)
        if prim is jaxprs.REMAT:
            return self.remat(eqn, ins)
        if prim is jaxprs.SCAN:
            return self.scan(eqn, ins, materialize)
        units = [x for x in ins if isinstance(x, UnitValue)]
        dep = next((x for x in ins if isinstance(x, jax.Array)), None)  # the op's first traced operand
        if not units:
            return bind(eqn, [materialize(x, dep) for x in ins])
        unit = units[0]
        if len(units) == 1 and ins[0] is unit and prim in VIEW_PRIMITIVES:
            view = view_through(prim, params, unit.view, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
            if view is not None:
                return [dataclasses.replace(unit, view=view, ops=(*unit.ops, (prim, dict(params))))]
        if len(units) == 1 and prim is P.dot_general_p:
            position = ins.index(unit)
            act = materialize(ins[1 - position], None)
            transposed = self._transposed(unit, params["dimension_numbers"], position)
            op = UnitOp(unit.geometry, unit.dtype, unit.ops, prim, dict(params), position, transposed, unit.gemm)
            var = eqn.invars[1 - position]
            given = self.operands.get(var) if isinstance(var, jcore.Var) else None
            return [unit_gemm(op, act, unit.leaves, given)]
        if len(units) == 1 and ins[0] is unit and prim in LOOKUP_PRIMITIVES:
            others = tuple(materialize(x, None) for x in ins[1:])
            op = UnitOp(unit.geometry, unit.dtype, unit.ops, prim, dict(params), 0)
            return [unit_lookup(op, others, unit.leaves)]
        raise _misused(unit, prim.name)

    def _transposed(self, unit: UnitValue, dims, position: int) -> bool:
        g = unit.geometry
        roles = dot_roles(unit.view, dims, position)
        if roles is not None and tuple(roles[2]) == g.batch_axes:
            if set(roles[0]) == set(g.k_axes):
                return False
            if set(roles[0]) == set(g.n_axes):
                return True
        raise _misused(unit, f"a dot_general contracting its axes {roles and roles[0]}")

    def scan(self, eqn, ins, materialize) -> list:
        parts = jaxprs.scan_parts(eqn)
        nc, ncar = parts.num_consts, parts.num_carry
        consts, carry, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        carry = [materialize(_not_a_unit(x, "carried through a loop"), None) for x in carry]
        xs_in, rebuild = [], []  # the scan's stacked inputs, and how the body sees each slice
        for x in xs:
            if isinstance(x, UnitValue):
                if x.view.moved or not x.view.axes or x.view.axes[0] != (x.view.level,):
                    raise _misused(x, "a scan over it after its axes were moved")
                view = dataclasses.replace(x.view, axes=x.view.axes[1:], level=x.view.level + 1)
                rebuild.append(
                    (
                        len(xs_in),
                        len(x.leaves),
                        lambda leaves, x=x, view=view: dataclasses.replace(x, leaves=tuple(leaves), view=view),
                    )
                )
                xs_in.extend(x.leaves)
            elif isinstance(x, PlainValue) and x.shard_axis != 0:
                axis = None if x.shard_axis is None else x.shard_axis - 1
                rebuild.append(
                    (
                        len(xs_in),
                        1,
                        lambda leaves, x=x, axis=axis: dataclasses.replace(x, local=leaves[0], shard_axis=axis),
                    )
                )
                xs_in.append(x.local)
            else:
                rebuild.append((len(xs_in), 1, lambda leaves: leaves[0]))
                xs_in.append(materialize(x, None))
        forwarded: dict[int, int] = {}  # body output -> the xs entry it hands back unchanged

        def step(carry, xs_slices):
            sliced = [make(xs_slices[start : start + count]) for start, count, make in rebuild]
            outs = self.eval(parts.jaxpr, parts.consts, [*consts, *carry, *sliced])
            forwarded.clear()
            ys = []
            for k, y in enumerate(outs[ncar:]):
                j = next((j for j, s in enumerate(sliced) if s is y), None) if isinstance(y, Symbolic) else None
                if j is not None:
                    forwarded[k] = j
                else:
                    ys.append(_output(y, "returned by a scan body"))
            new_carry = [_output(c, "carried through a loop") for c in outs[:ncar]]
            return new_carry, ys

        carry_out, ys = lax.scan(step, carry, xs_in, length=parts.length, reverse=parts.reverse, unroll=parts.unroll)
        ys = iter(ys)
        return [*carry_out, *(xs[forwarded[k]] if k in forwarded else next(ys) for k in range(len(eqn.outvars) - ncar))]

    def remat(self, eqn, ins) -> list:
        jaxpr, consts = jaxprs.remat_body(eqn)
        inputs = {v: k for k, v in enumerate(jaxpr.invars)}
        passed = [inputs.get(v) if not isinstance(v, jcore.Literal) else None for v in jaxpr.outvars]
        flat, rebuild = [], []
        for x in ins:
            leaves = x.leaves if isinstance(x, UnitValue) else (x.local,) if isinstance(x, PlainValue) else (x,)
            rebuild.append((len(flat), len(leaves), x))
            flat.extend(leaves)

        def region(*flat):
            args = [_rebuild(x, flat[start : start + count]) for start, count, x in rebuild]
            outs = self.eval(jaxpr, consts, args)
            return [_output(o, "returned by a rematerialised region") for o, p in zip(outs, passed) if p is None]

        policy = eqn.params.get("policy")
        if policy is None:
            computed = rematerialize(region, flat)
        else:
            computed = jax.checkpoint(region, prevent_cse=eqn.params.get("prevent_cse", True), policy=policy)(*flat)
        computed = iter(computed)
        return [ins[p] if p is not None else next(computed) for p in passed]


def _rebuild(x, leaves):
    if isinstance(x, UnitValue):
        return dataclasses.replace(x, leaves=tuple(leaves))
    if isinstance(x, PlainValue):
        return dataclasses.replace(x, local=leaves[0])
    return leaves[0]


def rematerialize(fn, args: list) -> list:
    """``fn(*args)``, its intermediates recomputed in the backward instead of saved: a
    ``custom_vjp`` saving ``args`` whose backward re-runs ``fn`` on them made to depend on the
    cotangent (``after``), so nothing of the recompute runs before it is needed or merges with
    the forward."""

    @jax.custom_vjp
    def region(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), args

    def bwd(args, cts):
        token = next((c for c in cts if jnp.issubdtype(c.dtype, jnp.floating) and c.size), None)
        numeric = [jnp.issubdtype(a.dtype, jnp.number) or jnp.issubdtype(a.dtype, jnp.bool_) for a in args]
        moved = after([a for a, ok in zip(args, numeric) if ok], token)
        moved = iter(moved)
        args = [next(moved) if ok else a for a, ok in zip(args, numeric)]
        _, vjp = jax.vjp(fn, *args)
        return vjp(list(cts))

    region.defvjp(fwd, bwd)
    return region(*args)


def _not_a_unit(x, how: str):
    if isinstance(x, UnitValue):
        raise _misused(x, how)
    return x


def _misused(x, how: str) -> ValueError:
    return ValueError(
        f"{x.name}: the FSDP plan keeps it as a unit (its shards, gathered for each GEMM or lookup), "
        f"but this loss reads it as {how}; build FSDP with this loss_fn and an example batch "
        f"(FSDP(model, mesh, loss_fn=..., example_batch=...)) so that the plan follows what the loss does"
    )
