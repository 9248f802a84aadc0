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
one layer at a time: the parameter axes the scans slice off are its layer axes (``layers``),
the leading ones or any other a ``transpose`` moved to lead before the scan (MaxText's stacks on
axis 1, ``nnx.scan`` over ``in_axes=1``, ``jnp.moveaxis`` before ``lax.scan``). So is
a parameter indexed on its leading axes (``w[i]``: a ``dynamic_slice`` by a ``fori_loop``
counter, a static ``slice`` in a Python loop) before it is read: the indexed axes are layer
axes too. The trace follows ``cond`` / ``switch`` branches and ``while`` bodies, and counts how
many times each use runs per step (``trips``: the lengths of the enclosing scans; None inside a
``while``, whose trip count is not known when tracing).

Besides the uses, one dataflow fact: which parameters' GEMM outputs reach another parameter's
GEMM. A parameter whose GEMMs feed none is an output head (the logits), kept in bf16 by default
as MXFP8 recipes do.

The walk is ``fsdp_walk``'s traversal with the rules of ``_Walker``: views through ``VIEWS``,
indices, lookups and GEMMs by primitive, loops and branches by kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import primitives
from mxfp8_jax._src.fsdp.fsdp_walk import Body, Remat, Rule, Scan, Traversal, While, first

P = jcore.primitives

LOOKUP_PRIMITIVES = primitives("gather_p", "dynamic_slice_p")
INDEX_PRIMITIVES = primitives("slice_p", "dynamic_slice_p")


@dataclasses.dataclass(frozen=True)
class View:
    """A parameter's value as some op of the loss sees it.

    ``axes[i]`` are the parameter axes that axis ``i`` of the value spans (several after a
    reshape merges them; one parameter axis may be split over several value axes; a size-1 axis
    spans none). ``layers``: the parameter axes enclosing scans and indices have sliced off
    (layer axes), in the order they were sliced: the leading ones for a stack on axis 0, any
    others for a stack moved to lead before its scan (MaxText's ``param_scan_axis=1``).
    ``moved``: an op other than a retype changed the axes (an index ``w[i]`` then no longer
    reads its leading axes).
    """

    param: int
    axes: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...] = ()
    moved: bool = False

    @property
    def level(self) -> int:
        """How many layer axes are sliced off."""
        return len(self.layers)


@dataclasses.dataclass(frozen=True)
class Use:
    """One op reading a parameter.

    ``kind``: ``"gemm"``, ``"lookup"`` or ``"other"``. For a GEMM, ``contract`` / ``free`` /
    ``batch`` are the parameter axes it contracts, keeps, and batches over (in the dot's batch
    order). ``layers``: the parameter's axes sliced off by scans and indices at that point
    (``View.layers``; ``level`` their number).
    ``remat``: inside a rematerialised region (its gathers run again in the backward).
    ``what``: the op, for plans and errors. ``trips``: how many times it runs per step (the
    product of the enclosing scans' lengths; None inside a ``while`` loop). ``branch``: inside
    a ``cond`` / ``switch`` branch (it runs when that branch is taken).
    """

    kind: str
    layers: tuple[int, ...]
    what: str
    contract: tuple[int, ...] = ()
    free: tuple[int, ...] = ()
    batch: tuple[int, ...] = ()
    remat: bool = False
    site: int = 0
    trips: int | None = 1
    branch: bool = False

    @property
    def level(self) -> int:
        """How many layer axes are sliced off."""
        return len(self.layers)


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
    for eqn in jaxprs.all_eqns(jaxprs.body(closed)[0]):
        for key in _AXIS_PARAMS:
            value = eqn.params.get(key)
            values = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
            if any(isinstance(v, str) and v in names for v in values):
                found.add(eqn.primitive.name)
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
    outs = walker.run(jaxpr, consts, args)
    for out in outs:
        if isinstance(out, View):
            walker.use(out, "other", "returned by the loss function")
    return Uses([sorted(walker.uses[j], key=lambda u: u.site) for j in range(num_params)], walker.fed)


# ------------------------------------------------------------------------------------------------
# Views through layout ops


def _transposed(params, view: View, in_shape, out_shape) -> View:
    return dataclasses.replace(view, axes=tuple(view.axes[p] for p in params["permutation"]), moved=True)


def _squeezed(params, view: View, in_shape, out_shape) -> View:
    drop = {d % len(in_shape) for d in params["dimensions"]}
    return dataclasses.replace(view, axes=tuple(a for i, a in enumerate(view.axes) if i not in drop), moved=True)


def _broadcast(params, view: View, in_shape, out_shape) -> View | None:
    dims = params["broadcast_dimensions"]
    new = [()] * len(out_shape)
    for i, d in enumerate(dims):
        if in_shape[i] != out_shape[d]:
            return None  # a size-1 axis broadcast: a real broadcast
        new[d] = view.axes[i]
    if any(out_shape[d] != 1 for d in range(len(out_shape)) if d not in dims):
        return None
    return dataclasses.replace(view, axes=tuple(new), moved=True)


def _reshaped(params, view: View, in_shape, out_shape) -> View | None:
    if params.get("dimensions") is not None:
        return None
    return dataclasses.replace(view, axes=reshape_axes(view.axes, in_shape, out_shape), moved=True)


# Ops that only move or retype the elements of their first operand: a parameter read through
# them is still the parameter (a view), as each rule here says (None: not a pure move).
RETYPE_PRIMITIVES = primitives("convert_element_type_p", "copy_p", "sharding_constraint_p")
VIEWS = {
    **dict.fromkeys(RETYPE_PRIMITIVES, lambda params, view, in_shape, out_shape: view),
    P.transpose_p: _transposed,
    P.squeeze_p: _squeezed,
    P.broadcast_in_dim_p: _broadcast,
    P.reshape_p: _reshaped,
}
VIEW_PRIMITIVES = frozenset(VIEWS)


def view_through(prim, params, view: View, in_shape, out_shape) -> View | None:
    """The view after ``prim`` (one of ``VIEW_PRIMITIVES``), or None when the op is not a pure
    move of the parameter's elements (a real broadcast)."""
    return VIEWS[prim](params, view, in_shape, out_shape)


def index_view(parts: jaxprs.SliceParts, view: View, in_shape) -> View | None:
    """The view after a ``slice`` / ``dynamic_slice`` (``parts``) that takes one index of the
    value's leading axes (each one parameter axis, the view not moved) and every element of
    the others: those parameter axes become layer axes (appended to ``layers``). None for any
    other slice."""
    if parts.strided or view.moved:
        return None
    sizes = parts.sizes
    m = 0
    while m < len(sizes) and sizes[m] == 1 and len(view.axes[m]) == 1:
        m += 1
    if m == 0 or any(sizes[d] != in_shape[d] for d in range(m, len(sizes))):
        return None
    layers = view.layers + tuple(view.axes[d][0] for d in range(m))
    return dataclasses.replace(view, axes=((),) * m + view.axes[m:], layers=layers, moved=True)


def scan_slice(view: View) -> View | None:
    """The view a ``scan`` body gets of ``view``, a stacked input it slices along the leading
    axis: that axis's parameter axis becomes a layer axis, wherever it is in the parameter (a
    stack moved to lead by a ``transpose``, ``jnp.moveaxis``, ``nnx.scan`` over an axis other
    than 0). None when the leading axis is not exactly one parameter axis (a reshape merged or
    split it, or the axes were moved by more than a ``transpose``)."""
    if not view.axes or len(view.axes[0]) != 1:
        return None
    if view.moved and not is_permutation(view):
        return None
    return dataclasses.replace(view, axes=view.axes[1:], layers=(*view.layers, view.axes[0][0]))


def is_permutation(view: View) -> bool:
    """Each axis of the value is one parameter axis, each at most once: the parameter's axes (less
    its layer axes) transposed, nothing merged, split, dropped or added."""
    flat = [a for axes in view.axes for a in axes]
    return all(len(axes) == 1 for axes in view.axes) and len(set(flat)) == len(flat)


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


class _Walker(Traversal):
    """Abstract evaluation of a jaxpr: each value is a ``View`` of a parameter or the set of
    parameters whose GEMM outputs it depends on. ``trips`` / ``branch`` / ``remat``: the loop,
    branch and remat context of the equations being walked (``Use.trips``, ``Use.branch``,
    ``Use.remat``)."""

    def __init__(self, num_params: int) -> None:
        self.uses: list[set[Use]] = [set() for _ in range(num_params)]
        self.fed: set[int] = set()
        self._sites: dict[int, int] = {}
        self.trips: int | None = 1
        self.branch = False
        self.remat = False

    def literal(self, lit) -> frozenset:
        return frozenset()

    def constant(self, value) -> frozenset:
        return frozenset()

    def site(self, eqn) -> int:
        return self._sites.setdefault(id(eqn), len(self._sites))

    def use(self, view: View, kind: str, what: str, *, site: int = 0, roles=((), (), ())) -> None:
        contract, free, batch = roles
        self.uses[view.param].add(
            Use(kind, view.layers, what, contract, free, batch, self.remat, site, self.trips, self.branch)
        )

    def within(self, body: Body, args, *, trips: int | None = 1, branch: bool = False, remat: bool = False) -> list:
        """``body`` walked on ``args`` where it runs ``trips`` times per run of the enclosing
        one (None: a ``while`` body), in a branch, or rematerialised."""
        saved = self.trips, self.branch, self.remat
        self.trips = None if trips is None or self.trips is None else self.trips * trips
        self.branch = self.branch or branch
        self.remat = self.remat or remat
        try:
            return body(args)
        finally:
            self.trips, self.branch, self.remat = saved

    # -- rules ------------------------------------------------------------------------------------

    def default(self, eqn, ins: list, what: str | None = None) -> list:
        """Every parameter among the operands read as ``other``; the results depend on what the
        other operands depend on."""
        if what is None and jaxprs.sub_jaxprs(eqn):
            what = f"passed into {eqn.primitive.name} (a higher-order primitive FSDP does not follow into)"
        for x in ins:
            if isinstance(x, View):
                self.use(x, "other", what or eqn.primitive.name, site=self.site(eqn))
        deps = frozenset().union(*(x for x in ins if not isinstance(x, View)))
        return [deps] * len(eqn.outvars)

    def _view(self, eqn, ins) -> list | None:
        """A layout op on one parameter: the view it makes (a real broadcast reads it)."""
        if not _one_view_first(ins):
            return None
        out = view_through(eqn.primitive, eqn.params, ins[0], eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
        if out is not None:
            return [out]
        self.use(ins[0], "other", f"{eqn.primitive.name} (a broadcast)")
        return [frozenset()]

    def _index(self, eqn, ins) -> list | None:
        """``w[i]`` on the leading axes: the view of one layer."""
        if not _one_view_first(ins):
            return None
        out = index_view(jaxprs.slice_parts(eqn), ins[0], eqn.invars[0].aval.shape)
        return None if out is None else [out]

    def _lookup(self, eqn, ins) -> list | None:
        if not _one_view_first(ins):
            return None
        self.use(ins[0], "lookup", eqn.primitive.name, site=self.site(eqn))
        return [frozenset()]

    def _dot(self, eqn, ins) -> list | None:
        views = [x for x in ins if isinstance(x, View)]
        if len(views) != 1:
            return self.default(eqn, ins, "a dot_general of two parameters") if views else None
        position = 0 if isinstance(ins[0], View) else 1
        view, act = ins[position], ins[1 - position]
        roles = dot_roles(view, eqn.params["dimension_numbers"], position)
        if roles is None:
            self.use(view, "other", "a dot_general that contracts part of a reshaped axis")
            return [act]
        self.use(view, "gemm", "dot_general", site=self.site(eqn), roles=roles)
        self.fed.update(act)
        return [act | {view.param}]

    def _returned(self, outs, how: str) -> list:
        result = []
        for o in outs:
            if isinstance(o, View):
                self.use(o, "other", how)
                o = frozenset()
            result.append(o)
        return result

    def _remat(self, eqn, region: Remat, ins) -> list:
        return self.within(region.body, ins, remat=True)

    def _cond(self, eqn, branches: list[Body], ins) -> list | None:
        """Every branch walked on the operands (a parameter's uses are those of all branches);
        an output depends on what it depends on in any branch."""
        if not any(isinstance(x, View) for x in ins):
            return None
        outs = [frozenset()] * len(eqn.outvars)
        for branch in branches:
            got = self._returned(self.within(branch, ins[1:], branch=True), "returned by a cond branch")
            outs = [a | b for a, b in zip(outs, got)]
        return outs

    def _while(self, eqn, loop: While, ins) -> list | None:
        if not any(isinstance(x, View) for x in ins):
            return None
        c_consts, b_consts, carry = loop.split(ins)
        carry = self._returned(carry, "carried through a loop")
        for _ in range(16):
            self.within(loop.cond, c_consts + carry, trips=None)
            outs = self._returned(self.within(loop.body, b_consts + carry, trips=None), "carried through a loop")
            grown = [c | o for c, o in zip(carry, outs)]
            if grown == carry:
                break
            carry = grown
        return carry

    def _scan(self, eqn, loop: Scan, ins) -> list:
        consts, carry, xs = loop.split(ins)
        ncar = loop.parts.num_carry
        carry = self._returned(carry, "carried through a loop")
        body_xs = []
        for x in xs:
            if isinstance(x, View):
                sliced = scan_slice(x)
                if sliced is None:
                    self.use(x, "other", "sliced by a scan after a reshape of its axes")
                    body_xs.append(frozenset())
                else:
                    body_xs.append(sliced)
            else:
                body_xs.append(x)
        for _ in range(16):  # the carries' dependencies, to a fixed point
            outs = self.within(loop.body, consts + carry + body_xs, trips=loop.parts.length)
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
            self.use(o, "other", "returned by a scan body")
            result.append(frozenset())
        return result

    kind_rules: ClassVar[Mapping[str, Rule]] = {
        "call": Traversal.inline,
        "remat": _remat,
        "scan": _scan,
        "cond": _cond,
        "while": _while,
    }
    rules: ClassVar[Mapping[Any, Rule]] = {
        **dict.fromkeys(VIEW_PRIMITIVES, _view),
        **dict.fromkeys(INDEX_PRIMITIVES - LOOKUP_PRIMITIVES, _index),
        **dict.fromkeys(LOOKUP_PRIMITIVES - INDEX_PRIMITIVES, _lookup),
        **dict.fromkeys(INDEX_PRIMITIVES & LOOKUP_PRIMITIVES, first(_index, _lookup)),
        P.dot_general_p: _dot,
    }


def _one_view_first(ins) -> bool:
    """The first operand is a parameter's view, and no other operand is one."""
    return isinstance(ins[0], View) and sum(isinstance(x, View) for x in ins) == 1


def describe_shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def product(dims) -> int:
    return int(np.prod(dims, dtype=np.int64)) if len(dims) else 1
