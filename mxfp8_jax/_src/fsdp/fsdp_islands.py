"""The islands that read parameters inside the evaluated loss, and the gathers they wait on.

Each op of the loss that reads a unit runs in an island: a ``shard_map`` over the FSDP axes
(``fsdp_values.Islands``) whose body is that op's unit ``custom_vjp`` (``fsdp_unit``) on each
device's part of the activation and its rows of the weight. This module builds them:

- ``gemm_island`` / ``lookup_island``: a unit's GEMM or lookup, the activation split the way the
  batch split reaches it (``fsdp_specs``), so XLA moves nothing into or out of the island;
- ``plain_island``: an op combining plain parameters with an activation, each parameter
  gathered there once the activation exists (``gather_after``);
- ``collective_island``: a model's own collective over the tensor-parallel axis, on each
  device's part of the batch;
- ``rematerialize``: a region whose intermediates are recomputed in the backward, after the
  cotangent arrives.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from mxfp8_jax._src.core.jaxprs import bind
from mxfp8_jax._src.fsdp import fsdp_specs
from mxfp8_jax._src.fsdp.fsdp_specs import Spec, entries_of, partition
from mxfp8_jax._src.fsdp.fsdp_unit import (
    NO_HANDOFF,
    OWN,
    Handoff,
    UnitOp,
    after,
    encoded,
    fetch,
    handed_weight,
    unit_gemm,
    unit_lookup,
)
from mxfp8_jax._src.fsdp.fsdp_values import Islands, PlainValue, UnitValue
from mxfp8_jax._src.ops import mxfp8_gemm

# ``token(act, act_spec)`` -> what a unit's forward gathers wait for: ``(how, operand, spec)``
# (``fsdp_eval``'s ``token``).
Token = Callable[[jax.Array, PartitionSpec], tuple]


def gemm_island(
    islands: Islands,
    op: UnitOp,
    act,
    act_spec: Spec,
    unit: UnitValue,
    unit_ndim: int,
    given,
    token: Token,
    fetched=None,
    handoff: Handoff = NO_HANDOFF,
    handed=None,
    before: UnitValue | None = None,
    record: bool = False,
):
    """The unit GEMM on each device's part of ``act``: the activation split along the free
    axes the batch split reaches (else along its first free axis the islands' devices
    divide), the result split the same way. ``given``: ``act``'s MXFP8 planes and their spec
    where it is a ``gemm_operand`` (else None); ``token``: what the unit's gathers wait for;
    ``fetched``: the weight ``fetch_island`` gathered for it earlier (it then gathers none).
    ``handoff``: its part in the backward's handoff (``fsdp_unit.Handoff``), ``handed`` the
    handoff value of the op before and ``before`` that op's unit. ``record``: the op gathers
    its own weight (``fetch``, as it would have) and returns it too, whole on every device, for
    a later evaluation of the same op to take as ``fetched``. Returns the result, its spec, with
    ``handoff.gives`` the op's handoff value (each device's own, else None), and with
    ``record`` the weight gathered (else None)."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    contract, batch = (rc, rb) if op.position == 0 else (lc, lb)
    free = [d for d in range(act.ndim) if d not in contract and d not in batch]
    entries = [e if d in free else None for d, e in enumerate(entries_of(act_spec, act.ndim))]
    if all(e is None for e in entries):
        entries = _split_one(islands, act.shape, free, entries)
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
    arrays, given_specs, given_meta = _given(islands, given, act, entries)

    wait, token, token_spec = token(act, act_spec)
    op = dataclasses.replace(op, early=wait == "none")

    def body(a, shards, given_arrays, pick, token, fetched, handed, before):
        g = None if given_meta is None else given_meta(given_arrays)
        before = None if before is None else (before[0], tuple(before[1]))
        wait_for = {"own": OWN, "none": None}.get(wait, token)
        fetched = _fetched(fetched)
        if record:
            fetched = fetch(op, shards, pick, a if wait_for is OWN else wait_for)
        out = unit_gemm(op, a, shards, g, pick, wait_for, fetched, handoff, _fetched(handed), before)
        return (*(out if handoff.gives else (out,)), *((fetched,) if record else ()))

    pick_specs = (PartitionSpec(),) * len(unit.pick)
    fetched = () if fetched is None else fetched
    fetched_specs = jax.tree.map(lambda _: PartitionSpec(), fetched)
    handed = () if handed is None else handed
    # a handoff is each device's own whole copy (a leading axis split over the devices): a
    # replicated one would have its cotangent summed over them
    each = PartitionSpec(islands.entry)
    handed_specs = jax.tree.map(lambda _: each, handed)
    before_args = None if before is None else (before.shards, before.pick)
    before_specs = None if before is None else (before.shard_specs(), (PartitionSpec(),) * len(before.pick))
    specs = (act_spec, unit.shard_specs(), given_specs, pick_specs, token_spec, fetched_specs)
    specs = (*specs, handed_specs, before_specs)
    result_spec = (out_spec, *((each,) if handoff.gives else ()), *((PartitionSpec(),) if record else ()))
    fn = islands.island(body, specs, result_spec)
    result = fn(act, unit.shards, arrays, unit.pick, token, fetched, handed, before_args)
    spec = fsdp_specs.nonempty(tuple(out))
    return result[0], spec, (result[1] if handoff.gives else None), (result[-1] if record else None)


def _fetched(fetched):
    """``gemm_island``'s ``fetched`` as the island's body receives it (``()``: none)."""
    return None if isinstance(fetched, tuple) and not fetched else fetched


def fetch_island(islands: Islands, op: UnitOp, unit: UnitValue, layer, token=(), token_spec=()):
    """The weight ``op`` reads of layer ``layer`` (a traced index) of the stacked ``unit``,
    gathered whole on every device and not yet widened (``fsdp_unit.fetch``): what a loop
    gathers one iteration ahead of the op that reads it (``gemm_island``'s ``fetched``), once
    ``token`` (split as ``token_spec``) exists."""
    fn = islands.island(
        lambda shards, layer, token: fetch(op, shards, (layer,), token),
        (unit.shard_specs(), PartitionSpec(), token_spec),
        PartitionSpec(),
    )
    return fn(unit.shards, jnp.asarray(layer, jnp.int32), token)


def zero_handoff_island(islands: Islands, shapes):
    """A handoff value of zeros (``shapes``: the global shapes a linked op's has), made on each
    device as its own part: what a linked loop carries into its first iteration."""
    each = PartitionSpec(islands.entry)
    make = lambda: jax.tree.map(lambda s: jnp.zeros((1, *s.shape[1:]), s.dtype), shapes)
    return islands.island(make, (), jax.tree.map(lambda _: each, shapes))()


def closing_island(islands: Islands, op: UnitOp, value, link, unit: UnitValue, kept=None):
    """``value`` unchanged; in the backward, the cotangent of the handoff value ``link`` is the
    backward weight of ``op`` on the layer ``unit.pick`` names of the stacked ``unit``: what a
    linked loop's last iteration receives in the backward, gathered while the ops after the
    loop compute (it waits for nothing). ``kept``: those bytes as the forward gathered them
    (whole on every device; bytes that serve both directions), handed over instead of gathered
    again."""
    each = jax.tree.map(lambda _: PartitionSpec(islands.entry), link)
    if kept is not None:
        hand = islands.island(encoded, (PartitionSpec(),), each)

        @jax.custom_vjp
        def hand_over(value, link, kept):
            return value

        hand_over.defvjp(lambda value, link, kept: (value, kept), lambda kept, ct: (ct, hand(kept), None))
        return hand_over(value, link, kept)
    gather = islands.island(
        lambda shards, pick: handed_weight(op, shards.master, shards.planes, pick),
        (unit.shard_specs(), (PartitionSpec(),) * len(unit.pick)),
        each,
    )

    @jax.custom_vjp
    def close(value, link, shards, pick):
        return value

    def close_fwd(value, link, shards, pick):
        return value, (shards, pick)

    def close_bwd(residuals, ct):
        return ct, gather(*residuals), None, None

    close.defvjp(close_fwd, close_bwd)
    return close(value, link, unit.shards, unit.pick)


def lookup_island(islands: Islands, op: UnitOp, others: tuple, other_specs, unit: UnitValue, out_spec, out_ndim):
    """A lookup of the unit: the indices split as the batch split reaches them, the rows
    looked up on each device for its indices."""
    specs = tuple(partition(s, np.ndim(x)) for s, x in zip(other_specs, others))
    fn = islands.island(
        lambda shards, others, pick: unit_lookup(op, others, shards, pick),
        (unit.shard_specs(), specs, (PartitionSpec(),) * len(unit.pick)),
        partition(out_spec, out_ndim),
    )
    return fn(unit.shards, others, unit.pick)


def plain_island(islands: Islands, eqn, ins: list, in_specs: list[Spec], out_spec: Spec, token: int, earlier=()):
    """``eqn`` on plain parameters and activations, on each device's part: each plain parameter
    gathered there once the activation ``ins[token]`` exists (``earlier``: once that array,
    split as the spec beside it, does instead: an earlier layer's input), its gradient
    reduce-scattered from the devices' parts."""
    specs, arrays = [], []
    for a, s in zip(ins, in_specs):
        if isinstance(a, PlainValue):
            entries = [None] * a.array.ndim
            if a.shard_axis is not None:
                entries[a.shard_axis] = islands.entry
            specs.append(PartitionSpec(*entries))
            arrays.append(a.array)
        else:
            specs.append(partition(s, np.ndim(a)))
            arrays.append(a)

    if earlier:
        arrays.append(earlier[0])
        specs.append(earlier[1])

    def body(*local):
        dep = local[len(ins)] if earlier else local[token]
        args = []
        for a, loc in zip(ins, local):
            if isinstance(a, PlainValue):
                whole = loc
                if a.shard_axis is not None:
                    whole = gather_after(islands.entry, a.shard_axis, loc, dep)
                args.append(a.value(whole))
            else:
                args.append(loc)
        return bind(eqn, args)[0]

    fn = islands.island(body, tuple(specs), partition(out_spec, eqn.outvars[0].aval.ndim))
    return fn(*arrays)


def collective_island(islands: Islands, eqn, ins: list, in_specs: list[Spec], out_specs: list[Spec]) -> list:
    """A collective of the model's over an axis the islands are not manual over (tensor
    parallelism's), on each device's part of the batch: left to XLA, it would gather the batch
    along the FSDP axes first."""
    in_p = tuple(partition(s, np.ndim(x)) for s, x in zip(in_specs, ins))
    out_p = tuple(partition(s, v.aval.ndim) for s, v in zip(out_specs, eqn.outvars))
    body = _COLLECTIVE_BODIES[eqn.primitive.name](eqn)
    return list(islands.island(body, in_p, out_p)(*ins))


def _bound(eqn):
    return lambda *a: tuple(bind(eqn, list(a)))


def _scattered(eqn):
    if eqn.params.get("axis_index_groups") is not None:
        return _bound(eqn)
    return lambda x: (reduce_scatter(x, eqn.params),)


# A collective's island body, by its primitive's name: as traced, a reduce-scatter as
# ``reduce_scatter``.
_COLLECTIVE_BODIES = {**dict.fromkeys(fsdp_specs.COLLECTIVES, _bound), **dict.fromkeys(fsdp_specs.SCATTERS, _scattered)}


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


def reduce_scatter(x: jax.Array, params: dict) -> jax.Array:
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


def _split_one(islands: Islands, shape, free, entries) -> list:
    """``entries`` with the first free axis the islands' devices divide split over them."""
    n = islands.topology.fsdp_size
    for d in free:
        if shape[d] % n == 0 and shape[d] > 0:
            entries = list(entries)
            entries[d] = islands.entry
            return entries
    return entries


def _given(islands: Islands, given, act, entries):
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
        col = _columnwise_rows(act.shape[:-1], lead, given.order, islands.sizes)
    if col is None:
        arrays, specs = (normed, codes, scales), row_specs

        def rebuilt(a):
            return mxfp8_gemm.GivenOperand((*a, None, None), None)

        return arrays, specs, rebuilt
    rows, col_entries, local_order = col
    k = cq.shape[-1]
    cq = cq.reshape(*rows, k)
    cs = cs.reshape(*rows[:-1], rows[-1] // 32, k)
    spec = PartitionSpec(*col_entries, None)

    def rebuilt_col(a):
        normed, codes, scales, q, s = a
        order = None if given.order is None else local_order(q.shape[:-1])
        return mxfp8_gemm.GivenOperand((normed, codes, scales, q.reshape(-1, k), s.reshape(-1, k)), order)

    return (normed, codes, scales, cq, cs), (*row_specs, spec, spec), rebuilt_col


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
