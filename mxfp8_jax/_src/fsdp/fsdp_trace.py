"""How a loss reads each parameter: found by following the parameter through the loss's jaxpr.

FSDP decides what a parameter becomes by what the model does with it, not by the layer class
that holds it (as qwix intercepts operations, not modules). ``trace_uses`` traces
``loss_fn(model, batch)`` with the parameters as inputs and follows each one through the ops
that only move or retype its elements (``convert_element_type``, ``transpose``, ``reshape``,
``squeeze``, size-1 ``broadcast_in_dim``, ``copy``), into and out of ``jit``, ``remat`` and
``scan`` bodies, to the op that reads its values:

- ``dot_general`` with an activation: a GEMM. The parameter axes the GEMM contracts are its
  ``K`` axes, its batch axes (an MoE's expert axis) are stack axes, the others its ``N`` axes.
- ``gather`` / ``dynamic_slice`` of rows: a lookup (``nnx.Embed``, ``table[ids]``).
- anything else (a norm's scale multiplied in, a bias added, a custom_vjp): ``other``.

A parameter that a ``scan`` slices (the stacked weights of ``nnx.vmap`` + ``nnx.scan``) is read
one layer at a time: the leading axes the scans slice off are its stack axes (``level``). So is
a parameter indexed on its leading axes (``w[i]``: a ``dynamic_slice`` by a ``fori_loop``
counter, a static ``slice`` in a Python loop) before it is read: the indexed axes are layer
axes too. The trace follows ``cond`` / ``switch`` branches and ``while`` bodies, and counts how
many times each use runs per step (``trips``: the lengths of the enclosing scans; None inside a
``while``, whose trip count is not known when tracing).

Besides the uses, one dataflow fact: which parameters' GEMM outputs reach another parameter's
GEMM. A parameter whose GEMMs feed none is an output head (the logits), kept in bf16 by default
as MXFP8 recipes do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import INLINED_CALLS, primitives

P = jcore.primitives

# Ops that only move or retype the elements of their first operand: a parameter read through
# them is still the parameter (a view).
VIEW_PRIMITIVES = primitives(
    "convert_element_type_p",
    "transpose_p",
    "reshape_p",
    "squeeze_p",
    "broadcast_in_dim_p",
    "copy_p",
    "sharding_constraint_p",
)
RETYPE_PRIMITIVES = primitives("convert_element_type_p", "copy_p", "sharding_constraint_p")
LOOKUP_PRIMITIVES = primitives("gather_p", "dynamic_slice_p")
INDEX_PRIMITIVES = primitives("slice_p", "dynamic_slice_p")


@dataclasses.dataclass(frozen=True)
class View:
    """A parameter's value as some op of the loss sees it.

    ``axes[i]`` are the parameter axes that axis ``i`` of the value spans (several after a
    reshape merges them; one parameter axis may be split over several value axes; a size-1 axis
    spans none). ``level``: the leading parameter axes enclosing scans have sliced off.
    ``moved``: an op other than a retype changed the axes (a scan can then no longer slice it).
    """

    param: int
    axes: tuple[tuple[int, ...], ...]
    level: int = 0
    moved: bool = False


@dataclasses.dataclass(frozen=True)
class Use:
    """One op reading a parameter.

    ``kind``: ``"gemm"``, ``"lookup"`` or ``"other"``. For a GEMM, ``contract`` / ``free`` /
    ``batch`` are the parameter axes it contracts, keeps, and batches over (in the dot's batch
    order). ``level``: the parameter's leading axes sliced off by scans at that point.
    ``remat``: inside a rematerialised region (its gathers run again in the backward).
    ``what``: the op, for plans and errors. ``trips``: how many times it runs per step (the
    product of the enclosing scans' lengths; None inside a ``while`` loop). ``branch``: inside
    a ``cond`` / ``switch`` branch (it runs when that branch is taken).
    """

    kind: str
    level: int
    what: str
    contract: tuple[int, ...] = ()
    free: tuple[int, ...] = ()
    batch: tuple[int, ...] = ()
    remat: bool = False
    site: int = 0
    trips: int | None = 1
    branch: bool = False


@dataclasses.dataclass
class Uses:
    """``by_param[j]``: the uses of parameter ``j``; ``feeds_gemm``: parameters whose GEMM
    outputs reach another parameter's GEMM."""

    by_param: list[list[Use]]
    feeds_gemm: set[int]

    def is_head(self, j: int) -> bool:
        """Parameter ``j`` has GEMMs and none of their outputs reaches another GEMM."""
        return any(u.kind == "gemm" for u in self.by_param[j]) and j not in self.feeds_gemm


def trace_uses(fn: Callable, params: Sequence[Any], *args) -> tuple[Uses, jcore.ClosedJaxpr]:
    """The uses of every entry of ``params`` (arrays or ``jax.ShapeDtypeStruct``s) in
    ``fn(params, *args)``, and the closed jaxpr they were read from."""
    closed, _ = trace(fn, params, *args)
    return analyse(closed, len(params)), closed


def trace(fn: Callable, params: Sequence[Any], *args, bound=(), forbidden=()) -> tuple[jcore.ClosedJaxpr, Any]:
    """``fn(params, *args)`` traced, with the mesh axes ``bound`` (``(name, size)`` pairs: the
    tensor-parallel axis, which the model's own collectives name) in the axis environment; the
    jaxpr and the shapes of the outputs.

    A function that names one of the ``forbidden`` axes (the FSDP axes: the loss sees the whole
    batch, so a collective over them has no meaning) raises a ``ValueError`` that says which
    ops do and what to do, instead of jax's unbound-axis ``NameError``."""
    try:
        return jax.make_jaxpr(fn, axis_env=list(bound), return_shape=True)(list(params), *args)
    except NameError as err:
        names = [name for name, _ in forbidden if repr(name) in str(err) or f" {name}" in str(err)]
        if not names:
            raise
        closed = jax.make_jaxpr(fn, axis_env=[*bound, *forbidden])(list(params), *args)
        ops = sorted(collectives_over(closed, {name for name, _ in forbidden}))
        sizes = dict(forbidden)
        raise ValueError(
            f"loss_fn names the mesh axis {', '.join(map(repr, names))} that FSDP splits the batch over "
            f"({', '.join(ops) or 'an axis query'}). FSDP evaluates loss_fn on the whole batch, as jax.jit does "
            f"with a sharded batch: its means, sums and batch statistics are global already, and a psum over "
            f"{names[0]!r} would count every value {sizes[names[0]]} times. Drop the axis name (the axis_name= of "
            f"nnx.BatchNorm and similar layers, the lax.psum / pmean over it in the loss)"
        ) from None


_AXIS_PARAMS = ("axis_name", "axes", "axis_names")


def collectives_over(closed, names: set) -> set[str]:
    """The primitives of ``closed`` (nested bodies included) that name one of the mesh axes
    ``names`` (``psum``, ``all_gather``, ``axis_index``, ...)."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for key in _AXIS_PARAMS:
                value = eqn.params.get(key)
                values = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
                if any(isinstance(v, str) and v in names for v in values):
                    found.add(eqn.primitive.name)
            for sub in jaxprs.sub_jaxprs(eqn):
                walk(jaxprs.body(sub)[0])

    walk(jaxprs.body(closed)[0])
    return found


def analyse(closed: jcore.ClosedJaxpr, num_params: int) -> Uses:
    """The uses of the first ``num_params`` inputs of ``closed``."""
    walker = _Walker(num_params)
    jaxpr, consts = jaxprs.body(closed)
    args = []
    for i, v in enumerate(jaxpr.invars):
        if i < num_params:
            args.append(View(i, tuple((a,) for a in range(len(v.aval.shape)))))
        else:
            args.append(frozenset())
    outs = walker.walk(jaxpr, [frozenset()] * len(consts), args, remat=False)
    for out in outs:
        if isinstance(out, View):
            walker.use(out, "other", "returned by the loss function", remat=False)
    return Uses([sorted(walker.uses[j], key=lambda u: u.site) for j in range(num_params)], walker.fed)


# ------------------------------------------------------------------------------------------------
# Views through layout ops


def view_through(prim, params, view: View, in_shape, out_shape) -> View | None:
    """The view after ``prim``, or None when the op is not a pure move of the parameter's
    elements (a real broadcast)."""
    axes = view.axes
    if prim in RETYPE_PRIMITIVES:
        return view
    if prim is P.transpose_p:
        return dataclasses.replace(view, axes=tuple(axes[p] for p in params["permutation"]), moved=True)
    if prim is P.squeeze_p:
        drop = {d % len(in_shape) for d in params["dimensions"]}
        return dataclasses.replace(view, axes=tuple(a for i, a in enumerate(axes) if i not in drop), moved=True)
    if prim is P.broadcast_in_dim_p:
        dims = params["broadcast_dimensions"]
        new = [()] * len(out_shape)
        for i, d in enumerate(dims):
            if in_shape[i] != out_shape[d]:
                return None  # a size-1 axis broadcast: a real broadcast
            new[d] = axes[i]
        if any(out_shape[d] != 1 for d in range(len(out_shape)) if d not in dims):
            return None
        return dataclasses.replace(view, axes=tuple(new), moved=True)
    if prim is P.reshape_p:
        if params.get("dimensions") is not None:
            return None
        return dataclasses.replace(view, axes=reshape_axes(axes, in_shape, out_shape), moved=True)
    raise AssertionError(prim)


def index_view(prim, params, view: View, in_shape) -> View | None:
    """The view after a ``slice`` / ``dynamic_slice`` that takes one index of the parameter's
    leading axes (from ``view.level`` on, not moved) and every element of the others: those
    axes become layer axes (``level`` grows by their number). None for any other slice."""
    if prim is P.slice_p:
        if any(s != 1 for s in params.get("strides") or ()):
            return None
        sizes = [hi - lo for lo, hi in zip(params["start_indices"], params["limit_indices"])]
    else:
        sizes = list(params["slice_sizes"])
    if view.moved:
        return None
    m = 0
    while m < len(sizes) and sizes[m] == 1 and view.axes[m] == (view.level + m,):
        m += 1
    if m == 0 or any(sizes[d] != in_shape[d] for d in range(m, len(sizes))):
        return None
    return dataclasses.replace(view, axes=((),) * m + view.axes[m:], level=view.level + m, moved=True)


def reshape_axes(axes, in_shape, out_shape) -> tuple[tuple[int, ...], ...]:
    """The parameter axes of each output axis of a reshape: every output axis of a group of
    input and output axes with equal products spans the group's input axes."""
    out = [()] * len(out_shape)
    for gi, gj in jaxprs.reshape_groups(in_shape, out_shape):
        spanned = tuple(sorted({a for k in gi for a in axes[k]}))
        for k in gj:
            out[k] = spanned
    return tuple(out)


def dot_roles(view: View, dims, position: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``(contract, free, batch)`` parameter axes of a ``dot_general`` whose operand
    ``position`` (0: lhs, 1: rhs) is ``view``; None when one parameter axis plays two roles
    (a reshape mixed a contracted axis with a kept one)."""
    (lc, rc), (lb, rb) = dims
    contract_dims, batch_dims = (lc, lb) if position == 0 else (rc, rb)
    span = lambda ds: [a for d in ds for a in view.axes[d]]
    contract, batch = span(contract_dims), span(batch_dims)
    free = span([d for d in range(len(view.axes)) if d not in contract_dims and d not in batch_dims])
    roles = contract + batch + free
    if len(roles) != len(set(roles)):
        return None
    return tuple(sorted(contract)), tuple(sorted(free)), tuple(batch)


# ------------------------------------------------------------------------------------------------
# The walk


class _Walker:
    """Abstract evaluation of a jaxpr: each value is a ``View`` of a parameter or the set of
    parameters whose GEMM outputs it depends on. ``trips`` / ``branch``: the loop and branch
    context of the equations being walked (``Use.trips``, ``Use.branch``)."""

    def __init__(self, num_params: int) -> None:
        self.uses: list[set[Use]] = [set() for _ in range(num_params)]
        self.fed: set[int] = set()
        self._sites: dict[int, int] = {}
        self.trips: int | None = 1
        self.branch = False

    def site(self, eqn) -> int:
        return self._sites.setdefault(id(eqn), len(self._sites))

    def use(self, view: View, kind: str, what: str, *, remat: bool, site: int = 0, roles=((), (), ())) -> None:
        contract, free, batch = roles
        self.uses[view.param].add(
            Use(kind, view.level, what, contract, free, batch, remat, site, self.trips, self.branch)
        )

    def walk(self, jaxpr: jcore.Jaxpr, consts, args, *, remat: bool) -> list:
        env: dict = {}

        def read(v):
            return frozenset() if isinstance(v, jcore.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars], remat=remat)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def inside(self, jaxpr, consts, args, *, remat: bool, trips: int | None = 1, branch: bool = False) -> list:
        """``walk`` of a body that runs ``trips`` times per run of the enclosing one (None: a
        ``while`` body), or in a branch."""
        saved = self.trips, self.branch
        self.trips = None if trips is None or self.trips is None else self.trips * trips
        self.branch = self.branch or branch
        try:
            return self.walk(jaxpr, consts, args, remat=remat)
        finally:
            self.trips, self.branch = saved

    def eqn(self, eqn, ins: list, *, remat: bool) -> list:
        prim, params = eqn.primitive, eqn.params
        views = [x for x in ins if isinstance(x, View)]
        n_out = len(eqn.outvars)
        if prim in INLINED_CALLS:
            inner, consts = jaxprs.call_body(eqn)
            return self.walk(inner, [frozenset()] * len(consts), ins, remat=remat)
        if prim is jaxprs.REMAT:
            inner, consts = jaxprs.remat_body(eqn)
            return self.walk(inner, [frozenset()] * len(consts), ins, remat=True)
        if prim is jaxprs.SCAN:
            return self.scan(eqn, ins, remat=remat)
        if prim is jaxprs.COND and views:
            return self.cond(eqn, ins, remat=remat)
        if prim is jaxprs.WHILE and views:
            return self.while_loop(eqn, ins, remat=remat)
        if not views:
            deps = frozenset().union(*ins) if ins else frozenset()
            return [deps] * n_out
        if prim in VIEW_PRIMITIVES and isinstance(ins[0], View) and len(views) == 1:
            out = view_through(prim, params, ins[0], eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
            if out is not None:
                return [out]
            self.use(ins[0], "other", f"{prim.name} (a broadcast)", remat=remat)
            return [frozenset()]
        if prim in INDEX_PRIMITIVES and isinstance(ins[0], View) and len(views) == 1:
            out = index_view(prim, params, ins[0], eqn.invars[0].aval.shape)
            if out is not None:
                return [out]
        if prim is P.dot_general_p and len(views) == 1:
            return [self.dot(eqn, ins, remat=remat)]
        if prim in LOOKUP_PRIMITIVES and isinstance(ins[0], View) and len(views) == 1:
            self.use(ins[0], "lookup", prim.name, remat=remat, site=self.site(eqn))
            return [frozenset()]
        for x in views:
            if jaxprs.sub_jaxprs(eqn):
                what = f"passed into {prim.name} (a higher-order primitive FSDP does not follow into)"
            elif prim is P.dot_general_p:
                what = "a dot_general of two parameters"
            else:
                what = prim.name
            self.use(x, "other", what, remat=remat, site=self.site(eqn))
        deps = frozenset().union(*(x for x in ins if not isinstance(x, View)))
        return [deps] * n_out

    def dot(self, eqn, ins, *, remat: bool):
        position = 0 if isinstance(ins[0], View) else 1
        view, act = ins[position], ins[1 - position]
        roles = dot_roles(view, eqn.params["dimension_numbers"], position)
        if roles is None:
            self.use(view, "other", "a dot_general that contracts part of a reshaped axis", remat=remat)
            return act
        self.use(view, "gemm", "dot_general", remat=remat, site=self.site(eqn), roles=roles)
        self.fed.update(act)
        return act | {view.param}

    def _returned(self, outs, how: str, *, remat: bool) -> list:
        result = []
        for o in outs:
            if isinstance(o, View):
                self.use(o, "other", how, remat=remat)
                o = frozenset()
            result.append(o)
        return result

    def cond(self, eqn, ins, *, remat: bool) -> list:
        """Every branch walked on the operands (a parameter's uses are those of all branches);
        an output depends on what it depends on in any branch."""
        outs = [frozenset()] * len(eqn.outvars)
        for inner, consts in jaxprs.cond_branches(eqn):
            got = self.inside(inner, [frozenset()] * len(consts), ins[1:], remat=remat, branch=True)
            got = self._returned(got, "returned by a cond branch", remat=remat)
            outs = [a | b for a, b in zip(outs, got)]
        return outs

    def while_loop(self, eqn, ins, *, remat: bool) -> list:
        parts = jaxprs.while_parts(eqn)
        nc, nb = parts.cond_nconsts, parts.body_nconsts
        c_consts, b_consts, carry = ins[:nc], ins[nc : nc + nb], list(ins[nc + nb :])
        carry = self._returned(carry, "carried through a loop", remat=remat)
        (cj, cc), (bj, bc) = parts.cond, parts.body
        for _ in range(16):
            self.inside(cj, [frozenset()] * len(cc), c_consts + carry, remat=remat, trips=None)
            outs = self.inside(bj, [frozenset()] * len(bc), b_consts + carry, remat=remat, trips=None)
            outs = self._returned(outs, "carried through a loop", remat=remat)
            grown = [c | o for c, o in zip(carry, outs)]
            if grown == carry:
                break
            carry = grown
        return carry

    def scan(self, eqn, ins, *, remat: bool) -> list:
        parts = jaxprs.scan_parts(eqn)
        nc, ncar = parts.num_consts, parts.num_carry
        consts, carry, xs = ins[:nc], list(ins[nc : nc + ncar]), ins[nc + ncar :]
        for k, x in enumerate(carry):
            if isinstance(x, View):
                self.use(x, "other", "carried through a loop", remat=remat)
                carry[k] = frozenset()
        body_xs = []
        for x in xs:
            if isinstance(x, View):
                if x.moved or not x.axes or x.axes[0] != (x.level,):
                    self.use(x, "other", "sliced by a scan after its axes were moved", remat=remat)
                    body_xs.append(frozenset())
                else:
                    body_xs.append(dataclasses.replace(x, axes=x.axes[1:], level=x.level + 1))
            else:
                body_xs.append(x)
        body_consts = [frozenset()] * len(parts.consts)
        for _ in range(16):  # the carries' dependencies, to a fixed point
            outs = self.inside(parts.jaxpr, body_consts, consts + carry + body_xs, remat=remat, trips=parts.length)
            grown = [c | o if not isinstance(o, View) else c for c, o in zip(carry, outs[:ncar])]
            if grown == carry:
                break
            carry = grown
        result = []
        for k, o in enumerate(outs):
            if not isinstance(o, View):
                result.append(o)
                continue
            if k >= ncar:  # a stacked output: the body handing back the slice it was given
                j = next((i for i, b in enumerate(body_xs) if b == o), None)
                if j is not None:
                    result.append(xs[j])
                    continue
            self.use(o, "other", "returned by a scan body", remat=remat)
            result.append(frozenset())
        return result


def describe_shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def product(dims) -> int:
    return int(np.prod(dims, dtype=np.int64)) if len(dims) else 1
