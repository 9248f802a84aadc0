"""Which axes of each value of the loss are split over the mesh: the batch sharding, followed.

The step evaluates the loss on global arrays under ``jit`` with the batch split over the mesh
along its leading axis; XLA's partitioner carries that split through the model. Each op that
reads a unit runs on local shards inside a ``shard_map`` (``fsdp_eval``), whose ``in_specs``
must split the activation the way XLA already has it, or XLA reshuffles it into and out of the
op, silently and at the cost of an all-to-all. This module follows the batch split through the
loss's jaxpr with the simple rules XLA's propagation agrees with on the ops models use
(elementwise ops, broadcasts, reshapes that keep the split axis major, transposes, GEMMs,
reductions, scans), so that each island can ask for the split its input has.

A spec is a tuple with one entry per axis of the value: None (not split) or the mesh axes the
axis is split over, as a ``PartitionSpec`` entry. ``None`` for the whole value means nothing is
known to be split (replicated, or an op these rules do not follow): the island then splits the
activation along a free axis itself (correct either way; only the data movement differs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import INLINED_CALLS, primitives

P = jcore.primitives
Spec = tuple | None

# Ops whose output has the operands' shape and whose element i reads only element i of each.
ELEMENTWISE = primitives(
    *(
        f"{n}_p"
        for n in (
            "add sub mul div neg max min pow integer_pow exp exp2 log log1p tanh logistic sin cos tan sqrt rsqrt "
            "cbrt abs sign floor ceil round is_finite select_n convert_element_type copy eq ne lt le gt ge and or "
            "not xor erf erfc erf_inv square reduce_precision nextafter rem atan2 expm1 clamp stop_gradient "
            "imag real conj shift_left shift_right_logical shift_right_arithmetic population_count "
            "bitcast_convert_type sharding_constraint"
        ).split()
    )
)
REDUCTIONS = primitives(
    "reduce_sum_p", "reduce_max_p", "reduce_min_p", "reduce_prod_p", "reduce_and_p", "reduce_or_p", "reduce_xor_p"
)
ARG_REDUCTIONS = primitives("argmax_p", "argmin_p")
CUSTOM_CALLS = primitives("custom_jvp_call_p", "custom_vjp_call_p")
# Collectives over a manual axis (a model's own tensor-parallel communication): they move data
# along that axis only, so the batch split of their operands carries through.
# By name: not every jax exports them all (reduce_scatter is not in jax.extend).
SAME_SHAPE_COLLECTIVES = frozenset({"psum", "pmax", "pmin", "ppermute", "psum_invariant"})
GATHERS = frozenset({"all_gather", "all_gather_invariant"})
SCATTERS = frozenset({"reduce_scatter"})
COLLECTIVES = SAME_SHAPE_COLLECTIVES | GATHERS | SCATTERS


def is_collective(prim) -> bool:
    """A collective primitive (over any mesh axis)."""
    return prim.name in COLLECTIVES


CUMULATIVE = primitives("cumsum_p", "cumprod_p", "cummax_p", "cummin_p", "cumlogsumexp_p")


def axes_count(entry, sizes: dict[str, int]) -> int:
    """How many devices a spec entry splits an axis over."""
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(sizes[a] for a in names)


def batch_spec(ndim: int, entries: Sequence) -> Spec:
    """A batch leaf's spec: its leading axes split as ``entries`` say, the rest not."""
    if ndim == 0:
        return None
    out = tuple(entries[:ndim]) + (None,) * max(0, ndim - len(entries))
    return out if any(e is not None for e in out) else None


class Propagation:
    """The batch-split rules over a mesh whose axis sizes are ``sizes``."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = dict(sizes)

    # -- one equation -------------------------------------------------------------------------

    def eqn(self, eqn, ins: list[Spec]) -> list[Spec]:
        """The specs of ``eqn``'s outputs from its operands' (a higher-order primitive's body is
        walked; an op these rules do not know gives None)."""
        prim, params = eqn.primitive, eqn.params
        shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
        outs = [getattr(v.aval, "shape", ()) for v in eqn.outvars]
        if all(s is None for s in ins):  # nothing split goes in: nothing split comes out
            return [None] * len(outs)
        if prim in INLINED_CALLS:
            inner, consts = jaxprs.call_body(eqn)
            return self.walk(inner, [None] * len(consts), ins)
        if prim is jaxprs.REMAT:
            inner, consts = jaxprs.remat_body(eqn)
            return self.walk(inner, [None] * len(consts), ins)
        if prim is jaxprs.SCAN:
            return self.scan(eqn, ins)
        if prim in CUSTOM_CALLS and "call_jaxpr" in params:  # the primal computation
            inner, consts = jaxprs.body(params["call_jaxpr"])
            return self.walk(inner, [None] * len(consts), ins)
        if prim in ELEMENTWISE:
            return [self._elementwise(ins, shapes, o) for o in outs]
        if is_collective(prim):
            return self._collective(prim.name, params, ins, outs)
        if prim is P.broadcast_in_dim_p:
            return [self._broadcast(ins[0], shapes[0], outs[0], params["broadcast_dimensions"])]
        if prim is P.reshape_p:
            if params.get("dimensions") is not None:
                return [None]
            return [self._reshape(ins[0], shapes[0], outs[0])]
        if prim is P.transpose_p:
            s = ins[0]
            return [None if s is None else tuple(s[p] for p in params["permutation"])]
        if prim is P.squeeze_p:
            s = ins[0]
            drop = {d % len(shapes[0]) for d in params["dimensions"]}
            return [None if s is None else _nonempty(tuple(e for i, e in enumerate(s) if i not in drop))]
        if prim is P.dot_general_p:
            return [self._dot(ins, shapes, params["dimension_numbers"])]
        if prim in REDUCTIONS or prim in ARG_REDUCTIONS:
            s = ins[0]
            dims = set(params["axes"])
            return [None if s is None else _nonempty(tuple(e for i, e in enumerate(s) if i not in dims))]
        if prim in CUMULATIVE:
            s, axis = ins[0], params["axis"]
            return [None if s is None else _nonempty(tuple(None if i == axis else e for i, e in enumerate(s)))]
        if prim in (P.slice_p, P.pad_p, P.rev_p, P.dynamic_slice_p, P.dynamic_update_slice_p, P.concatenate_p):
            # the axes whose size the op keeps keep their split (a concatenate: where all agree)
            same = [s for s, shape in zip(ins, shapes) if s is not None and len(shape) == len(outs[0])]
            merged = (
                self._merge(same) if prim is P.concatenate_p else (ins[0] if len(shapes[0]) == len(outs[0]) else None)
            )
            if merged is None:
                return [None]
            keep = tuple(e if shapes[0][i] == outs[0][i] else None for i, e in enumerate(merged))
            return [_nonempty(keep)]
        if prim is P.gather_p:
            return [self._gather(ins, shapes, outs[0], params)]
        if prim is P.iota_p:
            return [None]
        return [None] * len(outs)

    # -- bodies -------------------------------------------------------------------------------

    def walk(self, jaxpr, consts: list[Spec], args: list[Spec]) -> list[Spec]:
        """The specs of ``jaxpr``'s outputs from its consts' and inputs'."""
        env: dict = {}

        def read(v):
            return None if isinstance(v, jcore.Literal) else env.get(v)

        for v, s in zip(jaxpr.constvars, consts):
            env[v] = s
        for v, s in zip(jaxpr.invars, args):
            env[v] = s
        for e in jaxpr.eqns:
            for v, s in zip(e.outvars, self.eqn(e, [read(v) for v in e.invars])):
                if not isinstance(v, jcore.DropVar):
                    env[v] = s
        return [read(v) for v in jaxpr.outvars]

    def scan_carry(self, parts: jaxprs.ScanParts, consts: list[Spec], carry: list[Spec], xs: list[Spec]) -> list[Spec]:
        """The carries' specs at a fixed point: a carry keeps an entry only where every
        iteration's output agrees with its input."""
        for _ in range(8):
            outs = self.walk(parts.jaxpr, [None] * len(parts.consts), [*consts, *carry, *xs])
            new = [self._merge([c, o]) if c is not None and o is not None else None for c, o in zip(carry, outs)]
            if new == carry:
                break
            carry = new
        return carry

    def scan(self, eqn, ins: list[Spec]) -> list[Spec]:
        parts = jaxprs.scan_parts(eqn)
        nc, ncar = parts.num_consts, parts.num_carry
        consts, carry, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        xs = [sliced(s) for s in xs]
        carry = self.scan_carry(parts, consts, list(carry), xs)
        outs = self.walk(parts.jaxpr, [None] * len(parts.consts), [*consts, *carry, *xs])
        ys = [None if s is None else (None, *s) for s in outs[ncar:]]
        return [*carry, *ys]

    # -- rules ----------------------------------------------------------------------------------

    def _merge(self, specs: list[Spec]) -> Spec:
        """Specs of operands of one shape -> the output's: each axis split as every operand that
        splits it says; an axis two operands split differently, or a mesh axis used twice, is
        not split."""
        specs = [s for s in specs if s is not None]
        if not specs:
            return None
        out = []
        for entries in zip(*specs):
            found = {e for e in entries if e is not None}
            out.append(found.pop() if len(found) == 1 else None)
        used: list = []
        for e in out:
            if e is not None:
                used.extend(e if isinstance(e, tuple) else (e,))
        if len(used) != len(set(used)):
            return None
        return _nonempty(tuple(out))

    def _collective(self, name: str, params, ins, outs) -> list[Spec]:
        """A collective over a manual axis: each output split as its operand, but along the axis
        it gathers or scatters (which must not be split)."""
        if name in SAME_SHAPE_COLLECTIVES:
            return list(ins[: len(outs)])
        s = ins[0]
        d = params["all_gather_dimension"] if name in GATHERS else params["scatter_dimension"]
        if s is None or s[d] is not None:
            return [None]
        if params.get("tiled", False):
            return [s]
        if name in GATHERS:  # a new axis of the group's members at d
            return [_nonempty((*s[:d], None, *s[d:]))]
        return [_nonempty(s[:d] + s[d + 1 :])]

    def _elementwise(self, ins, shapes, out) -> Spec:
        """Operands of the output's rank (size-1 axes broadcast: they split nothing) -> the
        output's spec."""
        specs = []
        for s, shape in zip(ins, shapes):
            if s is None or len(shape) != len(out):
                continue
            specs.append(tuple(e if shape[d] == out[d] else None for d, e in enumerate(s)))
        return self._merge(specs)

    def _broadcast(self, s: Spec, shape, out, dims) -> Spec:
        if s is None:
            return None
        new = [None] * len(out)
        for i, d in enumerate(dims):
            if s[i] is not None and shape[i] == out[d]:
                new[d] = s[i]
        return _nonempty(tuple(new))

    def _reshape(self, s: Spec, shape, out) -> Spec:
        """Groups of input and output axes with equal products: a group whose only split axis is
        its major (first non-1) one passes the split to its major output axis when that axis's
        size is a multiple of the device count (contiguous chunks stay contiguous)."""
        if s is None:
            return None
        new = [None] * len(out)
        for gi, gj in jaxprs.reshape_groups(shape, out):
            split = [k for k in gi if s[k] is not None]
            if split == [gi[0]] and out[gj[0]] % axes_count(s[gi[0]], self.sizes) == 0:
                new[gj[0]] = s[gi[0]]
        return _nonempty(tuple(new))

    def _dot(self, ins, shapes, dims) -> Spec:
        (lc, rc), (lb, rb) = dims
        ls, rs = ins[0], ins[1]
        lfree = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        rfree = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
        entry = lambda s, d: None if s is None else s[d]
        batch = []
        for a, b in zip(lb, rb):
            x, y = entry(ls, a), entry(rs, b)
            batch.append(x if x == y or y is None else y if x is None else None)
        out = [*batch, *(entry(ls, d) for d in lfree), *(entry(rs, d) for d in rfree)]
        return self._merge([tuple(out)])

    def _gather(self, ins, shapes, out, params) -> Spec:
        """A lookup ``table[ids]``: the output's batch axes (those not in ``offset_dims``) are the
        index array's axes but its last (the index vector), in order."""
        ids = ins[1] if len(ins) > 1 else None
        if ids is None:
            return None
        dn = params["dimension_numbers"]
        offset = set(getattr(dn, "offset_dims", ()))
        batch_entries = list(ids[:-1]) if len(shapes[1]) else []
        new, k = [], 0
        for d in range(len(out)):
            if d in offset:
                new.append(None)
            else:
                new.append(batch_entries[k] if k < len(batch_entries) else None)
                k += 1
        return _nonempty(tuple(new))


def sliced(s: Spec) -> Spec:
    """A stacked value's spec -> its slices' (a scan's xs: the leading axis goes)."""
    return None if s is None else _nonempty(s[1:])


def _nonempty(s: tuple) -> Spec:
    return s if any(e is not None for e in s) else None


def entries_of(spec: Spec, ndim: int) -> tuple:
    """A spec as ``ndim`` entries (None: not split)."""
    return (None,) * ndim if spec is None else tuple(spec)


def as_partition(spec: Spec, ndim: int) -> Any:
    from jax.sharding import PartitionSpec

    return PartitionSpec(*entries_of(spec, ndim))
