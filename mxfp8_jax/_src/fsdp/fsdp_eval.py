"""The loss evaluated inside an FSDP step: on the whole batch, with each weight read in an island.

``FSDP`` traces ``loss_fn(model, batch)`` on the global batch and evaluates the jaxpr op by op
here, under ``jit``, on global arrays: the batch split over the mesh along its leading axis,
every other value as XLA's partitioner makes it. So the loss means what it says: a mean over the
batch, a masked mean, a count, batch statistics and per-example metrics are those of the whole
batch, exactly as in the unsharded model (XLA inserts the reductions). What changes is how a
parameter is read:

- a unit (``UnitValue``): its master rows and MXFP8 planes, split over the mesh by rows. Layout
  ops on it (the layer's casts, transposes, reshapes) are recorded, not run; the op that reads
  it (a GEMM, a lookup) runs in an *island*: a ``shard_map`` over the mesh whose body is that
  op's unit ``custom_vjp`` (``fsdp_unit``) on each device's part of the activation and its
  rows of the weight, which gathers the weight just in time and drops it after. The island
  splits the activation the way the batch split reaches it (``fsdp_specs``), so XLA moves
  nothing into or out of it.
- a plain parameter (``PlainValue``): stored split along an axis; the first op that reads it
  asks XLA for it whole (a sharding constraint: an all-gather, and a reduce-scatter of its
  gradient), then runs as traced.

Every other op runs as traced, on global values. The evaluator is a ``fsdp_walk.Traversal`` whose
values are ``(value, spec)`` pairs; its rules say how each op reads parameters. ``scan`` bodies
are evaluated the same way, one layer at a time (the stacked units and plain parameters are the
scan's inputs, sliced like the weights they stand for, as are the stacks a ``fori_loop`` reads by
its counter: ``core.jaxprs.counted_stacks``); a scan gathers each iteration's first weights in
the iteration before, the backward's too (``fsdp_fetch``); ``jit`` calls are inlined; a
rematerialised region (``nnx.remat``, ``jax.checkpoint`` without a policy) becomes a
``custom_vjp`` that saves its inputs and, in the backward, recomputes it after the cotangent
arrives: a data dependency, so XLA can neither run the recomputed gathers early nor merge them
with the forward's (XLA:CPU expands the optimization barriers of ``jax.checkpoint`` before
common-subexpression elimination). A region with a policy keeps ``jax.checkpoint``. The islands
themselves are built in ``fsdp_islands``; the values in ``fsdp_values``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import bind
from mxfp8_jax._src.fsdp import fsdp_fetch, fsdp_specs
from mxfp8_jax._src.fsdp.fsdp_islands import (
    collective_island,
    gemm_island,
    lookup_island,
    plain_island,
    rematerialize,
)
from mxfp8_jax._src.fsdp.fsdp_specs import Propagation, Spec
from mxfp8_jax._src.fsdp.fsdp_trace import (
    INDEX_PRIMITIVES,
    LOOKUP_PRIMITIVES,
    RETYPE_PRIMITIVES,
    VIEW_PRIMITIVES,
    P,
    View,
    dot_roles,
    index_view,
    scan_slice,
    view_through,
)
from mxfp8_jax._src.fsdp.fsdp_unit import UnitOp, pick_layer
from mxfp8_jax._src.fsdp.fsdp_values import (
    Islands,
    PlainValue,
    Symbolic,
    UnitValue,
    flatten,
    misused,
    not_a_unit,
    rebuild,
)
from mxfp8_jax._src.fsdp.fsdp_walk import Body, Remat, Scan, Traversal, While, first, static_index
from mxfp8_jax._src.ops import mxfp8_gemm

# a plain stack a scan slices is gathered whole before the loop up to this size (``stacked_plain``)
WHOLE_BEFORE_LOOP = 4 << 20

__all__ = ["Islands", "PlainValue", "UnitValue", "evaluate"]


def evaluate(closed, args: list, specs: list[Spec], islands: Islands, *, drop_constraints: bool = False) -> list:
    """``closed`` evaluated on ``args`` (arrays, ``UnitValue``s, ``PlainValue``s); ``specs``: how
    the mesh splits each array argument (``fsdp_specs``; None for the others).
    ``drop_constraints``: the model's sharding constraints that replicate what the batch split
    reaches are skipped (``FSDP(model_constraints="drop")``)."""
    jaxpr, consts = jaxprs.body(closed)
    evaluator = _Evaluator(islands, drop_constraints)
    outs = evaluator.run(jaxpr, consts, list(zip(args, specs)))
    return [evaluator.output(x, "returned by the loss function") for x, _ in outs]


def _unzip(pairs) -> tuple[list, list[Spec]]:
    """``(value, spec)`` pairs -> the values and the specs."""
    return [x for x, _ in pairs], [s for _, s in pairs]


class _Evaluator(Traversal):
    """The loss evaluated on ``(value, spec)`` pairs: an op on arrays only runs as traced (a
    collective over tp in an island); an op reading a parameter goes by the rule tables: a
    stack's index (``rules``), a unit's view, GEMM or lookup (``unit_rules``), a plain one's
    view or island (``plain_rules``), a call, region, loop or branch (``kind_rules``)."""

    def __init__(self, islands: Islands, drop_constraints: bool = False) -> None:
        self.islands = islands
        self.drop_constraints = drop_constraints
        self.propagation = Propagation(islands.sizes)
        self.operands: dict = {}  # values marked by mxfp8_gemm.gemm_operand: their planes
        self.branches = 0  # how many cond branches the equations being evaluated are inside
        self.substitutes: dict = {}  # id(slice equation) -> the layer a cond picked before it
        self.splits: dict = {}  # id(stacked array) -> (it, its layers): ``layer_of``
        self.region = 0  # the rematerialised region or loop body being evaluated (``token``)
        self.regions = 0
        self.layers: dict = {}  # region -> {layer: its input, in order of first use}
        self.fetching: fsdp_fetch.Fetching | None = None  # a scan iteration's weight gathered the iteration before
        self.recomputing = False  # evaluating a fetching scan's body: its remat region inlined (``fsdp_fetch``)
        self.handing: tuple | None = None  # the last linked unit GEMM: (its handoff value, unit, op)
        self.linking = True  # unit GEMMs evaluated now are linked (``fsdp_fetch.handoff``)
        self.region_input = None  # the last top-level region's input (``fsdp_fetch.region_ahead``)

    def literal(self, lit) -> tuple:
        return lit.val, None

    def constant(self, value) -> tuple:
        return value, None

    def output(self, x, how: str):
        """A value leaving an evaluated region: a plain parameter whole (XLA gathers it), never
        a unit."""
        if isinstance(x, UnitValue):
            raise misused(x, how)
        if isinstance(x, PlainValue):
            return x.value(self.islands.whole(x.array))
        return x

    def eqn(self, eqn, ins: list) -> list:
        """``eqn`` on ``(value, spec)`` pairs: a layer an enclosing cond picked (``_cond``), an op
        on arrays only (``traced``), or one reading a parameter (the rule tables)."""
        if id(eqn) in self.substitutes:
            return [(self.substitutes[id(eqn)], None)]
        if self.fetching is not None:
            self.fetching.produced(eqn)
        values, specs = _unzip(ins)
        if any(isinstance(x, Symbolic) for x in values):
            return super().eqn(eqn, ins)
        outs = self.traced(eqn, values, specs)
        if jaxprs.call_name(eqn) == mxfp8_gemm.OPERAND:
            self.operands[eqn.outvars[0]] = (mxfp8_gemm.GivenOperand.from_call(values), specs[0])
        return outs

    def traced(self, eqn, values, specs) -> list:
        """An op on values only, run as traced; a collective over an axis the islands are not
        manual over (tensor parallelism's, in the model) runs in an island
        (``collective_island``). A model's sharding constraint that replicates what the batch
        split reaches is skipped when the plan drops them."""
        if self.drop_constraints and fsdp_specs.replicated_dims(eqn, specs[0] if specs else None):
            return [(values[0], specs[0])]
        out_specs = self.propagation.eqn(eqn, specs)
        island = self.traced_rules.get(eqn.primitive.name)
        if island is None or self.islands.owns_all or any(s is None for s in out_specs) or specs[0] is None:
            return list(zip(bind(eqn, values), out_specs))
        return list(zip(island(self.islands, eqn, values, specs, out_specs), out_specs))

    # -- an op reading a parameter ----------------------------------------------------------------

    def default(self, eqn, ins: list) -> list:
        """An op reading parameters: plain ones only (``plain``), or a unit, by ``unit_rules``
        (an op no rule takes misreads it)."""
        values, specs = _unzip(ins)
        units = [x for x in values if isinstance(x, UnitValue)]
        if not units:
            return self.plain(eqn, values, specs)
        unit = units[0]
        if unit.pick and self.branches:  # see ``_cond``
            unit = dataclasses.replace(unit, shards=unit.picked_shards(), pick=())
            values = [unit if x is units[0] else x for x in values]
        rule = self.unit_rules.get(eqn.primitive) if len(units) == 1 else None
        out = None if rule is None else rule(self, eqn, unit, values, specs)
        if out is None:
            raise misused(unit, eqn.primitive.name)
        return out

    def _unit_view(self, eqn, unit: UnitValue, values, specs) -> list | None:
        """A layout op on a unit: recorded, not run."""
        if values[0] is not unit:
            return None
        prim, params = eqn.primitive, eqn.params
        view = view_through(prim, params, unit.view, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
        if view is None:
            return None
        return [(dataclasses.replace(unit, view=view, ops=(*unit.ops, (prim, dict(params)))), None)]

    def _unit_gemm(self, eqn, unit: UnitValue, values, specs) -> list:
        """A GEMM of a unit and an activation: the unit GEMM in an island."""
        prim, params = eqn.primitive, eqn.params
        position = values.index(unit)
        act = self.output(values[1 - position], "")
        transposed = self._transposed(unit, params["dimension_numbers"], position)
        op = UnitOp(
            unit.geometry, unit.dtype, unit.ops, prim, dict(params), position, transposed, unit.gemm, unit.picked
        )
        var = eqn.invars[1 - position]
        given = self.operands.get(var) if isinstance(var, jcore.Var) else None
        token = lambda act, act_spec: self.token(unit, act, act_spec)
        take = self.fetching is not None and unit.sliced and not unit.pick and not self.branches
        fetched = self.fetching.take(unit, op, var) if take else None
        if fetched is not None and self.fetching.keep and unit.geometry.both_ways:
            op = dataclasses.replace(op, reuses=True)  # its dgrad reads the bytes it takes
        record = take and fetched is None and self.fetching.records(unit)
        args = (op, act, specs[1 - position], unit, eqn.invars[position].aval.ndim, given, token, fetched)
        out, spec, handing, gathered = gemm_island(self.islands, *args, *fsdp_fetch.handoff(self, op), record=record)
        self.handing = None if handing is None else (handing, unit, op)
        if fetched is not None:
            self.fetching.read(out, spec)
        if take:
            self.fetching.gathered(unit, fetched if gathered is None else gathered)
        return [(out, spec)]

    def _unit_lookup(self, eqn, unit: UnitValue, values, specs, *, follow: bool = False) -> list | None:
        """A lookup of a unit's rows (``gather``, ``dynamic_slice``): in an island, its result
        split as the batch split reaches it where ``follow`` (else not split)."""
        if values[0] is not unit:
            return None
        prim, params = eqn.primitive, eqn.params
        others = tuple(self.output(x, "") for x in values[1:])
        op = UnitOp(unit.geometry, unit.dtype, unit.ops, prim, dict(params), 0, picked=unit.picked)
        out_spec = self.propagation.eqn(eqn, specs)[0] if follow else None
        out = lookup_island(self.islands, op, others, specs[1:], unit, out_spec, eqn.outvars[0].aval.ndim)
        return [(out, out_spec)]

    def _index(self, eqn, ins: list) -> list | None:
        """``w[i]`` of a stack (``index``); None for another slice."""
        indexed = self.index(eqn, _unzip(ins)[0])
        return None if indexed is None else [(indexed, None)]

    def index(self, eqn, ins):
        """``w[i]`` of a stacked unit or plain parameter (a ``slice`` / ``dynamic_slice`` taking
        one index of its leading layer axes): the same value reading that layer of each device's
        shards (no communication: the rows, not the layers, are split), the index replayed as a
        reshape that restores the size-1 axes. A static index reads a layer of one split of the
        stack (``layer_of``); a unit read by a traced index keeps its stacked leaves and the index
        (``pick``): the op reading it picks the layer, so its backward keeps the stack rather
        than a per-layer copy. None for any other op."""
        x = ins[0]
        if not isinstance(x, Symbolic) or any(isinstance(a, Symbolic) for a in ins[1:]):
            return None
        if any(op not in RETYPE_PRIMITIVES for op, _ in x.ops):
            return None
        parts = jaxprs.slice_parts(eqn)
        in_shape, out_aval = eqn.invars[0].aval.shape, eqn.outvars[0].aval
        if isinstance(x, UnitValue):
            view = index_view(parts, x.view, in_shape)
            if view is None:
                return None
            m = view.level - x.view.level
        else:
            probe = View(0, tuple((a,) for a in range(len(in_shape))))
            view = index_view(parts, probe, in_shape)
            m = 0 if view is None else view.level
            if not m or (x.shard_axis is not None and x.shard_axis < m):
                return None
        ops = (*x.ops, _reshape_op(tuple(in_shape[m:]), out_aval))
        static = parts.starts is not None
        if static and not (isinstance(x, UnitValue) and x.pick):  # a static index
            layer = lambda a: self.layer_of(a, [int(i) for i in parts.starts[:m]])
            if isinstance(x, UnitValue):
                return dataclasses.replace(x, view=view, ops=ops, shards=jax.tree.map(layer, x.shards))
        else:
            starts = list(parts.starts[:m]) if static else list(ins[1 : 1 + m])
            starts = [jnp.asarray(i, jnp.int32) for i in starts]
            if isinstance(x, UnitValue):
                return dataclasses.replace(x, view=view, ops=ops, pick=(*x.pick, *starts))
            layer = lambda a: pick_layer(a, starts)
        axis = None if x.shard_axis is None else x.shard_axis - m
        return dataclasses.replace(x, array=layer(x.array), shard_axis=axis, ops=ops)

    def layer_of(self, a: jax.Array, starts: list[int]) -> jax.Array:
        """``a[starts]`` for static indices, from one ``lax.split`` of ``a`` into its layers made
        once for all the indices that read it (a Python loop over a stack): the gradients of the
        layers then meet in one concatenation, not in a zero-padded stack per layer."""
        for i in starts:
            if id(a) not in self.splits:
                pieces = lax.split(a, (1,) * a.shape[0], axis=0)
                self.splits[id(a)] = (a, [jnp.squeeze(p, 0) for p in pieces])
            a = self.splits[id(a)][1][i]
        return a

    def plain(self, eqn, values, specs) -> list:
        """An op reading plain parameters (no unit), by ``plain_rules``: a layout op on one is
        recorded; an elementwise op or a GEMM that combines them with an activation the batch
        split reaches (and does not contract) runs in an island. Anything else reads them
        whole, gathered by XLA."""
        rule = self.plain_rules.get(eqn.primitive)
        out = None if rule is None else rule(self, eqn, values, specs)
        if out is None:
            out_specs = self.propagation.eqn(eqn, specs)
            return list(zip(bind(eqn, [self.output(a, "") for a in values]), out_specs))
        return out

    def _plain_view(self, eqn, values, specs) -> list | None:
        x = values[0]
        if len(values) != 1 or not isinstance(x, PlainValue):
            return None
        return [(dataclasses.replace(x, ops=(*x.ops, (eqn.primitive, dict(eqn.params)))), None)]

    def _plain_island(self, eqn, values, specs) -> list | None:
        """The op in an island (``plain_island``) if it reads an activation and its result is split."""
        out_specs = self.propagation.eqn(eqn, specs)
        acts = [k for k, a in enumerate(values) if not isinstance(a, Symbolic) and specs[k] is not None]
        if len(eqn.outvars) != 1 or not acts or out_specs[0] is None:
            return None
        split = [a for a in values if isinstance(a, PlainValue) and a.shard_axis is not None]
        act, spec = values[acts[0]], fsdp_specs.partition(specs[acts[0]], jnp.ndim(values[acts[0]]))
        wait = self.token(split[0], act, spec) if split else ("own",)
        after = wait[1:] if wait[0] == "layer" else ()  # a Python loop's: as its units' gathers
        return [(plain_island(self.islands, eqn, values, specs, out_specs[0], acts[0], after), out_specs[0])]

    def _plain_dot(self, eqn, values, specs) -> list | None:
        """A GEMM none of whose operands is split along an axis it contracts (each device's
        part of the product is then a part of the output, not a partial sum): an island."""
        (lc, rc), _ = eqn.params["dimension_numbers"]
        if not all(s is None or all(s[d] is None for d in c) for s, c in zip(specs, (lc, rc))):
            return None
        return self._plain_island(eqn, values, specs)

    # -- islands ----------------------------------------------------------------------------------

    def token(self, unit: UnitValue | PlainValue, act, act_spec):
        """What the forward gathers of ``unit`` (or a plain parameter) wait for: ``(how, island
        operand, its spec)``. ``"own"``: the op's own input (``prefetch=0``, or no earlier layer
        to wait for); ``"none"``: nothing (a layer a loop reads per iteration: a slice of a
        scan's stacked input or a traced index; XLA may start it any time in the iteration);
        ``"layer"``: the input of the layer ``prefetch`` layers before in a Python loop over a
        list of layers (``UnitValue.layer``), the operand. A layer's input is the activation of
        its first op reading a parameter; only a layer of the same region (not across a
        rematerialised region or a loop body) is waited for."""
        if not self.islands.prefetch:
            return "own", (), ()
        if unit.sliced or unit.pick:
            return "none", (), ()
        layer = unit.layer
        if layer is None:
            return "own", (), ()
        seen = self.layers.setdefault(self.region, {})
        if layer not in seen:
            seen[layer] = (act, act_spec)
        order = list(seen)
        k = order.index(layer)
        if k < self.islands.prefetch:
            return "own", (), ()
        earlier, spec = seen[order[k - self.islands.prefetch]]
        return "layer", earlier, spec

    @contextlib.contextmanager
    def inside(self, linked: bool = False):
        """Evaluating a body of its own (a region, a loop body, a branch): its layers and the
        outer ones wait not for each other (``token``); ``linked``: its GEMMs are (``handoff``)."""
        saved = self.region, self.linking
        self.regions += 1
        self.region, self.linking = self.regions, linked
        try:
            yield
        finally:
            self.region, self.linking = saved

    @contextlib.contextmanager
    def fetched(self, fetching: fsdp_fetch.Fetching):
        """Evaluating a fetching scan's body (``fsdp_fetch``): the first GEMMs take their weights
        from ``fetching``, the remat region is inlined, the first linked GEMM takes what it hands;
        the evaluator's state as it was after, but a loop ends the handoff's chain."""
        saved = self.fetching, self.recomputing, dict(self.splits)
        self.fetching, self.recomputing, self.handing = fetching, True, fetching.handing
        try:
            yield fetching
        finally:
            (self.fetching, self.recomputing, self.splits), self.handing = saved, None

    def _transposed(self, unit: UnitValue, dims, position: int) -> bool:
        g = unit.geometry
        roles = dot_roles(unit.view, dims, position)
        if roles is not None and tuple(roles[2]) == g.batch_axes:
            if set(roles[0]) == set(g.k_axes):
                return False
            if set(roles[0]) == set(g.n_axes):
                return True
        raise misused(unit, f"a dot_general contracting its axes {roles and roles[0]}")

    # -- loops, branches and regions --------------------------------------------------------------

    def _scan(self, eqn, loop: Scan, ins: list) -> list:
        """A ``scan`` reading parameters, rebuilt as a ``lax.scan`` whose body is evaluated
        here: the stacked units and plain parameters are its inputs, sliced like the weights
        they stand for (stacks a ``fori_loop`` reads by its counter too)."""
        counted = jaxprs.counted_stacks(eqn, range(loop.parts.num_consts))
        if counted is not None:
            loop, ins = Scan(self.body(counted.parts.jaxpr, counted.parts.consts), counted.parts), counted.operands(ins)
        values, in_specs = _unzip(ins)
        consts, carry, xs = loop.split(values)
        c_specs, k_specs, x_specs = loop.split(in_specs)
        ncar = loop.parts.num_carry
        carry = [self.output(not_a_unit(x, "carried through a loop"), "") for x in carry]
        xs_in, slicers = [], []  # the scan's stacked inputs, and how the body sees each slice
        for x in xs:
            if isinstance(x, UnitValue):
                one = self.scan_slice(x)
                slicers.append((len(xs_in), len(x.leaves), lambda leaves, one=one: one.with_leaves(leaves)))
                xs_in.extend(x.leaves)
            elif isinstance(x, PlainValue):
                split = x.shard_axis
                x = self.stacked_plain(x)
                axis = None if x.shard_axis is None else x.shard_axis - 1
                # gathered whole before the loop: each iteration's gradient reduce-scattered as
                # the stack was split (one collective with the iteration's others), not all-reduced
                # (split along the layer axis, each iteration's slice is one device's whole: none)
                whole = split if x.shard_axis is None and split else None
                slicers.append((len(xs_in), 1, functools.partial(self._plain_slice, x, axis, whole)))
                xs_in.append(x.array)
            else:
                slicers.append((len(xs_in), 1, lambda leaves: leaves[0]))
                xs_in.append(x)
        body_x_specs = [fsdp_specs.sliced(s) for s in x_specs]
        k_specs = self.propagation.scan_carry(loop.body, c_specs, k_specs, body_x_specs)
        forwarded: dict[int, int] = {}  # body output -> the xs entry it hands back unchanged
        y_specs: list = []
        flat_consts, rebuilt = flatten(consts)

        def step(flat_consts, carry, xs_slices):
            consts = [rebuild(x, flat_consts[start : start + count]) for start, count, x in rebuilt]
            sliced = [make(xs_slices[start : start + count]) for start, count, make in slicers]
            with self.inside(linked=self.fetching is not None and self.fetching.linked):
                outs = loop.body(list(zip([*consts, *carry, *sliced], [*c_specs, *k_specs, *body_x_specs])))
            outs, out_specs = _unzip(outs)
            forwarded.clear()
            y_specs[:] = out_specs[ncar:]
            ys = []
            for k, y in enumerate(outs[ncar:]):
                j = next((j for j, s in enumerate(sliced) if s is y), None) if isinstance(y, Symbolic) else None
                if j is not None:
                    forwarded[k] = j
                else:
                    ys.append(self.output(y, "returned by a scan body"))
            new_carry = [self.output(c, "carried through a loop") for c in outs[:ncar]]
            return new_carry, ys

        parts = loop.parts
        first = fsdp_fetch.first_read(self, loop, step, flat_consts, carry, xs_in, slicers, xs)
        saved, self.fetching = self.fetching, None  # an enclosing loop's fetch is not this loop's
        try:
            if first is None:
                carry_out, ys = lax.scan(
                    functools.partial(step, flat_consts),
                    carry,
                    xs_in,
                    length=parts.length,
                    reverse=parts.reverse,
                    unroll=parts.unroll,
                )
            else:
                carry_out, ys = fsdp_fetch.fetching_scan(self, step, flat_consts, carry, xs_in, parts, first)
        finally:
            self.fetching = saved
        ys = iter(ys)
        n_ys = len(eqn.outvars) - ncar
        outs = [*carry_out, *(xs[forwarded[k]] if k in forwarded else next(ys) for k in range(n_ys))]
        stacked = [None if s is None else (None, *s) for s in y_specs]
        return list(zip(outs, [*k_specs, *stacked]))

    def _plain_slice(self, x: PlainValue, axis: int | None, whole: int | None, leaves) -> PlainValue:
        """What a scan body reads of the stacked plain parameter ``x`` each iteration (its slice
        ``leaves[0]``, split along ``axis``); ``whole``: the axis the stack was split along
        before ``stacked_plain`` gathered it whole, along which the slice's gradient is split."""
        array = leaves[0] if whole is None else self.islands.split_cotangent(leaves[0], whole - 1)
        return dataclasses.replace(x, array=array, shard_axis=axis)

    def scan_slice(self, x: UnitValue) -> UnitValue:
        """What a scan body reads of the stacked unit ``x`` each iteration (its leaves still
        the stack's: the scan slices them): the next of its layer axes sliced off its view. A
        stack the loss moved to lead before the scan (``transpose``, ``jnp.moveaxis``,
        ``nnx.scan`` over axis 1) is read through one ``transpose`` of the layer's value, its
        casts kept; its shards are stacked along their leading axis whatever the parameter's
        layout, so the scan slices them the same way."""
        view = scan_slice(x.view)
        g = x.geometry
        if view is None or view.layers != g.layer_axes[: view.level]:
            axis = "?" if view is None else view.layers[-1]
            raise misused(x, f"a scan over its axis {axis} (the plan has layer axes {g.layer_axes})")
        ops = x.ops
        if x.view.moved:
            kept = [a for (a,) in view.axes]
            order = sorted(kept)
            perm = tuple(order.index(a) for a in kept)
            ops = tuple((prim, params) for prim, params in x.ops if prim is P.convert_element_type_p)
            if perm != tuple(range(len(perm))):
                ops = (*ops, (P.transpose_p, {"permutation": perm}))
        return dataclasses.replace(x, view=view, ops=ops, sliced=True)

    def stacked_plain(self, x: PlainValue) -> PlainValue:
        """A plain parameter a scan slices along its leading axis, its recorded layout ops run on
        its shards (a stack moved to lead: its split axis moves with it, no communication). Where
        the ops merge its split axis into others, or bring it to the front, it is gathered whole
        first (the plan splits none of a parameter's layer axes).

        A small stack (at most ``WHOLE_BEFORE_LOOP`` bytes whole: a stack of norm scales or
        biases) is gathered whole here, once, before the loop: gathered per iteration, its
        gathers would be collectives of their own in the loop's body, and XLA:GPU runs one
        collective at a time, so each would hold back the iteration's weight gathers."""
        if x.shard_axis is not None and x.array.size * x.array.dtype.itemsize <= WHOLE_BEFORE_LOOP:
            return self._gathered(x)
        if not x.ops:
            return self._gathered(x) if x.shard_axis == 0 else x
        v = x.array.astype(x.dtype)
        view = View(0, tuple((a,) for a in range(v.ndim)))
        for prim, params in x.ops:
            out = prim.bind(v, **params)
            view = None if view is None else view_through(prim, params, view, v.shape, out.shape)
            v = out
        axis = None
        if x.shard_axis is not None and view is not None:
            axis = next((d for d, axes in enumerate(view.axes) if axes == (x.shard_axis,)), None)
        if x.shard_axis is not None and axis in (None, 0):
            return self._gathered(x)
        return dataclasses.replace(x, array=v, shard_axis=axis, ops=(), dtype=v.dtype)

    def _gathered(self, x: PlainValue) -> PlainValue:
        """``x`` gathered whole, its layout ops replayed on it."""
        whole = x.value(self.islands.whole(x.array, x.shard_axis))
        return dataclasses.replace(x, array=whole, shard_axis=None, ops=(), dtype=whole.dtype)

    def _cond(self, eqn, branches: list[Body], ins: list) -> list:
        """A ``cond`` / ``switch`` whose branches read parameters: every branch evaluated here
        (its reads in islands) inside ``lax.switch``. The index is a global value, so every
        device takes the same branch and runs the same gathers. A stack that the branches read
        only as one static layer (``w[i]`` in a Python loop) enters the ``cond`` as that layer:
        the ``cond``'s gradient for it is then one layer's, not a zero-padded stack per ``cond``.
        A layer picked from a stack by a traced index is picked before the op inside a branch:
        jax saves a branch's residuals as outputs of the ``cond``, so the op's backward keeps that
        layer's planes rather than the stack's."""
        values, in_specs = _unzip(ins)
        operands, slicers = list(values[1:]), {}
        for k, x in enumerate(operands):
            found = static_index(branches, k) if isinstance(x, Symbolic) else None
            picked = None if found is None else self.index(found[0], [x])
            if isinstance(picked, UnitValue):
                picked = dataclasses.replace(picked, shards=picked.picked_shards(), pick=())
            if picked is not None:  # every branch reads x[i] for one static i: i picked here
                operands[k] = picked
                slicers.update((id(e), k) for e in found)
        flat, rebuilt = flatten(operands)
        out_specs: list = []

        def make(branch: Body):
            def run(*flat):
                args = [rebuild(x, flat[start : start + count]) for start, count, x in rebuilt]
                self.branches += 1
                self.substitutes.update((e, args[k]) for e, k in slicers.items())
                try:
                    with self.inside():
                        outs, specs = _unzip(branch(list(zip(args, in_specs[1:]))))
                finally:
                    self.branches -= 1
                    for e in slicers:
                        self.substitutes.pop(e, None)
                out_specs.append(specs)
                return [self.output(o, "returned by a cond branch") for o in outs]

            return run

        outs = lax.switch(values[0], [make(b) for b in branches], *flat)
        specs = [s if all(o[k] == s for o in out_specs) else None for k, s in enumerate(out_specs[0])]
        return list(zip(outs, specs))

    def _while(self, eqn, loop: While, ins: list) -> list:
        """A ``while`` loop whose body reads parameters, evaluated here: forward only (jax has no
        reverse-mode derivative of a while loop; the step refuses to train through one)."""
        values, in_specs = _unzip(ins)
        c_consts, b_consts, carry = loop.split(values)
        c_specs, b_specs, _ = loop.split(in_specs)
        carry = [self.output(not_a_unit(x, "carried through a loop"), "") for x in carry]
        none = [None] * len(carry)
        if self.fetching is not None:  # its body is another trace
            saved, self.fetching = self.fetching, None
            try:
                return self._while(eqn, loop, ins)
            finally:
                self.fetching = saved

        def cond_fn(carry):
            with self.inside():
                outs = loop.cond(list(zip([*c_consts, *carry], [*c_specs, *none])))
            return outs[0][0]

        def body_fn(carry):
            with self.inside():
                outs = loop.body(list(zip([*b_consts, *carry], [*b_specs, *none])))
            return [self.output(o, "carried through a loop") for o, _ in outs]

        return list(zip(lax.while_loop(cond_fn, body_fn, carry), none))

    def _remat(self, eqn, region: Remat, ins: list) -> list:
        """A rematerialised region reading parameters: without a policy, a ``custom_vjp`` that
        recomputes it after the cotangent arrives (``rematerialize``); with one, ``jax.checkpoint``.
        An output that is an input passes through as it is."""
        values, in_specs = _unzip(ins)
        jaxpr = region.body.jaxpr
        inputs = {v: k for k, v in enumerate(jaxpr.invars)}
        passed = [inputs.get(v) if not isinstance(v, jcore.Literal) else None for v in jaxpr.outvars]
        flat, rebuilt = flatten(values)
        out_specs: list = []

        inline = self.recomputing
        earlier, spec, self.region_input = fsdp_fetch.region_ahead(self, region, values, in_specs)
        flat = [*flat, *earlier]

        def run(*flat):
            """The region's body; inlined (``recomputing``) it may read fetched weights, wrapped
            (another trace) not, and regions inside it are wrapped."""
            args = [rebuild(x, flat[start : start + count]) for start, count, x in rebuilt]
            saved = self.fetching, self.recomputing
            self.fetching, self.recomputing = (self.fetching if inline else None), False
            try:
                with self.inside():
                    self.layers[self.region] = {None: (flat[-1], spec)} if earlier else {}
                    outs, specs = _unzip(region.body(list(zip(args, in_specs))))
            finally:
                self.fetching, self.recomputing = saved
            out_specs[:] = specs
            return [self.output(o, "returned by a rematerialised region") for o, p in zip(outs, passed) if p is None]

        if self.recomputing:  # the whole body is recomputed already (``fsdp_fetch``)
            computed = run(*flat)
        elif region.policy is None:
            # under prefetch, a loop's per-iteration layer is recomputed without waiting for the
            # cotangent, like the backward's own gathers (fsdp_unit's ``early``): in a scan the
            # forward's gathers are in another loop, nothing to merge with
            free = [
                self.islands.prefetch > 0 and isinstance(x, UnitValue) and bool(x.sliced or x.pick)
                for _, count, x in rebuilt
                for _ in range(count)
            ]
            computed = rematerialize(run, flat, free)
        else:
            computed = jax.checkpoint(run, prevent_cse=region.prevent_cse, policy=region.policy)(*flat)
        computed = iter(computed)
        outs = [values[p] if p is not None else next(computed) for p in passed]
        specs = [in_specs[p] if p is not None else s for p, s in zip(passed, out_specs or [None] * len(passed))]
        return list(zip(outs, specs))

    kind_rules: ClassVar = {
        "call": Traversal.inline,
        "remat": _remat,
        "scan": _scan,
        "cond": _cond,
        "while": _while,
    }
    rules: ClassVar = dict.fromkeys(INDEX_PRIMITIVES, _index)
    # ``unit_rules[primitive](self, eqn, unit, values, specs)``: an op reading one unit
    unit_rules: ClassVar = {
        **dict.fromkeys(VIEW_PRIMITIVES, _unit_view),
        P.dot_general_p: _unit_gemm,
        **dict.fromkeys(LOOKUP_PRIMITIVES, _unit_lookup),
        P.gather_p: functools.partial(_unit_lookup, follow=True),
    }
    # ``plain_rules[primitive](self, eqn, values, specs)``: an op reading plain parameters only
    plain_rules: ClassVar = {
        **dict.fromkeys(fsdp_specs.ELEMENTWISE, _plain_island),
        **dict.fromkeys(VIEW_PRIMITIVES - fsdp_specs.ELEMENTWISE, _plain_view),
        **dict.fromkeys(VIEW_PRIMITIVES & fsdp_specs.ELEMENTWISE, first(_plain_view, _plain_island)),
        P.dot_general_p: _plain_dot,
    }
    # ``traced_rules[primitive name]``: the island of an op on arrays only (a model's collective)
    traced_rules: ClassVar = dict.fromkeys(fsdp_specs.COLLECTIVES, collective_island)


def _reshape_op(shape: tuple[int, ...], out_aval) -> tuple:
    """``(primitive, params)`` of the reshape from ``shape`` to ``out_aval``'s shape, as this jax
    writes it (replayed on a layer picked by ``index`` to give what the index op gave)."""
    closed = jax.make_jaxpr(lambda v: jnp.reshape(v, out_aval.shape))(jax.ShapeDtypeStruct(shape, out_aval.dtype))
    (eqn,) = closed.jaxpr.eqns
    return eqn.primitive, dict(eqn.params)
