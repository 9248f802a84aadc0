"""Reading jaxprs the same way on every supported jax.

The FSDP plan and step read the loss's jaxpr: which primitive reads a parameter, and the bodies
of ``jit``, ``custom_vjp``, ``remat``, ``scan``, ``cond`` and ``while`` (``KINDS``). The
parameters of those primitives change between jax releases, and this module is the one place
that knows how each supported release spells them:

- a sub-jaxpr is a ``ClosedJaxpr`` (jaxpr + consts) up to jax 0.10, and from 0.11 on a
  ``Jaxpr`` that carries its own consts (``body`` returns ``(open jaxpr, consts)`` for both);
- ``scan`` carries ``num_consts`` / ``num_carry`` up to 0.10, and from 0.11 on flat trees
  ``ft_in`` = (consts, carry, xs) and ``ft_out`` = (carry, ys) (``scan_parts``);
- ``jit`` was ``pjit`` in older releases; ``custom_vjp_call`` was ``custom_vjp_call_jaxpr``.

A primitive whose parameters are not spelled in any known way raises ``UnsupportedJax``, which
names the primitive, the installed jax and what to do, instead of a ``KeyError`` deep inside a
trace. ``TESTED_JAX`` is the range the test suite runs on (oldest, newest).

``counted_stacks`` sees a ``fori_loop`` that reads stacked arrays by its counter (``w[i]``) as
the scan over those stacks it is.

``reshape_groups`` pairs a ``reshape``'s input and output axes, for the two readers that follow
axes through one: the plan (parameter axes) and the step's batch split (``fsdp_specs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

# The range of jax releases CI runs the suite on (pyproject.toml and docs/install.md say the same).
TESTED_JAX = ("0.10.2", "0.12.1")


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)`` (a suffix such as ``.dev`` ends the numbers)."""
    out = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


class UntestedJaxWarning(UserWarning):
    """The installed jax is outside the range this package is tested with."""


_warned: set[str] = set()


def warn_if_untested() -> None:
    """Warns once per process when the installed jax is outside ``TESTED_JAX`` (FSDP reads its
    jaxprs, whose primitives' parameters change between releases)."""
    here, (oldest, newest) = version_tuple(jax.__version__), TESTED_JAX
    if version_tuple(oldest) <= here <= version_tuple(newest) or jax.__version__ in _warned:
        return
    _warned.add(jax.__version__)
    warnings.warn(
        f"jax {jax.__version__} is outside the releases mxfp8_jax is tested with (jax {oldest} to {newest}). "
        "FSDP reads the loss's jaxpr; a primitive it cannot read raises UnsupportedJax, but one whose meaning "
        "changed silently cannot be caught. Pin a tested jax for training runs that matter.",
        UntestedJaxWarning,
        stacklevel=3,
    )


class UnsupportedJax(RuntimeError):
    """A jaxpr primitive spelled in a way this package does not know (a jax release newer or
    older than the tested range changed it)."""


def unsupported(primitive: str, found, expected: str) -> UnsupportedJax:
    """The error for a primitive whose parameters are not spelled in a known way."""
    oldest, newest = TESTED_JAX
    where = (
        "newer than the newest"
        if version_tuple(jax.__version__) > version_tuple(newest)
        else "older than the oldest"
        if version_tuple(jax.__version__) < version_tuple(oldest)
        else "inside the range of"
    )
    return UnsupportedJax(
        f"the {primitive!r} primitive of jax {jax.__version__} has parameters {sorted(found)}, where mxfp8_jax "
        f"reads {expected}. This jax is {where} the releases mxfp8_jax is tested with (jax {oldest} to {newest}): "
        f"install one of those (pip install 'jax>={oldest},<={newest}' 'jaxlib>={oldest},<={newest}'), or report "
        "the jax version and this message to mxfp8_jax"
    )


def primitive(name: str):
    """The primitive ``name`` (e.g. ``"scan_p"``) of this jax, or None where it has none."""
    return getattr(jcore.primitives, name, None)


def primitives(*names: str) -> frozenset:
    """The primitives of those names this jax has (some are absent or renamed across versions)."""
    return frozenset(p for p in map(primitive, names) if p is not None)


# Calls whose body runs once, as is: inlined by the trace and the step.
INLINED_CALLS = primitives("jit_p", "pjit_p", "closed_call_p", "call_p", "core_call_p")
# Functions with a custom derivative: their primal body runs once, as is.
CUSTOM_CALLS = primitives("custom_jvp_call_p", "custom_vjp_call_p")
SCAN = primitive("scan_p")
REMAT = primitive("remat_p")
COND = primitive("cond_p")
WHILE = primitive("while_p")

# The higher-order primitives whose bodies the FSDP readers walk, by kind: ``"call"`` (an
# inlined call), ``"custom"`` (a custom_jvp / custom_vjp function), ``"remat"``, ``"scan"``,
# ``"cond"`` and ``"while"``.
KINDS = {
    **dict.fromkeys(INLINED_CALLS, "call"),
    **dict.fromkeys(CUSTOM_CALLS, "custom"),
    **{p: k for p, k in ((REMAT, "remat"), (SCAN, "scan"), (COND, "cond"), (WHILE, "while")) if p is not None},
}


def kind(eqn) -> str | None:
    """The kind of higher-order primitive ``eqn`` is (a key of ``KINDS``' values), None for any
    other primitive."""
    return KINDS.get(eqn.primitive)


def call_name(eqn) -> str | None:
    """The name of an inlined call (the function ``jit`` wrapped), None for any other equation."""
    return eqn.params.get("name") if eqn.primitive in INLINED_CALLS else None


def is_jaxpr(x) -> bool:
    """Whether ``x`` is a (closed or open) jaxpr, as primitives carry their bodies."""
    return isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr))


def body(j) -> tuple[jcore.Jaxpr, list]:
    """A primitive's body as ``(jaxpr, consts)``: the jaxpr whose ``constvars`` take ``consts``
    and whose ``invars`` take the primitive's operands (a ``ClosedJaxpr``, a ``Jaxpr`` that holds
    its consts, or an open ``Jaxpr`` without any)."""
    if isinstance(j, jcore.ClosedJaxpr) or (isinstance(j, jcore.Jaxpr) and hasattr(j, "consts")):
        inner = j.jaxpr
        consts = list(j.consts)
        if len(inner.constvars) != len(consts):
            raise unsupported("jaxpr", ("constvars", "consts"), "a jaxpr whose consts match its constvars")
        return inner, consts
    if isinstance(j, jcore.Jaxpr):
        if j.constvars:
            raise unsupported("jaxpr", ("constvars",), "an open jaxpr without constvars")
        return j, []
    raise unsupported("jaxpr", (type(j).__name__,), "a Jaxpr or ClosedJaxpr")


def call_body(eqn) -> tuple[jcore.Jaxpr, list]:
    """The body of an inlined call (``jit``/``pjit``, ``closed_call``, ``call``)."""
    for key in ("jaxpr", "call_jaxpr"):
        if key in eqn.params:
            return body(eqn.params[key])
    raise unsupported(eqn.primitive.name, eqn.params, "its body as 'jaxpr' or 'call_jaxpr'")


def remat_body(eqn) -> tuple[jcore.Jaxpr, list]:
    """The body of a ``remat`` (``jax.checkpoint``) region."""
    if "jaxpr" not in eqn.params:
        raise unsupported(eqn.primitive.name, eqn.params, "its body as 'jaxpr'")
    return body(eqn.params["jaxpr"])


def remat_policy(eqn) -> tuple[Any, bool]:
    """A ``remat`` region's ``(policy, prevent_cse)`` (None: no policy, everything recomputed)."""
    return eqn.params.get("policy"), bool(eqn.params.get("prevent_cse", True))


def custom_body(eqn) -> tuple[jcore.Jaxpr, list]:
    """The primal body of a ``custom_jvp_call`` / ``custom_vjp_call`` (what it computes)."""
    if "call_jaxpr" not in eqn.params:
        raise unsupported(eqn.primitive.name, eqn.params, "its primal body as 'call_jaxpr'")
    return body(eqn.params["call_jaxpr"])


@dataclasses.dataclass(frozen=True)
class ScanParts:
    """A ``scan`` equation's parts. Its operands are ``consts + carry + xs``
    (``num_consts``, ``num_carry``, the rest); its results ``carry + ys``. ``jaxpr`` is the
    body (operands as above, sliced xs), ``consts`` the values of its own constvars."""

    jaxpr: jcore.Jaxpr
    consts: list
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_parts(eqn) -> ScanParts:
    """The parts of a ``scan`` equation, however this jax spells them."""
    params = eqn.params
    common = ("jaxpr", "length", "reverse", "unroll")
    if not all(k in params for k in common):
        raise unsupported("scan", params, f"{list(common)} and either num_consts/num_carry or ft_in/ft_out")
    if "num_consts" in params and "num_carry" in params:  # jax <= 0.10
        num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
    elif "ft_in" in params:  # jax >= 0.11: flat trees (consts, carry, xs)
        groups = getattr(params["ft_in"], "elts", None)
        if groups is None or len(groups) != 3:
            raise unsupported("scan", params, "ft_in as a flat tree of (consts, carry, xs)")
        num_consts, num_carry = len(groups[0]), len(groups[1])
    else:
        raise unsupported("scan", params, "num_consts/num_carry (jax 0.10) or ft_in/ft_out (jax 0.11+)")
    jaxpr, consts = body(params["jaxpr"])
    return ScanParts(
        jaxpr, consts, num_consts, num_carry, int(params["length"]), bool(params["reverse"]), params["unroll"]
    )


@dataclasses.dataclass(frozen=True)
class CountedStacks:
    """A ``scan`` whose body reads some of its consts only a layer at a time, by the loop's
    counter (``counted_stacks``), as a scan over them: ``parts`` has those consts (``stacks``,
    their positions among the consts) moved to the end of its xs, and a body reading their
    slices where the old one sliced them."""

    parts: ScanParts
    stacks: tuple[int, ...]

    def operands(self, ins: Sequence) -> list:
        """The operands of the scan equation (``consts + carry + xs``) in ``parts``' order."""
        nc = self.parts.num_consts + len(self.stacks)
        kept = [x for p, x in enumerate(ins[:nc]) if p not in self.stacks]
        return [*kept, *ins[nc:], *(ins[p] for p in self.stacks)]


def counted_stacks(eqn, candidates) -> CountedStacks | None:
    """The scan equation ``eqn`` (a ``fori_loop`` with static bounds) as a scan over the consts
    of ``candidates`` (positions) its body reads only as ``c[counter - lower]``: a
    ``dynamic_slice`` of one layer of the leading axis, which is the loop's length, at the
    value a carry that starts at a literal and grows by 1 a trip has minus that literal (0 on the
    other axes, whatever arithmetic computes the starts: ``w[i]`` normalises negative indices).
    None where no candidate is read so, or the scan runs in reverse."""
    parts = scan_parts(eqn)
    if parts.reverse or parts.length < 1:
        return None
    jaxpr = parts.jaxpr
    counter = _counter(eqn, parts)
    if counter is None:
        return None
    cvar, lower = counter
    uses: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, jcore.Var):
                uses.setdefault(v, []).append(e)
    returned = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    slices: dict = {}  # dynamic_slice equation -> the const position it slices
    for p in sorted(candidates):
        v = jaxpr.invars[p]
        shape = tuple(v.aval.shape)
        if not shape or shape[0] != parts.length or v in returned or not uses.get(v):
            continue
        if all(_layer_slice(e, v, shape) for e in uses[v]):
            slices.update((e, p) for e in uses[v])
    if not slices:
        return None
    starts = _per_trip(jaxpr, cvar, lower, parts.length, [a for e in slices for a in e.invars[1:]])
    if starts is None:
        return None
    trips = np.arange(parts.length)
    bad, k = set(), 0
    for e, p in slices.items():
        got = starts[k : k + len(e.invars) - 1]
        k += len(e.invars) - 1
        if not (np.array_equal(got[0], trips) and all(not np.any(s) for s in got[1:])):
            bad.add(p)
    slices = {e: p for e, p in slices.items() if p not in bad}
    if not slices:
        return None
    stacks = tuple(sorted(set(slices.values())))
    return CountedStacks(_sliced_body(parts, stacks, slices, uses), stacks)


def _counter(eqn, parts: ScanParts):
    """``(invar, lower)`` of a scan's counter: an integer carry whose operand is a literal
    (``lower``) and which the body returns plus 1; None where there is none."""
    jaxpr, nc = parts.jaxpr, parts.num_consts
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    for k in range(parts.num_carry):
        var, init, out = jaxpr.invars[nc + k], eqn.invars[nc + k], jaxpr.outvars[k]
        if not (isinstance(init, jcore.Literal) and jnp.issubdtype(var.aval.dtype, jnp.integer)):
            continue
        e = producers.get(out)
        if e is None or e.primitive is not lax.add_p or var not in e.invars:
            continue
        other = e.invars[1 - e.invars.index(var)]
        if isinstance(other, jcore.Literal) and int(other.val) == 1:
            return var, int(init.val)
    return None


def _layer_slice(e, stack, shape) -> bool:
    """Whether ``e`` is a ``dynamic_slice`` of one layer of ``stack`` (its starts other values)."""
    return (
        e.primitive is lax.dynamic_slice_p
        and e.invars[0] is stack
        and stack not in e.invars[1:]
        and tuple(e.params["slice_sizes"]) == (1, *shape[1:])
    )


def _per_trip(jaxpr: jcore.Jaxpr, counter, lower: int, length: int, targets: list):
    """The values of ``targets`` (a body's operands) at each trip, ``[length]`` arrays, where
    the equations giving them read only the counter (``lower`` at the first trip) and literals;
    None where they read anything else."""
    needed = {t for t in targets if isinstance(t, jcore.Var)}
    chain = []
    for e in reversed(jaxpr.eqns):
        if needed.intersection(e.outvars):
            if sub_jaxprs(e) or getattr(e, "effects", None):
                return None
            chain.append(e)
            needed.update(v for v in e.invars if isinstance(v, jcore.Var))
    if needed - {counter} - {v for e in chain for v in e.outvars}:
        return None
    chain.reverse()

    def at(c):
        env = {counter: c}
        read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]
        for e in chain:
            env.update(zip(e.outvars, bind(e, [read(a) for a in e.invars])))
        return [jnp.broadcast_to(read(t), ()) for t in targets]

    with jax.ensure_compile_time_eval():
        values = jax.vmap(at)(jnp.arange(lower, lower + length, dtype=counter.aval.dtype))
    return [np.asarray(v) for v in values]


def _sliced_body(parts: ScanParts, stacks, slices: dict, uses: dict) -> ScanParts:
    """``parts`` with the consts at ``stacks`` moved to the xs: the body retraced, each of their
    ``slices`` (equations) read from the xs slice (a following squeeze of the layer axis taken
    as the slice itself), and what only computed the slices' starts dropped."""
    jaxpr, nc = parts.jaxpr, parts.num_consts
    squeezes = {
        u: slices[e]
        for e in slices
        for u in uses.get(e.outvars[0], ())
        if u.primitive is lax.squeeze_p and tuple(u.params["dimensions"]) == (0,)
    }
    live = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    kept_eqns = []
    for e in reversed(jaxpr.eqns):
        if not (live.intersection(e.outvars) or getattr(e, "effects", None)):
            continue
        kept_eqns.append(e)
        if e not in slices and e not in squeezes:
            live.update(v for v in e.invars if isinstance(v, jcore.Var))
    kept_eqns.reverse()
    kept = [p for p in range(nc) if p not in stacks]
    rest = jaxpr.invars[nc:]
    aval = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
    args = [aval(jaxpr.invars[p]) for p in kept] + [aval(v) for v in rest]
    args += [jax.ShapeDtypeStruct(jaxpr.invars[p].aval.shape[1:], jaxpr.invars[p].aval.dtype) for p in stacks]

    def sliced_body(*flat):
        env = dict(zip(jaxpr.constvars, parts.consts))
        env.update(zip([jaxpr.invars[p] for p in kept], flat[: len(kept)]))
        env.update(zip(rest, flat[len(kept) : len(kept) + len(rest)]))
        layer = dict(zip(stacks, flat[len(kept) + len(rest) :]))
        read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]
        for e in kept_eqns:
            if e in slices:
                env[e.outvars[0]] = lax.expand_dims(layer[slices[e]], (0,))
            elif e in squeezes:
                env[e.outvars[0]] = layer[squeezes[e]]
            else:
                env.update(zip(e.outvars, bind(e, [read(a) for a in e.invars])))
        return [read(v) for v in jaxpr.outvars]

    new_jaxpr, consts = body(jax.make_jaxpr(sliced_body)(*args))
    return dataclasses.replace(parts, jaxpr=new_jaxpr, consts=consts, num_consts=len(kept))


def cond_branches(eqn) -> list[tuple[jcore.Jaxpr, list]]:
    """The branches of a ``cond`` equation (``lax.cond``, ``lax.switch``) as ``(jaxpr, consts)``;
    its operands are the branch index, then the branches' operands."""
    if "branches" not in eqn.params:
        raise unsupported("cond", eqn.params, "its bodies as 'branches'")
    return [body(b) for b in eqn.params["branches"]]


@dataclasses.dataclass(frozen=True)
class WhileParts:
    """A ``while`` equation's parts. Its operands are ``cond_consts + body_consts + carry``;
    ``cond`` takes ``cond_consts + carry``, ``body`` takes ``body_consts + carry``."""

    cond: tuple[jcore.Jaxpr, list]
    body: tuple[jcore.Jaxpr, list]
    cond_nconsts: int
    body_nconsts: int


def while_parts(eqn) -> WhileParts:
    """The parts of a ``while`` equation (``lax.while_loop``, ``fori_loop`` with traced bounds)."""
    keys = ("cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts")
    if not all(k in eqn.params for k in keys):
        raise unsupported("while", eqn.params, str(list(keys)))
    p = eqn.params
    return WhileParts(body(p["cond_jaxpr"]), body(p["body_jaxpr"]), int(p["cond_nconsts"]), int(p["body_nconsts"]))


@dataclasses.dataclass(frozen=True)
class SliceParts:
    """A ``slice`` or ``dynamic_slice`` equation's parts: ``sizes``, the size it takes of each
    axis; ``starts``, its static start indices (a ``slice``), or None where the starts are the
    operands after the first (a ``dynamic_slice``); ``strided``: a ``slice`` with a stride
    other than 1."""

    sizes: tuple[int, ...]
    starts: tuple[int, ...] | None
    strided: bool = False


def _static_slice(params) -> SliceParts:
    starts, limits = params["start_indices"], params["limit_indices"]
    strided = any(s != 1 for s in params.get("strides") or ())
    return SliceParts(tuple(hi - lo for lo, hi in zip(starts, limits)), tuple(starts), strided)


_SLICES = {
    primitive("slice_p"): _static_slice,
    primitive("dynamic_slice_p"): lambda params: SliceParts(tuple(params["slice_sizes"]), None),
}


def slice_parts(eqn) -> SliceParts | None:
    """The parts of a ``slice`` / ``dynamic_slice`` equation, None for any other."""
    parts = _SLICES.get(eqn.primitive)
    return None if parts is None else parts(eqn.params)


def sub_jaxprs(eqn) -> list:
    """The jaxprs an equation carries in its parameters (a higher-order primitive's bodies)."""
    found = []
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        found.extend(x for x in items if is_jaxpr(x))
    return found


def where(eqn) -> str:
    """Where the user's code made ``eqn``: ``file:line (function)`` of the innermost frame outside
    jax and this package, as jax's own error messages name it ("" where jax keeps no record)."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except (ImportError, AttributeError):  # a jax without this module or record: no place given
        return ""


def all_eqns(jaxpr: jcore.Jaxpr):
    """The equations of ``jaxpr`` and, after each, those of the bodies it carries, nested
    bodies included, in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(body(sub)[0])


def bind(eqn, ins) -> list:
    """``eqn`` run as traced on ``ins`` (as ``jax.core.eval_jaxpr`` runs it)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # (subfuns, params) in some jax versions
        subfuns, params = params
    ctx = getattr(eqn, "ctx", None)
    with ctx.manager if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]):
    """The groups of a reshape's input and output axes whose sizes have equal products, in
    order, as ``(input axes, output axes)`` lists; size-1 axes belong to no group."""
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            j += 1
            continue
        if i >= len(in_shape) or j >= len(out_shape):
            return
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        yield gi, gj
