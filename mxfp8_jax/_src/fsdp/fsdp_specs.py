"""Which axes of each value of the loss are split over the mesh: the batch sharding, followed.

The step evaluates the loss on global arrays under ``jit`` with the batch split over the mesh
along its leading axis; XLA's partitioner carries that split through the model. Each op that
reads a unit runs on local shards inside a ``shard_map`` (``fsdp_eval``), whose ``in_specs``
must split the activation the way XLA already has it, or XLA reshuffles it into and out of the
op, silently and at the cost of an all-to-all. This module follows the batch split through the
loss's jaxpr with the simple rules XLA's propagation agrees with on the ops models use
(elementwise ops, broadcasts, reshapes that keep the split axis major, transposes, GEMMs,
reductions, scans), so that each island can ask for the split its input has. ``Propagation``
is these rules as tables over ``fsdp_walk``'s traversal.

A spec is a tuple with one entry per axis of the value: None (not split) or the mesh axes the
axis is split over, as a ``PartitionSpec`` entry. ``None`` for the whole value means nothing is
known to be split (replicated, or an op these rules do not follow): the island then splits the
activation along a free axis itself (correct either way; only the data movement differs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.core.jaxprs import primitives
from mxfp8_jax._src.fsdp.fsdp_walk import Body, Rule, Scan, Traversal

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
# Collectives over a manual axis (a model's own tensor-parallel communication): they move data
# along that axis only, so the batch split of their operands carries through.
# By name: not every jax exports them all (reduce_scatter is not in jax.extend).
SAME_SHAPE_COLLECTIVES = frozenset({"psum", "pmax", "pmin", "ppermute", "psum_invariant"})
GATHERS = frozenset({"all_gather", "all_gather_invariant"})
SCATTERS = frozenset({"reduce_scatter"})
COLLECTIVES = SAME_SHAPE_COLLECTIVES | GATHERS | SCATTERS
CUMULATIVE = primitives("cumsum_p", "cumprod_p", "cummax_p", "cummin_p", "cumlogsumexp_p")
(SHARDING_CONSTRAINT,) = primitives("sharding_constraint_p")


def axes_count(entry, sizes: dict[str, int]) -> int:
    """How many devices a spec entry splits an axis over."""
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(sizes[a] for a in names)


def batch_leaf_spec(ndim: int, entries: Sequence) -> Spec:
    """A batch leaf's spec: its leading axes split as ``entries`` say, the rest not."""
    if ndim == 0:
        return None
    out = tuple(entries[:ndim]) + (None,) * max(0, ndim - len(entries))
    return out if any(e is not None for e in out) else None


class Propagation(Traversal):
    """The batch-split rules over a mesh whose axis sizes are ``sizes``: a ``Traversal`` whose
    values are specs. An op whose operands are all unsplit gives unsplit results; a call,
    remat region or custom_jvp / custom_vjp function is walked as is (its primal computation);
    an op these rules do not know gives None."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = dict(sizes)

    def literal(self, lit) -> Spec:
        return None

    def constant(self, value) -> Spec:
        return None

    def default(self, eqn, ins: list[Spec]) -> list[Spec]:
        return [None] * len(eqn.outvars)

    def eqn(self, eqn, ins: list[Spec]) -> list[Spec]:
        """The specs of ``eqn``'s outputs from its operands'."""
        if all(s is None for s in ins):  # nothing split goes in: nothing split comes out
            return [None] * len(eqn.outvars)
        return super().eqn(eqn, ins)

    # -- loops --------------------------------------------------------------------------------

    def scan_carry(self, body: Body, consts: list[Spec], carry: list[Spec], xs: list[Spec]) -> list[Spec]:
        """The carries' specs at a fixed point of a scan's ``body`` (walked here): a carry keeps
        an entry only where every iteration's output agrees with its input."""
        body = body.on(self)
        for _ in range(8):
            outs = body([*consts, *carry, *xs])
            new = [self._merge([c, o]) if c is not None and o is not None else None for c, o in zip(carry, outs)]
            if new == carry:
                break
            carry = new
        return carry

    def _scan(self, eqn, loop: Scan, ins: list[Spec]) -> list[Spec]:
        consts, carry, xs = loop.split(ins)
        xs = [sliced(s) for s in xs]
        carry = self.scan_carry(loop.body, consts, carry, xs)
        outs = loop.body([*consts, *carry, *xs])
        ys = [None if s is None else (None, *s) for s in outs[loop.parts.num_carry :]]
        return [*carry, *ys]

    # -- one equation -------------------------------------------------------------------------

    def _elementwise_rule(self, eqn, ins) -> list[Spec]:
        shapes, outs = _shapes(eqn)
        return [self._elementwise(ins, shapes, o) for o in outs]

    def _same_shape_rule(self, eqn, ins) -> list[Spec]:
        """A collective over a manual axis that keeps the shape: each output split as its operand."""
        return list(ins[: len(eqn.outvars)])

    def _gather_collective_rule(self, eqn, ins) -> list[Spec]:
        """An all-gather over a manual axis: split as its operand, but along the axis it gathers
        (which must not be split); untiled, the group's members become a new axis there."""
        s, d = ins[0], eqn.params["all_gather_dimension"]
        if s is None or s[d] is not None:
            return [None]
        return [s if eqn.params.get("tiled", False) else nonempty((*s[:d], None, *s[d:]))]

    def _scatter_rule(self, eqn, ins) -> list[Spec]:
        """A reduce-scatter over a manual axis: split as its operand, but along the axis it
        scatters (which must not be split); untiled, that axis goes."""
        s, d = ins[0], eqn.params["scatter_dimension"]
        if s is None or s[d] is not None:
            return [None]
        return [s if eqn.params.get("tiled", False) else nonempty(s[:d] + s[d + 1 :])]

    def _broadcast_rule(self, eqn, ins) -> list[Spec]:
        shapes, outs = _shapes(eqn)
        return [self._broadcast(ins[0], shapes[0], outs[0], eqn.params["broadcast_dimensions"])]

    def _reshape_rule(self, eqn, ins) -> list[Spec]:
        if eqn.params.get("dimensions") is not None:
            return [None]
        shapes, outs = _shapes(eqn)
        return [self._reshape(ins[0], shapes[0], outs[0])]

    def _transpose_rule(self, eqn, ins) -> list[Spec]:
        s = ins[0]
        return [None if s is None else tuple(s[p] for p in eqn.params["permutation"])]

    def _squeeze_rule(self, eqn, ins) -> list[Spec]:
        s, (shape, *_) = ins[0], _shapes(eqn)[0]
        drop = {d % len(shape) for d in eqn.params["dimensions"]}
        return [None if s is None else nonempty(tuple(e for i, e in enumerate(s) if i not in drop))]

    def _dot_rule(self, eqn, ins) -> list[Spec]:
        return [self._dot(ins, _shapes(eqn)[0], eqn.params["dimension_numbers"])]

    def _reduction_rule(self, eqn, ins) -> list[Spec]:
        s, dims = ins[0], set(eqn.params["axes"])
        return [None if s is None else nonempty(tuple(e for i, e in enumerate(s) if i not in dims))]

    def _cumulative_rule(self, eqn, ins) -> list[Spec]:
        s, axis = ins[0], eqn.params["axis"]
        return [None if s is None else nonempty(tuple(None if i == axis else e for i, e in enumerate(s)))]

    def _resize_rule(self, eqn, ins) -> list[Spec]:
        """A slice, pad, reversal or dynamic (update) slice: the axes whose size the op keeps
        keep their split."""
        shapes, outs = _shapes(eqn)
        return [_kept(ins[0] if len(shapes[0]) == len(outs[0]) else None, shapes[0], outs[0])]

    def _concatenate_rule(self, eqn, ins) -> list[Spec]:
        """A concatenation: the axes whose size it keeps split where all operands agree."""
        shapes, outs = _shapes(eqn)
        same = [s for s, shape in zip(ins, shapes) if s is not None and len(shape) == len(outs[0])]
        return [_kept(self._merge(same), shapes[0], outs[0])]

    def _gather_rule(self, eqn, ins) -> list[Spec]:
        shapes, outs = _shapes(eqn)
        return [self._gather(ins, shapes, outs[0], eqn.params)]

    kind_rules: ClassVar[Mapping[str, Rule]] = {
        "call": Traversal.inline,
        "remat": Traversal.inline_region,
        "custom": Traversal.inline,
        "scan": _scan,
    }
    rules: ClassVar[Mapping[Any, Rule]] = {
        **dict.fromkeys(ELEMENTWISE, _elementwise_rule),
        **dict.fromkeys(SAME_SHAPE_COLLECTIVES, _same_shape_rule),
        **dict.fromkeys(GATHERS, _gather_collective_rule),
        **dict.fromkeys(SCATTERS, _scatter_rule),
        P.broadcast_in_dim_p: _broadcast_rule,
        P.reshape_p: _reshape_rule,
        P.transpose_p: _transpose_rule,
        P.squeeze_p: _squeeze_rule,
        P.dot_general_p: _dot_rule,
        **dict.fromkeys(REDUCTIONS | ARG_REDUCTIONS, _reduction_rule),
        **dict.fromkeys(CUMULATIVE, _cumulative_rule),
        **dict.fromkeys((P.slice_p, P.pad_p, P.rev_p, P.dynamic_slice_p, P.dynamic_update_slice_p), _resize_rule),
        P.concatenate_p: _concatenate_rule,
        P.gather_p: _gather_rule,
    }

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
        return nonempty(tuple(out))

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
        return nonempty(tuple(new))

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
        return nonempty(tuple(new))

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
        return nonempty(tuple(new))


# ------------------------------------------------------------------------------------------------
# The model's own sharding constraints


MODEL_CONSTRAINTS = ("keep", "drop")


class ModelConstraintWarning(UserWarning):
    """The model's own sharding constraints replicate activations the FSDP step splits over the
    batch (``FSDP(model_constraints=)``)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A sharding constraint of the model's (``with_sharding_constraint``, MaxText's logical
    constraints) that replicates axes of an activation the batch split reaches: ``where`` the
    model applies it, the value's ``shape`` and ``dtype``, the ``spec`` it asks for and the axes
    (``dims``) it replicates that the step splits. Kept, XLA all-gathers the activation to every
    device there, and the ops after it run on the whole batch on every device until an op that
    reads a unit splits it again."""

    where: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The activation's bytes (what each device holds of it once gathered)."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        """The constraint in words, for the plan's table and its warning.

        Returns:
          ``"at <where>, pins <dtype>[<shape>] to <spec> (axis <dims> replicated)"`` (without
          the place where jax keeps no record of it).
        """
        place = f"at {self.where}, " if self.where else ""
        axes = ", ".join(map(str, self.dims))
        shape = ",".join(map(str, self.shape))
        return f"{place}pins {self.dtype}[{shape}] to {self.spec} (axis {axes} replicated)"


def replicated_dims(eqn, spec: Spec) -> tuple[int, ...]:
    """The axes of a ``sharding_constraint`` equation's operand that the batch split reaches
    (``spec``) and the constraint replicates (its spec has None there, or its sharding is
    replicated); () for any other equation, or a constraint that splits or leaves them free."""
    if eqn.primitive is not SHARDING_CONSTRAINT or spec is None:
        return ()
    sharding = eqn.params.get("sharding")
    free = eqn.params.get("unconstrained_dims") or frozenset()
    entries = getattr(sharding, "spec", None)
    if entries is None:
        if not getattr(sharding, "is_fully_replicated", False):
            return ()
        entries = ()
    entries = tuple(entries) + (None,) * max(0, len(spec) - len(tuple(entries)))
    return tuple(d for d, (s, c) in enumerate(zip(spec, entries)) if s is not None and c is None and d not in free)


class _ConstraintFinder(Propagation):
    """The batch split followed through a loss, noting each of the model's sharding constraints
    that replicates what the split reaches (the split is followed on past it, as if dropped, so
    that every such constraint is found, not only the first)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__(sizes)
        self.found: dict[int, Constraint] = {}

    def _constraint_rule(self, eqn, ins) -> list[Spec]:
        dims = replicated_dims(eqn, ins[0])
        if dims and id(eqn) not in self.found:
            aval = eqn.invars[0].aval
            spec = getattr(eqn.params.get("sharding"), "spec", "replicated")
            self.found[id(eqn)] = Constraint(jaxprs.where(eqn), tuple(aval.shape), str(aval.dtype), str(spec), dims)
        return self._elementwise_rule(eqn, ins)

    rules: ClassVar[Mapping[Any, Rule]] = {**Propagation.rules, SHARDING_CONSTRAINT: _constraint_rule}


def find_constraints(closed, specs: Sequence[Spec], sizes: dict[str, int]) -> tuple[Constraint, ...]:
    """The model's sharding constraints in ``closed`` (nested bodies included) that replicate
    axes the batch split reaches, in program order; ``specs``: the inputs' splits."""
    finder = _ConstraintFinder(sizes)
    jaxpr, consts = jaxprs.body(closed)
    finder.run(jaxpr, consts, list(specs))
    return tuple(finder.found.values())


def sliced(s: Spec) -> Spec:
    """A stacked value's spec -> its slices' (a scan's xs: the leading axis goes)."""
    return None if s is None else nonempty(s[1:])


def nonempty(s: tuple) -> Spec:
    """``s``, or None where it splits no axis."""
    return s if any(e is not None for e in s) else None


def entries_of(spec: Spec, ndim: int) -> tuple:
    """A spec as ``ndim`` entries (None: not split)."""
    return (None,) * ndim if spec is None else tuple(spec)


def partition(spec: Spec, ndim: int) -> PartitionSpec:
    """A spec of a value with ``ndim`` axes as a ``PartitionSpec``."""
    return PartitionSpec(*entries_of(spec, ndim))


def _shapes(eqn) -> tuple[list, list]:
    """The shapes of ``eqn``'s operands and results."""
    shape = lambda v: getattr(v.aval, "shape", ())
    return [shape(v) for v in eqn.invars], [shape(v) for v in eqn.outvars]


def _kept(s: Spec, in_shape, out_shape) -> Spec:
    """``s`` on the axes an op keeps the size of (the others not split)."""
    if s is None:
        return None
    return nonempty(tuple(e if in_shape[i] == out_shape[i] else None for i, e in enumerate(s)))
