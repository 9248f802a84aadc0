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

Every other op runs as traced, on global values. ``scan`` bodies are evaluated the same way, one
layer at a time (the stacked units and plain parameters are the scan's inputs, sliced like the
weights they stand for); ``jit`` calls are inlined; a rematerialised region (``nnx.remat``,
``jax.checkpoint`` without a policy) becomes a ``custom_vjp`` that saves its inputs and, in the
backward, recomputes it after the cotangent arrives: a data dependency, so XLA can neither run
the recomputed gathers early nor merge them with the forward's (XLA:CPU expands the
optimization barriers of ``jax.checkpoint`` before common-subexpression elimination).
A region with a policy keeps ``jax.checkpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import INLINED_CALLS, bind
from mxfp8_jax._src.fsdp import fsdp_specs
from mxfp8_jax._src.fsdp.fsdp_specs import Propagation, Spec, entries_of
from mxfp8_jax._src.fsdp.fsdp_trace import (
    INDEX_PRIMITIVES,
    LOOKUP_PRIMITIVES,
    RETYPE_PRIMITIVES,
    VIEW_PRIMITIVES,
    P,
    View,
    dot_roles,
    index_view,
    view_through,
)
from mxfp8_jax._src.fsdp.fsdp_unit import OWN, Gemms, UnitGeometry, UnitOp, after, pick_layer, unit_gemm, unit_lookup
from mxfp8_jax._src.ops import mxfp8_gemm


@dataclasses.dataclass(frozen=True, eq=False)
class UnitValue:
    """A unit as the evaluated loss holds it: ``leaves`` = ``(master, *planes)``, global arrays
    ``[*stack, rows, K]`` split by rows over ``geometry.axes``, the layer axes of enclosing scans
    sliced off; ``ops`` the layout ops applied since the parameter, ``view`` their effect on its
    axes; ``pick`` the layer an index (``w[i]``) chose, one index per leading axis of the leaves,
    picked by the op that reads it."""

    name: str
    geometry: UnitGeometry
    dtype: Any
    leaves: tuple
    view: View
    ops: tuple = ()
    gemm: Gemms = dataclasses.field(default_factory=Gemms)  # how its GEMMs multiply (``gemm.mxfp8``: in MXFP8)
    pick: tuple = ()  # indices of the leaves' leading layer axes the value reads (``w[i]``)
    sliced: bool = False  # a scan's slice of it (one layer per iteration)

    def leaf_specs(self) -> tuple[PartitionSpec, ...]:
        """The islands' ``in_specs`` of the leaves: rows split over the unit's axes."""
        return tuple(PartitionSpec(*(None,) * (x.ndim - 2), self.geometry.axes, None) for x in self.leaves)

    @property
    def picked(self) -> tuple[int, ...]:
        """The sizes of the leaves' leading axes that ``pick`` indexes."""
        return tuple(self.leaves[0].shape[: len(self.pick)])

    def picked_leaves(self) -> tuple:
        """The leaves of the layer ``pick`` names (a copy of that layer's shards)."""
        return tuple(pick_layer(a, self.pick) for a in self.leaves)

    def arrays(self) -> tuple:
        """The arrays it stands for: its leaves, then its pick indices."""
        return (*self.leaves, *self.pick)

    def with_arrays(self, arrays) -> UnitValue:
        """The same unit on ``arrays`` (as ``arrays()`` lists them, e.g. inside a region)."""
        n = len(self.leaves)
        return dataclasses.replace(self, leaves=tuple(arrays[:n]), pick=tuple(arrays[n:]))


@dataclasses.dataclass(frozen=True, eq=False)
class PlainValue:
    """A plain parameter: ``array`` (global), split along ``shard_axis`` over the FSDP axes
    (None: whole), read as ``dtype``; ``ops`` the layout ops (casts, broadcasts, reshapes)
    applied since, replayed where it is gathered."""

    name: str
    array: jax.Array
    shard_axis: int | None
    dtype: Any
    ops: tuple = ()

    def value(self, whole: jax.Array) -> jax.Array:
        """The parameter whole -> the value the loss reads (its layout ops replayed)."""
        v = whole.astype(self.dtype)
        for prim, params in self.ops:
            v = prim.bind(v, **params)
        return v


Symbolic = (UnitValue, PlainValue)


@dataclasses.dataclass(frozen=True)
class Islands:
    """Where the islands run: ``mesh`` (the step's; inside a ``shard_map`` manual over the
    tensor-parallel axis, the context's abstract mesh is taken) and ``entry``, the FSDP axes
    as a ``PartitionSpec`` entry (one name, or names innermost first as the batch and the units'
    rows are split): the axes the islands are manual over. ``prefetch``: how many layers ahead
    a unit's forward gather starts (``_Evaluator.token``)."""

    mesh: Mesh
    entry: Any
    prefetch: int = 0

    @property
    def axes(self) -> tuple[str, ...]:
        return self.entry if isinstance(self.entry, tuple) else (self.entry,)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def context_mesh(self):
        """The mesh a ``shard_map`` or sharding constraint is written against here: the context's
        abstract mesh inside a partly manual ``shard_map`` (tensor parallelism), else ``mesh``."""
        abstract = jax.sharding.get_abstract_mesh()
        manual = getattr(abstract, "manual_axes", ()) if abstract is not None else ()
        return abstract if manual else self.mesh

    @property
    def owns_all(self) -> bool:
        """Whether the islands are manual over every mesh axis (no tensor parallelism)."""
        return set(self.axes) == set(self.mesh.axis_names)

    def island(self, fn, in_specs, out_specs):
        if set(self.axes) == set(self.mesh.axis_names):
            return jax.shard_map(fn, mesh=self.context_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)
        return jax.shard_map(
            fn,
            mesh=self.context_mesh(),
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(self.axes),
            check_vma=False,
        )

    def whole(self, x: jax.Array) -> jax.Array:
        """``x`` replicated over the islands' axes (XLA all-gathers it where it is split)."""
        return lax.with_sharding_constraint(x, NamedSharding(self.context_mesh(), PartitionSpec()))


def evaluate(closed, args: list, specs: list[Spec], islands: Islands) -> list:
    """``closed`` evaluated on ``args`` (arrays, ``UnitValue``s, ``PlainValue``s); ``specs``: how
    the mesh splits each array argument (``fsdp_specs``; None for the others)."""
    jaxpr, consts = jaxprs.body(closed)
    evaluator = _Evaluator(islands)
    outs, _ = evaluator.eval(jaxpr, consts, [None] * len(consts), args, specs)
    return [evaluator.output(x, "returned by the loss function") for x in outs]


class _Evaluator:
    def __init__(self, islands: Islands) -> None:
        self.islands = islands
        self.rules = Propagation(islands.sizes)
        self.operands: dict = {}  # values marked by mxfp8_gemm.gemm_operand: their planes
        self.branches = 0  # how many cond branches the equations being evaluated are inside
        self.substitutes: dict = {}  # id(slice equation) -> the layer a cond picked before it
        self.splits: dict = {}  # id(stacked array) -> (it, its layers): ``layer_of``
        self.region = 0  # the rematerialised region or loop body being evaluated (``token``)
        self.regions = 0
        self.layers: dict = {}  # region -> {layer key: its input, in order of first use}

    def output(self, x, how: str):
        """A value leaving an evaluated region: a plain parameter whole (XLA gathers it), never
        a unit."""
        if isinstance(x, UnitValue):
            raise _misused(x, how)
        if isinstance(x, PlainValue):
            return x.value(self.islands.whole(x.array))
        return x

    def eval(self, jaxpr: jcore.Jaxpr, consts, const_specs, args, specs) -> tuple[list, list[Spec]]:
        """``jaxpr`` on ``consts`` and ``args`` and their specs -> outputs and their specs."""
        env: dict = {}
        spec_env: dict = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        def spec(v):
            return None if isinstance(v, jcore.Literal) else spec_env.get(v)

        for v, x, s in zip(jaxpr.constvars, consts, const_specs):
            env[v], spec_env[v] = x, s
        for v, x, s in zip(jaxpr.invars, args, specs):
            env[v], spec_env[v] = x, s
        for eqn in jaxpr.eqns:
            if id(eqn) in self.substitutes:  # a layer the enclosing cond picked (``cond``)
                env[eqn.outvars[0]], spec_env[eqn.outvars[0]] = self.substitutes[id(eqn)], None
                continue
            ins, in_specs = [read(v) for v in eqn.invars], [spec(v) for v in eqn.invars]
            if any(isinstance(x, Symbolic) for x in ins):
                outs, out_specs = self.symbolic(eqn, ins, in_specs)
            else:
                outs, out_specs = self.traced(eqn, ins, in_specs)
                if eqn.primitive in INLINED_CALLS and eqn.params.get("name") == mxfp8_gemm.OPERAND:
                    self.operands[eqn.outvars[0]] = (mxfp8_gemm.GivenOperand.from_call(ins), in_specs[0])
            for v, x, s in zip(eqn.outvars, outs, out_specs):
                if not isinstance(v, jcore.DropVar):
                    env[v], spec_env[v] = x, s
        return [read(v) for v in jaxpr.outvars], [spec(v) for v in jaxpr.outvars]

    def traced(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        """An op on values only, run as traced; a collective over an axis the islands are not
        manual over (tensor parallelism's, in the model) runs in an island, on each device's
        part of the batch: left to XLA, it would gather the batch along the FSDP axes first."""
        out_specs = self.rules.eqn(eqn, in_specs)
        collective = fsdp_specs.is_collective(eqn.primitive) and not self.islands.owns_all
        if not collective or any(s is None for s in out_specs) or in_specs[0] is None:
            return bind(eqn, ins), out_specs
        in_p = tuple(PartitionSpec(*entries_of(s, np.ndim(x))) for s, x in zip(in_specs, ins))
        out_p = tuple(PartitionSpec(*entries_of(s, v.aval.ndim)) for s, v in zip(out_specs, eqn.outvars))
        body = lambda *a: tuple(bind(eqn, list(a)))
        if eqn.primitive.name in fsdp_specs.SCATTERS and eqn.params.get("axis_index_groups") is None:
            body = lambda x: (_reduce_scatter(x, eqn.params),)
        fn = self.islands.island(body, in_p, out_p)
        return list(fn(*ins)), out_specs

    def symbolic(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        prim, params = eqn.primitive, eqn.params
        if prim in INLINED_CALLS:
            inner, consts = jaxprs.call_body(eqn)
            return self.eval(inner, consts, [None] * len(consts), ins, in_specs)
        if prim is jaxprs.REMAT:
            return self.remat(eqn, ins, in_specs)
        if prim is jaxprs.SCAN:
            return self.scan(eqn, ins, in_specs)
        if prim is jaxprs.COND:
            return self.cond(eqn, ins, in_specs)
        if prim is jaxprs.WHILE:
            return self.while_loop(eqn, ins, in_specs)
        indexed = self.index(eqn, ins)
        if indexed is not None:
            return [indexed], [None]
        units = [x for x in ins if isinstance(x, UnitValue)]
        if not units:
            return self.plain(eqn, ins, in_specs)
        unit = units[0]
        if unit.pick and self.branches:  # see ``cond``
            unit = dataclasses.replace(unit, leaves=unit.picked_leaves(), pick=())
            ins = [unit if x is units[0] else x for x in ins]
        if len(units) == 1 and ins[0] is unit and prim in VIEW_PRIMITIVES:
            view = view_through(prim, params, unit.view, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
            if view is not None:
                return [dataclasses.replace(unit, view=view, ops=(*unit.ops, (prim, dict(params))))], [None]
        if len(units) == 1 and prim is P.dot_general_p:
            position = ins.index(unit)
            act = self.output(ins[1 - position], "")
            transposed = self._transposed(unit, params["dimension_numbers"], position)
            op = UnitOp(
                unit.geometry, unit.dtype, unit.ops, prim, dict(params), position, transposed, unit.gemm, unit.picked
            )
            var = eqn.invars[1 - position]
            given = self.operands.get(var) if isinstance(var, jcore.Var) else None
            unit_ndim = eqn.invars[position].aval.ndim
            out, spec = self.gemm_island(op, act, in_specs[1 - position], unit, unit_ndim, given)
            return [out], [spec]
        if len(units) == 1 and ins[0] is unit and prim in LOOKUP_PRIMITIVES:
            others = tuple(self.output(x, "") for x in ins[1:])
            op = UnitOp(unit.geometry, unit.dtype, unit.ops, prim, dict(params), 0, picked=unit.picked)
            out_spec = self.rules.eqn(eqn, in_specs)[0] if prim is P.gather_p else None
            return [self.lookup_island(op, others, in_specs[1:], unit, out_spec, eqn.outvars[0].aval.ndim)], [out_spec]
        raise _misused(unit, prim.name)

    def index(self, eqn, ins):
        """``w[i]`` of a stacked unit or plain parameter (a ``slice`` / ``dynamic_slice`` taking
        one index of its leading layer axes): the same value reading that layer of each device's
        shards (no communication: the rows, not the layers, are split), the index replayed as a
        reshape that restores the size-1 axes. A static index reads a layer of one split of the
        stack (``layer_of``); a unit read by a traced index keeps its stacked leaves and the index
        (``pick``): the op reading it picks the layer, so its backward keeps the stack rather
        than a per-layer copy. None for any other op."""
        prim, params = eqn.primitive, eqn.params
        x = ins[0]
        if prim not in INDEX_PRIMITIVES or not isinstance(x, Symbolic) or any(isinstance(a, Symbolic) for a in ins[1:]):
            return None
        if any(op not in RETYPE_PRIMITIVES for op, _ in x.ops):
            return None
        in_shape, out_aval = eqn.invars[0].aval.shape, eqn.outvars[0].aval
        if isinstance(x, UnitValue):
            view = index_view(prim, params, x.view, in_shape)
            if view is None:
                return None
            m = view.level - x.view.level
        else:
            probe = View(0, tuple((a,) for a in range(len(in_shape))))
            view = index_view(prim, params, probe, in_shape)
            m = 0 if view is None else view.level
            if not m or (x.shard_axis is not None and x.shard_axis < m):
                return None
        ops = (*x.ops, _reshape_op(tuple(in_shape[m:]), out_aval))
        if prim is P.slice_p and not (isinstance(x, UnitValue) and x.pick):  # a static index
            layer = lambda a: self.layer_of(a, [int(i) for i in params["start_indices"][:m]])
            if isinstance(x, UnitValue):
                return dataclasses.replace(x, view=view, ops=ops, leaves=tuple(map(layer, x.leaves)))
        else:
            starts = list(params["start_indices"][:m]) if prim is P.slice_p else list(ins[1 : 1 + m])
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

    def plain(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        """An op reading plain parameters. A layout op on one is recorded; an elementwise op or a
        GEMM that combines them with an activation the batch split reaches (and does not
        contract) runs in an island: each plain parameter gathered there once the activation
        exists, its gradient reduce-scattered from the devices' parts. Anything else reads them
        whole, gathered by XLA."""
        prim = eqn.primitive
        x = ins[0]
        if len(ins) == 1 and isinstance(x, PlainValue) and prim in VIEW_PRIMITIVES:
            return [dataclasses.replace(x, ops=(*x.ops, (prim, dict(eqn.params))))], [None]
        out_specs = self.rules.eqn(eqn, in_specs)
        shape = tuple(eqn.outvars[0].aval.shape)
        acts = [k for k, a in enumerate(ins) if not isinstance(a, Symbolic) and in_specs[k] is not None]
        if not (prim in fsdp_specs.ELEMENTWISE or _splits_no_contraction(eqn, in_specs)):
            return bind(eqn, [self.output(a, "") for a in ins]), out_specs
        if len(eqn.outvars) != 1 or not acts or out_specs[0] is None:
            return bind(eqn, [self.output(a, "") for a in ins]), out_specs
        ndim = len(shape)
        specs, plain = [], []
        for k, a in enumerate(ins):
            if isinstance(a, PlainValue):
                axis = a.shard_axis
                entries = [None] * a.array.ndim
                if axis is not None:
                    entries[axis] = self.islands.entry
                specs.append(PartitionSpec(*entries))
                plain.append(a.array)
            else:
                specs.append(PartitionSpec(*entries_of(in_specs[k], np.ndim(a))))
                plain.append(a)
        token = acts[0]

        def body(*local):
            dep = local[token]
            args = []
            for a, loc in zip(ins, local):
                if isinstance(a, PlainValue):
                    whole = loc
                    if a.shard_axis is not None:
                        whole = gather_after(self.islands.entry, a.shard_axis, loc, dep)
                    args.append(a.value(whole))
                else:
                    args.append(loc)
            return bind(eqn, args)[0]

        fn = self.islands.island(body, tuple(specs), PartitionSpec(*entries_of(out_specs[0], ndim)))
        return [fn(*plain)], out_specs

    # -- islands ----------------------------------------------------------------------------------

    def gemm_island(self, op: UnitOp, act, act_spec: Spec, unit: UnitValue, unit_ndim: int, given):
        """The unit GEMM on each device's part of ``act``: the activation split along the free
        axes the batch split reaches (else along its first free axis the islands' devices
        divide), the result split the same way."""
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        contract, batch = (rc, rb) if op.position == 0 else (lc, lb)
        free = [d for d in range(act.ndim) if d not in contract and d not in batch]
        entries = [e if d in free else None for d, e in enumerate(entries_of(act_spec, act.ndim))]
        if all(e is None for e in entries):
            entries = self._split_one(act.shape, free, entries)
        unit_free = unit_ndim - len(contract) - len(batch)
        act_out = [entries[d] for d in free]
        batch_out = [None] * len(batch)
        out = (
            [*batch_out, *([None] * unit_free), *act_out]
            if op.position == 0
            else [*batch_out, *act_out, *([None] * unit_free)]
        )
        act_spec = PartitionSpec(*entries)
        out_spec = PartitionSpec(*out)
        arrays, given_specs, given_meta = self._given(given, act, entries)

        wait, token, token_spec = self.token(unit, act, act_spec)
        op = dataclasses.replace(op, early=wait == "none")

        def body(a, leaves, given_arrays, pick, token):
            g = None if given_meta is None else given_meta(given_arrays)
            return unit_gemm(op, a, leaves, g, pick, {"own": OWN, "none": None}.get(wait, token))

        pick_specs = (PartitionSpec(),) * len(unit.pick)
        specs = (act_spec, unit.leaf_specs(), given_specs, pick_specs, token_spec)
        fn = self.islands.island(body, specs, out_spec)
        return fn(act, unit.leaves, arrays, unit.pick, token), _spec_of(out)

    def token(self, unit: UnitValue, act, act_spec):
        """What the forward gathers of ``unit`` wait for: ``(how, island operand, its spec)``.
        ``"own"``: the op's own input (``prefetch=0``, or no earlier layer to wait for);
        ``"none"``: nothing (a layer a loop reads per iteration: a slice of a scan's stacked
        input or a traced index; XLA may start it any time in the iteration, and XLA:GPU's
        collective pipeliner one iteration ahead); ``"layer"``: the input of the layer
        ``prefetch`` layers before (a Python loop over layers, by the first index in the unit's
        path: ``blocks/3/...``), the operand.
        A layer's input is its first unit op's activation, and only a layer of the same
        region (not across a rematerialised region or a loop body) is waited for."""
        if not self.islands.prefetch:
            return "own", (), ()
        if unit.sliced or unit.pick:
            return "none", (), ()
        layer = _layer_key(unit.name)
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
        return "layer", earlier, PartitionSpec(*entries_of(spec, earlier.ndim))

    @contextlib.contextmanager
    def inside(self):
        """Evaluating a body of its own (a rematerialised region, a loop body, a branch): layers
        seen there are not waited for outside it, nor the outer ones inside (``token``)."""
        saved = self.region
        self.regions += 1
        self.region = self.regions
        try:
            yield
        finally:
            self.region = saved

    def lookup_island(self, op: UnitOp, others: tuple, other_specs, unit: UnitValue, out_spec: Spec, out_ndim: int):
        """A lookup of the unit: the indices split as the batch split reaches them, the rows
        looked up on each device for its indices."""
        specs = tuple(PartitionSpec(*entries_of(s, np.ndim(x))) for s, x in zip(other_specs, others))
        fn = self.islands.island(
            lambda leaves, others, pick: unit_lookup(op, others, leaves, pick),
            (unit.leaf_specs(), specs, (PartitionSpec(),) * len(unit.pick)),
            PartitionSpec(*entries_of(out_spec, out_ndim)),
        )
        return fn(unit.leaves, others, unit.pick)

    def _split_one(self, shape, free, entries) -> list:
        n = int(np.prod([self.islands.sizes[a] for a in self.islands.axes]))
        for d in free:
            if shape[d] % n == 0 and shape[d] > 0:
                entries = list(entries)
                entries[d] = self.islands.entry
                return entries
        return entries

    def _given(self, given, act, entries):
        """The MXFP8 planes of ``act`` (``gemm_operand``) as island operands split like ``act``:
        rowwise planes as ``act``; columnwise ones ``[M, K]``, ``[M/32, K]`` reshaped so that their
        rows show ``act``'s leading axes (or the given row ``order``), else left out (the GEMM
        then quantizes its wgrad input itself)."""
        if given is None:
            return (), (), None
        given, _ = given
        normed, codes, scales, cq, cs = given.arrays
        if normed.shape != act.shape:
            return (), (), None
        lead = entries[:-1]
        if entries[-1] is not None:
            return (), (), None
        row_specs = (PartitionSpec(*entries), PartitionSpec(*entries), PartitionSpec(*entries))
        col = None
        if cq is not None:
            col = _columnwise_rows(act.shape[:-1], lead, given.order, self.islands.sizes)
        if col is None:
            arrays, specs = (normed, codes, scales), row_specs

            def rebuild(a):
                return mxfp8_gemm.GivenOperand((*a, None, None), None)

            return arrays, specs, rebuild
        rows, col_entries, local_order = col
        k = cq.shape[-1]
        cq = cq.reshape(*rows, k)
        cs = cs.reshape(*rows[:-1], rows[-1] // 32, k)
        spec = PartitionSpec(*col_entries, None)

        def rebuild_col(a):
            normed, codes, scales, q, s = a
            order = None if given.order is None else local_order(q.shape[:-1])
            return mxfp8_gemm.GivenOperand((normed, codes, scales, q.reshape(-1, k), s.reshape(-1, k)), order)

        return (normed, codes, scales, cq, cs), (*row_specs, spec, spec), rebuild_col

    def _transposed(self, unit: UnitValue, dims, position: int) -> bool:
        g = unit.geometry
        roles = dot_roles(unit.view, dims, position)
        if roles is not None and tuple(roles[2]) == g.batch_axes:
            if set(roles[0]) == set(g.k_axes):
                return False
            if set(roles[0]) == set(g.n_axes):
                return True
        raise _misused(unit, f"a dot_general contracting its axes {roles and roles[0]}")

    # -- loops and regions ----------------------------------------------------------------------------

    def scan(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        parts = jaxprs.scan_parts(eqn)
        nc, ncar = parts.num_consts, parts.num_carry
        consts, carry, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        c_specs, k_specs, x_specs = in_specs[:nc], in_specs[nc : nc + ncar], in_specs[nc + ncar :]
        carry = [self.output(_not_a_unit(x, "carried through a loop"), "") for x in carry]
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
                        lambda leaves, x=x, view=view: dataclasses.replace(
                            x, leaves=tuple(leaves), view=view, sliced=True
                        ),
                    )
                )
                xs_in.extend(x.leaves)
            elif isinstance(x, PlainValue):
                if x.ops or x.shard_axis == 0:
                    raise AssertionError(f"{x.name}: a scan slices a plain parameter along its split or viewed axes")
                axis = None if x.shard_axis is None else x.shard_axis - 1
                rebuild.append(
                    (
                        len(xs_in),
                        1,
                        lambda leaves, x=x, axis=axis: dataclasses.replace(x, array=leaves[0], shard_axis=axis),
                    )
                )
                xs_in.append(x.array)
            else:
                rebuild.append((len(xs_in), 1, lambda leaves: leaves[0]))
                xs_in.append(x)
        body_x_specs = [fsdp_specs.sliced(s) for s in x_specs]
        body_c_specs = [None] * len(parts.consts)
        k_specs = self.rules.scan_carry(parts, list(c_specs), list(k_specs), body_x_specs)
        forwarded: dict[int, int] = {}  # body output -> the xs entry it hands back unchanged
        y_specs: list = []

        def step(carry, xs_slices):
            sliced = [make(xs_slices[start : start + count]) for start, count, make in rebuild]
            with self.inside():
                outs, out_specs = self.eval(
                    parts.jaxpr,
                    parts.consts,
                    body_c_specs,
                    [*consts, *carry, *sliced],
                    [*c_specs, *k_specs, *body_x_specs],
                )
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

        carry_out, ys = lax.scan(step, carry, xs_in, length=parts.length, reverse=parts.reverse, unroll=parts.unroll)
        ys = iter(ys)
        n_ys = len(eqn.outvars) - ncar
        outs = [*carry_out, *(xs[forwarded[k]] if k in forwarded else next(ys) for k in range(n_ys))]
        stacked = [None if s is None else (None, *s) for s in y_specs]
        return outs, [*k_specs, *stacked]

    def cond(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        """A ``cond`` / ``switch`` whose branches read parameters: every branch evaluated here
        (its reads in islands) inside ``lax.switch``. The index is a global value, so every
        device takes the same branch and runs the same gathers. A stack that the branches read
        only as one static layer (``w[i]`` in a Python loop) enters the ``cond`` as that layer:
        the ``cond``'s gradient for it is then one layer's, not a zero-padded stack per ``cond``.
        A layer picked from a stack by a traced index is picked before the op inside a branch:
        jax saves a branch's residuals as outputs of the ``cond``, so the op's backward keeps that
        layer's planes rather than the stack's."""
        branches = jaxprs.cond_branches(eqn)
        operands, slicers = list(ins[1:]), {}
        for k, x in enumerate(operands):
            found = _static_index(branches, k) if isinstance(x, Symbolic) else None
            picked = None if found is None else self.index(found[0], [x])
            if isinstance(picked, UnitValue):
                picked = dataclasses.replace(picked, leaves=picked.picked_leaves(), pick=())
            if picked is not None:  # every branch reads x[i] for one static i: i picked here
                operands[k] = picked
                slicers.update((id(e), k) for e in found)
        flat, rebuild = _flatten(operands)
        out_specs: list = []

        def make(inner, consts):
            def branch(*flat):
                args = [_rebuild(x, flat[start : start + count]) for start, count, x in rebuild]
                self.branches += 1
                self.substitutes.update((e, args[k]) for e, k in slicers.items())
                try:
                    with self.inside():
                        outs, specs = self.eval(inner, consts, [None] * len(consts), args, in_specs[1:])
                finally:
                    self.branches -= 1
                    for e in slicers:
                        self.substitutes.pop(e, None)
                out_specs.append(specs)
                return [self.output(o, "returned by a cond branch") for o in outs]

            return branch

        outs = lax.switch(ins[0], [make(*b) for b in branches], *flat)
        specs = [s if all(o[k] == s for o in out_specs) else None for k, s in enumerate(out_specs[0])]
        return list(outs), specs

    def while_loop(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        """A ``while`` loop whose body reads parameters, evaluated here: forward only (jax has no
        reverse-mode derivative of a while loop; the step refuses to train through one)."""
        parts = jaxprs.while_parts(eqn)
        nc, nb = parts.cond_nconsts, parts.body_nconsts
        c_consts, b_consts = ins[:nc], ins[nc : nc + nb]
        carry = [self.output(_not_a_unit(x, "carried through a loop"), "") for x in ins[nc + nb :]]
        c_specs, b_specs = in_specs[:nc], in_specs[nc : nc + nb]
        none = [None] * len(carry)
        (cj, cc), (bj, bc) = parts.cond, parts.body

        def cond_fn(carry):
            with self.inside():
                outs, _ = self.eval(cj, cc, [None] * len(cc), [*c_consts, *carry], [*c_specs, *none])
            return outs[0]

        def body_fn(carry):
            with self.inside():
                outs, _ = self.eval(bj, bc, [None] * len(bc), [*b_consts, *carry], [*b_specs, *none])
            return [self.output(o, "carried through a loop") for o in outs]

        return list(lax.while_loop(cond_fn, body_fn, carry)), none

    def remat(self, eqn, ins, in_specs) -> tuple[list, list[Spec]]:
        jaxpr, consts = jaxprs.remat_body(eqn)
        inputs = {v: k for k, v in enumerate(jaxpr.invars)}
        passed = [inputs.get(v) if not isinstance(v, jcore.Literal) else None for v in jaxpr.outvars]
        flat, rebuild = _flatten(ins)
        out_specs: list = []

        def region(*flat):
            args = [_rebuild(x, flat[start : start + count]) for start, count, x in rebuild]
            with self.inside():
                outs, specs = self.eval(jaxpr, consts, [None] * len(consts), args, in_specs)
            out_specs[:] = specs
            return [self.output(o, "returned by a rematerialised region") for o, p in zip(outs, passed) if p is None]

        policy = eqn.params.get("policy")
        if policy is None:
            # under prefetch, a loop's per-iteration layer is recomputed without waiting for the
            # cotangent, like the backward's own gathers (fsdp_unit's ``early``): in a scan the
            # forward's gathers are in another loop, nothing to merge with
            free = [
                self.islands.prefetch > 0 and isinstance(x, UnitValue) and bool(x.sliced or x.pick)
                for _, count, x in rebuild
                for _ in range(count)
            ]
            computed = rematerialize(region, flat, free)
        else:
            computed = jax.checkpoint(region, prevent_cse=eqn.params.get("prevent_cse", True), policy=policy)(*flat)
        computed = iter(computed)
        outs = [ins[p] if p is not None else next(computed) for p in passed]
        specs = [in_specs[p] if p is not None else s for p, s in zip(passed, out_specs or [None] * len(passed))]
        return outs, specs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gather_after(entry, axis: int, local: jax.Array, dep: jax.Array) -> jax.Array:
    """``local`` all-gathered along ``axis`` over ``entry``, once ``dep`` exists; its transpose
    reduce-scatters the cotangent and needs nothing of ``dep`` (a plain ``after`` would make the
    backward keep ``dep``, and so recompute it under remat)."""
    return lax.all_gather(after(local, dep), entry, axis=axis, tiled=True)


def _gather_after_fwd(entry, axis, local, dep):
    return gather_after(entry, axis, local, dep), None


def _gather_after_bwd(entry, axis, _, ct):
    return lax.psum_scatter(ct, entry, scatter_dimension=axis, tiled=True), None


gather_after.defvjp(_gather_after_fwd, _gather_after_bwd)


def _columnwise_rows(lead_shape, lead_entries, order, sizes):
    """How columnwise planes ``[M, K]`` over the rows of ``normed [*lead, K]`` are reshaped so
    their split shows: ``(rows shape, entries, local order fn)``, or None when it cannot.

    Rows in ``normed``'s own order: ``[*lead, K]``; rows in a given ``order (p, b, s)`` (of
    rows ``normed`` holds as ``[b, p * s]``): ``[p, b, s, K]`` with ``b`` split as ``normed``'s
    first axis. The scales need the last row axis to be a multiple of 32."""
    if order is None:
        rows, entries = tuple(lead_shape), tuple(lead_entries)
    else:
        if len(lead_shape) != 2 or any(e is not None for e in lead_entries[1:]):
            return None
        p, b, s = order
        rows, entries = (p, b, s), (None, lead_entries[0], None)
    if rows[-1] % 32 or (entries and entries[-1] is not None):
        return None
    for d, e in zip(rows, entries):
        if e is not None and d % fsdp_specs.axes_count(e, sizes):
            return None
    return rows, entries, (lambda local_rows: tuple(local_rows))


def _reduce_scatter(x: jax.Array, params: dict) -> jax.Array:
    """``lax.psum_scatter`` as one all-to-all and a local sum (the same bytes on the wire): jax
    cannot lower a reduce-scatter over an outer manual axis inside a nested ``shard_map`` (it
    traces the reducer against the wrong mesh), an all-to-all has no reducer. The parts are
    added in device order."""
    d, tiled = params["scatter_dimension"], params.get("tiled", False)
    axis = params["axis_name"]
    n = int(params.get("axis_size") or lax.axis_size(axis))
    m = x.shape[d] // n  # untiled: the axis is the n parts themselves (m = 1, squeezed after)
    y = lax.all_to_all(x, axis, split_axis=d, concat_axis=d, tiled=True)  # chunk this device owns, from each
    y = y.reshape(*x.shape[:d], n, m, *x.shape[d + 1 :]).sum(axis=d)
    return y if tiled else jnp.squeeze(y, d)


def _body_of_ours(eqn) -> bool:
    """An inlined call, a rematerialised region or a scan: a body this evaluator walks (under
    tensor parallelism, also when no parameter enters it: the model's collectives inside)."""
    return eqn.primitive in INLINED_CALLS or eqn.primitive is jaxprs.REMAT or eqn.primitive is jaxprs.SCAN


def _splits_no_contraction(eqn, in_specs) -> bool:
    """A ``dot_general`` none of whose operands is split along an axis it contracts (each
    device's part of the product is then a part of the output, not a partial sum)."""
    if eqn.primitive is not P.dot_general_p:
        return False
    (lc, rc), _ = eqn.params["dimension_numbers"]
    return all(s is None or all(s[d] is None for d in c) for s, c in zip(in_specs, (lc, rc)))


def _spec_of(entries) -> Spec:
    t = tuple(entries)
    return t if any(e is not None for e in t) else None


def _layer_key(name: str) -> str | None:
    """The layer a parameter belongs to in a Python loop over layers: its path up to the first
    index (``blocks/3/attn/q/kernel`` -> ``blocks/3``); None outside such a list."""
    parts = name.split("/")
    k = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return None if k is None else "/".join(parts[: k + 1])


def _static_index(branches, k: int) -> list | None:
    """The equations of ``branches`` that read the ``k``-th operand, when each is a ``slice``
    with the same static indices and nothing else reads it (None otherwise)."""
    found, params = [], None
    for inner, _ in branches:
        v = inner.invars[k]
        if v in inner.outvars:
            return None
        for e in inner.eqns:
            if not any(u is v for u in e.invars):
                continue
            if e.primitive is not P.slice_p or e.invars[0] is not v:
                return None
            if params is not None and e.params != params:
                return None
            params = e.params
            found.append(e)
    return found or None


def _flatten(ins) -> tuple[list, list]:
    """The arrays of ``ins`` (a unit's leaves, a plain parameter's array, values) in one list,
    and ``(start, count, value)`` to rebuild each from it (``_rebuild``)."""
    flat, rebuild = [], []
    for x in ins:
        leaves = x.arrays() if isinstance(x, UnitValue) else (x.array,) if isinstance(x, PlainValue) else (x,)
        rebuild.append((len(flat), len(leaves), x))
        flat.extend(leaves)
    return flat, rebuild


def _reshape_op(shape: tuple[int, ...], out_aval) -> tuple:
    """``(primitive, params)`` of the reshape from ``shape`` to ``out_aval``'s shape, as this jax
    writes it (replayed on a layer picked by ``_pick`` to give what the index op gave)."""
    closed = jax.make_jaxpr(lambda v: jnp.reshape(v, out_aval.shape))(jax.ShapeDtypeStruct(shape, out_aval.dtype))
    (eqn,) = closed.jaxpr.eqns
    return eqn.primitive, dict(eqn.params)


def _rebuild(x, leaves):
    if isinstance(x, UnitValue):
        return x.with_arrays(leaves)
    if isinstance(x, PlainValue):
        return dataclasses.replace(x, array=leaves[0])
    return leaves[0]


def rematerialize(fn, args: list, free=()) -> list:
    """``fn(*args)``, its intermediates recomputed in the backward instead of saved: a
    ``custom_vjp`` saving ``args`` whose backward re-runs ``fn`` on them made to depend on the
    cotangent (``after``), so nothing of the recompute runs before it is needed or merges with
    the forward; the args ``free`` marks (True) are left as they are."""

    @jax.custom_vjp
    def region(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), args

    def bwd(args, cts):
        token = next((c for c in cts if jnp.issubdtype(c.dtype, jnp.floating) and c.size), None)
        numeric = [
            (jnp.issubdtype(a.dtype, jnp.number) or jnp.issubdtype(a.dtype, jnp.bool_))
            and not (k < len(free) and free[k])
            for k, a in enumerate(args)
        ]
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
