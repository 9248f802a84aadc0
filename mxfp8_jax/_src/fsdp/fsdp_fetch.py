"""A scan over layers that gathers each layer's first weights during the layer before: FSDP's
prefetch of the next layer, double buffered, as the evaluator (``fsdp_eval``) builds it for a
scan whose body is one ``jax.checkpoint`` region without a policy and integer counters
(``nnx.scan`` over ``nnx.remat`` blocks; a ``fori_loop`` over them reading the stacks by its
counter), forward and backward, or has no region at all: then the forward, and the backward is
jax's derivative of the scan, with the body's unit GEMMs linked in the backward's handoff
(``handoff``) and the link carried from iteration to iteration.

XLA:GPU schedules a loop body on its own, so an iteration's first GEMMs (a layer's q, k and v
projections) wait for their own weights' gathers with nothing of the iteration to run beside.
``first_read`` finds those GEMMs by evaluating the body once; ``fetching_scan`` gathers them for
layer ``l + 1`` during iteration ``l`` and carries them, and differentiates the scan itself: a
reverse scan that recomputes each layer (as the region would) on the weights the iteration after
gathered, and meanwhile gathers the layer before's. The operations and their order are those of
jax's derivative of the scan over the region, so values and gradients are the same bits.

The functions take the evaluator (``ev``) and evaluate the body in its ``fetched`` context: its
GEMMs take what a ``Fetching`` holds instead of gathering, and the region is evaluated inline,
not wrapped (the scan recomputes it in its own backward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.fsdp import fsdp_specs
from mxfp8_jax._src.fsdp.fsdp_islands import closing_island, fetch_island, zero_handoff_island
from mxfp8_jax._src.fsdp.fsdp_trace import RETYPE_PRIMITIVES
from mxfp8_jax._src.fsdp.fsdp_unit import NO_HANDOFF, Handoff, UnitOp
from mxfp8_jax._src.fsdp.fsdp_values import Symbolic, UnitValue
from mxfp8_jax._src.fsdp.fsdp_walk import Scan


def first_read(ev, loop: Scan, step, flat_consts, carry, xs_in, slicers, xs):
    """Where a scan's iterations may gather their first weights one iteration ahead
    (``fetching_scan``): ``(fetch, layer_of, recompute)``, ``fetch(xs_in, layer)`` gathering
    what the body's first GEMMs of stacked units (found by evaluating the body once:
    ``Fetching``) read of ``layer``, by unit name; ``layer_of(name, xs_in, layer)``: a stacked
    unit of the scan, a layer picked; ``recompute``: the body is one
    rematerialised region (no policy) and integer counters, which the scan's own backward
    recomputes; False for a body without any region (jax's derivative of the forward, whose
    backward saves the body's residuals). None where the scan is neither, reads no stacked
    unit, is not under ``prefetch``, or runs in reverse: jax's derivative of the scan stands
    there."""
    parts = loop.parts
    eqns = loop.body.jaxpr.eqns
    if not ev.islands.prefetch or parts.reverse or parts.length < 2 or ev.recomputing:
        return None
    regions = [e for e in eqns if jaxprs.kind(e) == "remat"]
    recompute = bool(regions)
    if not recompute and any(jaxprs.kind(e) == "remat" for e in jaxprs.all_eqns(loop.body.jaxpr)):
        return None  # a region deeper in the body: evaluated inline, it would not be one
    if recompute and (len(regions) != 1 or jaxprs.remat_policy(regions[0])[0] is not None):
        return None
    if recompute and any(_inexact(v) for e in eqns if e is not regions[0] for v in [*e.invars, *e.outvars]):
        return None  # the body does more than the region and its counters
    if not any(isinstance(x, UnitValue) for x in xs):
        return None
    slices = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in xs_in]
    shapes = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in carry]
    probe = Fetching(discover=True)
    try:
        with ev.fetched(probe):
            jax.eval_shape(step, flat_consts, shapes, slices)
    except Found:
        pass
    stacked = {
        x.name: (x, slice(start, start + count))
        for (start, count, _), x in zip(slicers, xs)
        if isinstance(x, UnitValue)
    }
    found = probe.found
    if not found or any(unit.name not in stacked for unit, _ in found):
        return None

    def fetch(xs_in, layer, token=None):
        out = {}
        after = () if token is None else (token[0], fsdp_specs.partition(token[1], token[0].ndim))
        for unit, op in found:
            out[unit.name] = fetch_island(ev.islands, op, layer_of(unit.name, xs_in, layer), layer, *after)
        return out

    def layer_of(name, xs_in, layer=None):
        """The stacked unit ``name`` on the scan's inputs ``xs_in``, picking ``layer`` where given
        (None: not a stacked unit of the scan)."""
        if name not in stacked:
            return None
        x, leaves = stacked[name]
        x = x.with_leaves(xs_in[leaves])
        return x if layer is None else dataclasses.replace(x, pick=(jnp.asarray(layer, jnp.int32),))

    return fetch, layer_of, recompute


def fetching_scan(ev, step, flat_consts, carry, xs_in, parts, first):
    """A scan whose first weight each iteration gathers during the iteration before (double
    buffering, FSDP's prefetch of the next layer): forward, and for a rematerialised body in
    its own backward too, a reverse scan that recomputes each iteration's body (as the
    rematerialised region would) with the next iteration's (the layer before's) first weight
    gathered meanwhile (``_recomputing_scan``). A body without remat keeps jax's derivative,
    its unit GEMMs linked in the handoff (``_saving_scan``). ``first``: ``first_read``'s.
    Values and gradients are those of ``lax.scan`` over the body: the same operations, in the
    same order."""
    fetch, layer_of, recompute = first

    def run(flat_consts, carry, xs_slices, fetched, linked=False, handing=None, keep=False, record=False):
        """The body on the fetched weights, the output of its first GEMM that read them (what
        the next fetch waits for: XLA then cannot run it, or a gather it combines it with, ahead
        of that GEMM), where ``linked`` its last linked GEMM's ``(handoff value, unit, op)``
        (``handing``: what its first one takes), and with ``record`` the weights the body took
        or gathered of every stacked unit (True) or of the units it names
        (``Fetching.recorded``). ``keep``: the body is recomputed for its backward, so a GEMM
        taking bytes of both directions keeps them for its dgrad (``UnitOp.reuses``)."""
        fetching = Fetching(fetched, linked=linked, handing=handing, keep=keep, record=record)
        with ev.fetched(fetching):
            return step(flat_consts, carry, xs_slices), fetching.first, ev.handing, fetching.recorded

    flat_consts, carry, xs_in = list(flat_consts), list(carry), list(xs_in)
    if recompute:
        kept = min(ev.islands.keep_layers, parts.length)
        return _recomputing_scan(run, fetch, flat_consts, carry, xs_in, parts.length, parts.unroll, kept)
    return _saving_scan(ev, run, fetch, layer_of, flat_consts, carry, xs_in, parts.length, parts.unroll)


def _saving_scan(ev, run, fetch, layer_of, flat_consts, carry, xs_in, length, unroll):
    """The fetching scan of a body without remat: jax's derivative, whose backward saves the
    body's residuals. Its unit GEMMs are linked in the handoff (``_chain``): the loop carries
    the link, and after it an identity on the carry (``closing_island``) gathers, in the
    backward, what the last iteration's last op needs.

    Both loops gather one layer too many: the forward's last iteration fetches a layer after
    the last (the last again), and in a linked backward layer 0's iteration gathers a layer
    before the first (layer 0's last op's weight again). Peeling those iterations off the loop,
    as ``_recomputing_scan`` does, would read the stacks by index, and jax's derivative then
    sums their gradients into a stack of its own (one more fp32 stack of the masters' shards
    in temp memory), so they stay. Where the last linked op's bytes serve both GEMM directions
    (a 32x32 plane), the forward carries the plane it gathered out of the loop, and the
    backward's first handoff takes it instead of gathering it again (``keep_layers``): the
    linked backward then gathers as many planes as a layer-by-layer one."""
    index = jnp.arange(length, dtype=jnp.int32)
    inexact = lambda a: jnp.issubdtype(jnp.result_type(a), jnp.inexact)
    chain = _chain(ev, run, fetch, layer_of, flat_consts, carry, xs_in)
    keeps = chain is not None and ev.islands.keep_layers > 0 and chain[2].geometry.both_ways
    record = frozenset({chain[1]}) if keeps else False

    def body(state, inputs):
        carry, fetched, link, kept = state
        i, xs_slices = inputs
        handing = None if chain is None else (link, layer_of(chain[1], xs_in, jnp.maximum(i - 1, 0)), chain[2])
        (new_carry, ys), read, handing, recorded = run(
            flat_consts, carry, xs_slices, fetched, chain is not None, handing, record=record
        )
        upcoming = fetch(xs_in, jnp.minimum(i + 1, length - 1), read)
        link = () if chain is None else handing[0]
        return (new_carry, upcoming, link, recorded[chain[1]] if keeps else ()), ys

    link = () if chain is None else zero_handoff_island(ev.islands, chain[0])
    kept = ()
    if keeps:  # what the last linked op gathers, as the loop carries it
        shapes = jax.eval_shape(lambda: fetch_island(ev.islands, chain[2], layer_of(chain[1], xs_in, 0), 0))
        kept = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    state = (carry, fetch(xs_in, 0), link, kept)
    (carry_out, _, link, kept), ys = lax.scan(body, state, (index, xs_in), unroll=unroll)
    if chain is not None:  # the last iteration's backward weight, gathered after the loop (or kept)
        k = next(k for k, c in enumerate(carry_out) if inexact(c))
        last = layer_of(chain[1], xs_in, length - 1)
        carry_out[k] = closing_island(ev.islands, chain[2], carry_out[k], link, last, kept if keeps else None)
    return carry_out, ys


def _recomputing_scan(run, fetch, flat_consts, carry, xs_in, length, unroll, kept):
    """The fetching scan of a rematerialised body, differentiated here. Each loop runs the
    layers between its peeled ends: the forward's last ``max(kept, 1)`` layers and the
    backward's first ``kept`` and its last, layer 0, run outside them, so no loop gathers a
    layer after the last or before the first, and each layer's first weights are gathered once
    a pass. The forward's last ``kept`` layers return every weight they gathered, and the
    backward recomputes those layers on them, kept: it gathers none of their weights for the
    recomputed forward, and where they serve both GEMM directions (32x32 planes, bf16 weights)
    none for the dgrads either. With ``kept`` 0 the backward's first iteration takes only the
    first weights the forward's last fetched. The loops read their layer of the stacks by
    index (a slice before the loop would copy them); what they stack (the carries, the
    outputs, the stacks' gradients) is written in place, layer by layer."""
    inexact = lambda a: jnp.issubdtype(jnp.result_type(a), jnp.inexact)
    index = jnp.arange(length, dtype=jnp.int32)
    at = lambda arrays, i: [lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in arrays]
    put = lambda stacks, values, i: [lax.dynamic_update_index_in_dim(s, v, i, 0) for s, v in zip(stacks, values)]
    stacks = lambda values: [jnp.zeros((length, *jnp.shape(v)), jnp.result_type(v)) for v in values]
    top = length - kept  # the backward's first layer not kept: its loop's first

    def forward(flat_consts, carry, xs_in):
        """The scan, and what its backward needs: each iteration's carry in, and by layer the
        weights the backward takes (``kept`` layers' every weight; with none, the last layer's
        first weights)."""
        ys_shapes = jax.eval_shape(lambda c: run(flat_consts, c, at(xs_in, 0), fetch(xs_in, 0))[0][1], carry)
        looped = length - max(kept, 1)

        def body(state, i):
            carry, fetched, upcoming, ys, carries = state
            (new_carry, y), read, _, _ = run(flat_consts, carry, at(xs_in, i), fetched)
            fetched = fetch(xs_in, upcoming, read)
            return (new_carry, fetched, upcoming + 1, put(ys, y, i), put(carries, carry, i)), None

        # the layer to fetch is carried apart from the loop's counter: slices of the stacks at
        # the counter and at this index then share no operand, and XLA cannot fuse them into one
        # kernel, which would make the iteration's own gathers wait for the fetch's token (the
        # first GEMM): on a B200 the o projection's gather then had only the attention to run
        # beside
        state = (carry, fetch(xs_in, 0), jnp.int32(1), stacks(ys_shapes), stacks(carry))
        if looped:
            state, _ = lax.scan(body, state, index[:looped], unroll=unroll)
        carry, fetched, _, ys, carries = state
        taken = {}
        for j in range(looped, length):
            (new_carry, y), read, _, recorded = run(flat_consts, carry, at(xs_in, j), fetched, record=j >= top)
            taken[j] = recorded if j >= top else fetched
            ys, carries, carry = put(ys, y, j), put(carries, carry, j), new_carry
            if j + 1 < length:
                fetched = fetch(xs_in, j + 1, read)
        return carry, ys, carries, taken

    @jax.custom_vjp
    def scanned(flat_consts, carry, xs_in):
        carry_out, ys, _, _ = forward(flat_consts, carry, xs_in)
        return carry_out, ys

    def scanned_fwd(flat_consts, carry, xs_in):
        carry_out, ys, carries, taken = forward(flat_consts, carry, xs_in)
        return (carry_out, ys), (flat_consts, xs_in, carries, taken)

    def scanned_bwd(res, cts):
        flat_consts, xs_in, carries, taken = res
        ct_carry, ct_ys = cts
        d_consts = [jnp.zeros_like(a) for a in flat_consts if inexact(a)]
        ct_carry = [c for c, a in zip(ct_carry, carries) if inexact(a)]
        ct_ys = [c for c in ct_ys if inexact(c)]
        d_xs = [jnp.zeros_like(a) for a in xs_in if inexact(a)]

        def back(i, ct_carry, d_consts, d_xs, fetched, ahead: bool):
            """Iteration ``i`` recomputed on ``fetched`` and differentiated; with ``ahead``,
            the layer before's first weights gathered meanwhile. Outside a loop (a Python int
            ``i``) the recomputation waits for the cotangent: it is the forward's computation
            on the same carry and, for a kept layer, the same weights, which XLA would
            otherwise compute once and keep its activations from the forward to the backward
            (undoing the remat)."""
            carry, xs_slices = at(carries, i), at(xs_in, i)
            if isinstance(i, int):
                carry = _merge(carry, map(_after_each, [c for c in carry if inexact(c)], ct_carry), inexact)

            def f(dc, dk, dx):
                consts = _merge(flat_consts, dc, inexact)
                carry_in, xs_at = _merge(carry, dk, inexact), _merge(xs_slices, dx, inexact)
                (new_carry, ys), _, _, _ = run(consts, carry_in, xs_at, fetched, keep=True)
                outs = [*new_carry, *ys]
                return [o for o in outs if inexact(o)], [o for o in outs if not inexact(o)]

            primals = [[a for a in v if inexact(a)] for v in (flat_consts, carry, xs_slices)]
            outs, vjp, _ = jax.vjp(f, *primals, has_aux=True)
            # waits for nothing: the backward's gathers have the iteration's dgrads and wgrads
            # to run beside whatever XLA combines it with
            upcoming = fetch(xs_in, i - 1) if ahead else None
            dc, dk, dx = vjp([*ct_carry, *at(ct_ys, i)])
            d_consts = [a + b for a, b in zip(d_consts, dc)]
            return dk, d_consts, put(d_xs, dx, i), upcoming

        state = (ct_carry, d_consts, d_xs, taken.get(length - 1))
        for j in range(length - 1, top - 1, -1):  # the kept layers, on what their forward gathered
            *state, upcoming = back(j, *state[:3], taken[j], ahead=0 < j == top)
            state = (*state, upcoming)
        if top > 1:
            body = lambda state, i: (back(i, *state, ahead=True), None)
            state, _ = lax.scan(body, tuple(state), index[1:top], reverse=True, unroll=unroll)
        if top > 0:
            state = back(0, *state, ahead=False)
        d_carry, d_consts, d_xs, _ = state
        return (
            _unmerge(flat_consts, d_consts, inexact),
            _unmerge(carries, d_carry, inexact),
            _unmerge(xs_in, d_xs, inexact),
        )

    scanned.defvjp(scanned_fwd, scanned_bwd)
    return scanned(flat_consts, carry, xs_in)


def _chain(ev, run, fetch, layer_of, flat_consts, carry, xs_in):
    """The handoff through a scan body without remat (``handoff``), carried from iteration to
    iteration: ``(shapes, unit name, op)`` of the body's last linked GEMM (its handoff value's
    global shapes, the stacked unit it reads, its ``UnitOp``), whose backward weight the body's
    first linked GEMM gathers for the layer before; found by evaluating the body once. None
    where the body links none, its last reads no layer of a stacked unit or a bf16 one (16-bit
    weights carried through the loop: XLA:GPU then exposed more gather time than it hid, see
    docs/fsdp.md), or no carry is a floating value (what the closing op,
    ``fsdp_islands.closing_island``, rides on)."""
    if not ev.islands.prefetch or not any(jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in carry):
        return None
    found = []

    def probe(flat_consts, carry, xs_in):
        _, _, handing, _ = run(flat_consts, carry, [a[0] for a in xs_in], fetch(xs_in, 0), True)
        if handing is None:
            return None
        value, unit, op = handing
        found.append((unit.name, op, unit.sliced and not unit.pick))
        return value

    shapes = jax.eval_shape(probe, list(flat_consts), list(carry), list(xs_in))
    if not found or not found[0][2] or layer_of(found[0][0], list(xs_in)) is None:
        return None
    if found[0][1].geometry.precision != "mxfp8":
        return None  # a bf16 weight carried through the loop: XLA:GPU's schedule lost more than it won
    return shapes, found[0][0], found[0][1]


def region_ahead(ev, region, values, specs) -> tuple:
    """A Python loop's rematerialised blocks gathering one block ahead: under ``prefetch``, the
    forward gathers of a region without a policy evaluated at the top of the loss wait for the
    input of the region before (``ev.region_input``: its first floating input, the block's
    activation) instead of their own. ``([that input], its PartitionSpec, this region's
    input)``: the first passed into the region as one more input (a residual the region before
    saves anyway), ``[]`` where there is none; the last, the next region's ``region_input``. In
    the backward the recomputed forward still waits for the cotangent."""
    before = ev.region_input
    if not ev.islands.prefetch or ev.region != 0 or ev.recomputing or region.policy is not None:
        return [], None, before
    act = next(((v, s) for v, s in zip(values, specs) if _floating(v) and s is not None), None)
    if before is None:
        return [], None, act
    return [before[0]], fsdp_specs.partition(before[1], jnp.ndim(before[0])), act or before


def _floating(v) -> bool:
    """Whether ``v`` is an array of floats (an activation, not a parameter's symbolic value)."""
    return not isinstance(v, Symbolic) and hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating)


def handoff(ev, op: UnitOp) -> tuple:
    """A unit GEMM's part in the backward's handoff (``fsdp_unit.Handoff``), the backward's
    prefetch for the layers a Python loop runs: under ``prefetch``, the unit GEMMs evaluated at
    the top of the loss (not in a region or branch: each another trace) are linked in program
    order, so that each one's backward gathers the weight of the one before (in the
    forward). So are those of a fetching scan's body without remat, from one iteration to the
    next: the body's first linked GEMM takes the handoff value the iteration before's last one
    gave, and gathers that op's weight of the layer before (``_chain``). ``(handoff, handed,
    before)``: its ``Handoff``, the handoff value of the op before and that op's unit (the
    evaluator's ``handing``: the last op's, None where it gave none)."""
    linked = (
        ev.islands.prefetch > 0
        and ev.linking
        and not ev.branches
        and not (op.gemm.mxfp8 is not None and op.geometry.precision == "mxfp8")
    )
    if not linked:  # the chain breaks here: this op gives no handoff for the next to take
        return NO_HANDOFF, None, None
    if ev.handing is None:
        return Handoff(gives=True), None, None
    handed, before, takes = ev.handing
    return Handoff(gives=True, takes=takes), handed, before


class Found(Exception):
    """``Fetching`` found the first weight a scan body reads (``first_read``)."""


class Fetching:
    """The weights a scan iteration's first GEMMs of stacked units take instead of gathering
    their own: ``fetched``, unit name -> what the iteration before gathered for it. With
    ``discover``, which GEMMs those are (``found``: ``(unit, op)`` of each): the body's first
    GEMM of a stacked unit and the others of the same activation up to one of another (there
    evaluation stops): a layer's q, k and v projections, its MLP's gate and up. With
    ``record``, every stacked unit's first GEMM returns the weight it took or gathered
    (``recorded``, unit name -> those bytes): a layer kept for its backward, which takes them
    all as its ``fetched``."""

    def __init__(
        self,
        fetched=None,
        *,
        discover: bool = False,
        linked: bool = False,
        handing=None,
        keep: bool = False,
        record: bool | frozenset = False,
    ) -> None:
        self.fetched, self.discover = dict(fetched or {}), discover
        self.keep = keep  # a recomputed iteration: bytes of both directions serve the dgrad too
        self.record, self.recorded = record or frozenset(), {}
        self.linked, self.handing = linked, handing  # the body's GEMMs linked; what the first takes
        self.first: tuple | None = None  # the output of the first GEMM that took them, its spec
        self.found: list = []
        self.act = None
        self.producers: dict = {}  # while discovering: variable -> the equation giving it

    def read(self, out, spec) -> None:
        if self.first is None:
            self.first = (out, spec)

    def records(self, unit: UnitValue) -> bool:
        """Whether the weight the GEMM reading ``unit`` takes or gathers is recorded (``record``:
        True for every stacked unit, or a set of unit names; the first GEMM of each only)."""
        return (self.record is True or unit.name in self.record) and unit.name not in self.recorded

    def gathered(self, unit: UnitValue, weight) -> None:
        """``weight``: what the GEMM reading ``unit`` took or gathered (None: not returned)."""
        if weight is not None and self.records(unit):
            self.recorded[unit.name] = weight

    def produced(self, eqn) -> None:
        if self.discover:
            self.producers.update((v, eqn) for v in eqn.outvars)

    def take(self, unit: UnitValue, op: UnitOp, act):
        """What the GEMM of ``op`` reading ``unit`` takes (None: it gathers its own); ``act``:
        the variable of its activation, the same for GEMMs reading one value (casts looked
        through: each ``nnx.Linear`` casts its input)."""
        if not self.discover:
            return self.fetched.pop(unit.name, None)
        while isinstance(act, jcore.Var) and act in self.producers:
            eqn = self.producers[act]
            if eqn.primitive not in RETYPE_PRIMITIVES or len(eqn.invars) != 1:
                break
            act = eqn.invars[0]
        if self.act is None:
            self.act = act
        if act is not self.act:
            raise Found
        self.found.append((unit, op))
        return None


def _inexact(v) -> bool:
    """Whether a jaxpr operand is a floating value (what a derivative flows through)."""
    return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def _after_each(value, token):
    """``value`` unchanged, but computed from ``token`` (of its shape and split, such as its
    cotangent): element by element, so nothing moves between devices (``fsdp_unit.after``
    reads one element of its token, which a split array would broadcast with a collective)."""
    return jnp.where(token < -jnp.inf, jnp.zeros_like(value), value)


def _merge(values, chosen, keep) -> list:
    """``values`` with those ``keep`` marks replaced, in order, by ``chosen``."""
    chosen = iter(chosen)
    return [next(chosen) if keep(v) else v for v in values]


def _unmerge(values, chosen, keep) -> list:
    """Cotangents of ``values``: ``chosen``, in order, for those ``keep`` marks, None (zero) for
    the others."""
    chosen = iter(chosen)
    return [next(chosen) if keep(v) else None for v in values]
