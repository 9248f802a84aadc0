"""One traversal of a jaxpr, with per-primitive rules: the shape of FSDP's three readers of a loss.

The plan's use-finding (``fsdp_trace``), the batch split's propagation (``fsdp_specs``) and the
step's evaluation of the loss (``fsdp_eval``) each run the loss's jaxpr on values of their own
(views of parameters, specs, arrays and units). A ``Traversal`` holds what they share:

- the environment loop over a jaxpr's equations (``run``): its constants and inputs bound, each
  equation's operands read (a literal through ``literal``), its results written;
- the bodies of higher-order primitives, found through ``core.jaxprs`` and handed to the rules
  as ``Body`` objects that walk them with the same interpreter (``Body.__call__``): an inlined
  call or custom_jvp / custom_vjp function, a remat region (``Remat``), a ``scan``
  (``Scan``), the branches of a ``cond`` (a list of bodies), a ``while`` (``While``);
- the dispatch (``eqn``): a higher-order primitive goes to ``kind_rules[kind]`` with its parts,
  any other to ``rules[primitive]`` (or ``rules[primitive name]``, for primitives jax does not
  export everywhere), and to ``default`` where neither has one or the rule declines (returns
  None). ``first`` chains rules tried in order.

An interpreter is a subclass with its tables, ``literal``, ``constant`` and ``default``; what a
loop or a branch means (a fixed point, a trip count, a rebuilt ``lax.scan``) is its rules'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from jax.extend import core as jcore

from mxfp8_jax._src.core import jaxprs

# ``rule(interpreter, eqn, ins)`` -> the values of ``eqn``'s results, or None to decline;
# a kind rule takes the primitive's parts too: ``rule(interpreter, eqn, parts, ins)``.
Rule = Callable[..., "list | None"]


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """A sub-jaxpr of an equation, walked by ``walker``: ``jaxpr`` takes ``consts`` (the body's
    own constants, as jax holds them) on its constvars and the arguments on its invars."""

    walker: Traversal
    jaxpr: jcore.Jaxpr
    consts: tuple

    def __call__(self, args: Sequence) -> list:
        """The body's outputs from ``args`` (values of the walker's domain)."""
        return self.walker.run(self.jaxpr, self.consts, args)

    def on(self, walker: Traversal) -> Body:
        """The same body walked by another interpreter."""
        return Body(walker, self.jaxpr, self.consts)


@dataclasses.dataclass(frozen=True, eq=False)
class Remat:
    """A rematerialised region: its ``body``, and ``policy`` / ``prevent_cse`` as
    ``jax.checkpoint`` takes them (no policy: everything is recomputed)."""

    body: Body
    policy: Any
    prevent_cse: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Scan:
    """A ``scan``: ``body`` takes ``consts + carry + xs`` (xs sliced) and gives ``carry + ys``;
    ``parts`` the equation's counts, length, direction and unrolling."""

    body: Body
    parts: jaxprs.ScanParts

    def split(self, ins: Sequence) -> tuple[list, list, list]:
        """The scan's operands as ``(consts, carry, xs)``."""
        nc, ncar = self.parts.num_consts, self.parts.num_carry
        return list(ins[:nc]), list(ins[nc : nc + ncar]), list(ins[nc + ncar :])


@dataclasses.dataclass(frozen=True, eq=False)
class While:
    """A ``while`` loop: ``cond`` takes ``cond_consts + carry``, ``body`` takes
    ``body_consts + carry``; the equation's operands are ``cond_consts + body_consts + carry``."""

    cond: Body
    body: Body
    cond_nconsts: int
    body_nconsts: int

    def split(self, ins: Sequence) -> tuple[list, list, list]:
        """The loop's operands as ``(cond_consts, body_consts, carry)``."""
        nc, nb = self.cond_nconsts, self.body_nconsts
        return list(ins[:nc]), list(ins[nc : nc + nb]), list(ins[nc + nb :])


def _scan(walker: Traversal, eqn) -> Scan:
    parts = jaxprs.scan_parts(eqn)
    return Scan(walker.body(parts.jaxpr, parts.consts), parts)


def _while(walker: Traversal, eqn) -> While:
    parts = jaxprs.while_parts(eqn)
    return While(walker.body(*parts.cond), walker.body(*parts.body), parts.cond_nconsts, parts.body_nconsts)


# How each kind of higher-order primitive's parts are found (``jaxprs.KINDS``).
PARTS: Mapping[str, Callable[[Any, Any], Any]] = {
    "call": lambda walker, eqn: walker.body(*jaxprs.call_body(eqn)),
    "custom": lambda walker, eqn: walker.body(*jaxprs.custom_body(eqn)),
    "remat": lambda walker, eqn: Remat(walker.body(*jaxprs.remat_body(eqn)), *jaxprs.remat_policy(eqn)),
    "scan": _scan,
    "cond": lambda walker, eqn: [walker.body(*b) for b in jaxprs.cond_branches(eqn)],
    "while": _while,
}


def first(*rules: Rule) -> Rule:
    """A rule that tries ``rules`` in order and gives the first result (None: all declined)."""

    def rule(walker, *args):
        for r in rules:
            out = r(walker, *args)
            if out is not None:
                return out
        return None

    return rule


class Traversal:
    """An interpreter of jaxprs over a domain of values; subclasses give the rules.

    ``kind_rules``: kind of higher-order primitive (``jaxprs.KINDS``) -> rule with its parts
    (``inline`` walks a call's body as is); a kind without one is dispatched like any primitive.
    ``rules``: primitive (or its name) -> rule. ``default``: everything else.
    """

    kind_rules: ClassVar[Mapping[str, Rule]] = {}
    rules: ClassVar[Mapping[Any, Rule]] = {}

    def literal(self, lit: jcore.Literal) -> Any:
        """A literal operand as a value of the domain."""
        raise NotImplementedError

    def constant(self, value) -> Any:
        """A body's constant (a jax array or number) as a value of the domain."""
        raise NotImplementedError

    def default(self, eqn, ins: list) -> list:
        """The values of an equation no rule takes."""
        raise NotImplementedError

    def body(self, jaxpr: jcore.Jaxpr, consts: Sequence) -> Body:
        """``jaxpr`` with its ``consts``, to be walked by this interpreter."""
        return Body(self, jaxpr, tuple(consts))

    def run(self, jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence) -> list:
        """The values of ``jaxpr``'s outputs: its constvars bound to ``consts`` (as jax holds
        them), its invars to ``args`` (values of the domain), each equation through ``eqn``."""
        env: dict = {}

        def read(v):
            return self.literal(v) if isinstance(v, jcore.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.constant(c)
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for e in jaxpr.eqns:
            for v, x in zip(e.outvars, self.eqn(e, [read(v) for v in e.invars])):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list) -> list:
        """The values of ``eqn``'s results from its operands', by the rule tables."""
        kind = jaxprs.kind(eqn)
        rule = self.kind_rules.get(kind) if kind is not None else None
        if rule is not None:
            out = rule(self, eqn, PARTS[kind](self, eqn), ins)
        else:
            rule = self.rules.get(eqn.primitive) or self.rules.get(eqn.primitive.name)
            out = None if rule is None else rule(self, eqn, ins)
        return self.default(eqn, ins) if out is None else out

    def inline(self, eqn, body: Body, ins: list) -> list:
        """A call's body walked as is, on the call's operands (a kind rule)."""
        return body(ins)

    def inline_region(self, eqn, region: Remat, ins: list) -> list:
        """A remat region's body walked as is, as a call's (a kind rule)."""
        return region.body(ins)


def static_index(branches: list[Body], k: int) -> list | None:
    """The equations of ``branches`` that read the ``k``-th operand, when each is a ``slice``
    with the same static indices and nothing else reads it (None otherwise)."""
    found, params = [], None
    for branch in branches:
        inner = branch.jaxpr
        v = inner.invars[k]
        if v in inner.outvars:
            return None
        for e in inner.eqns:
            if not any(u is v for u in e.invars):
                continue
            parts = jaxprs.slice_parts(e)
            if parts is None or parts.starts is None or e.invars[0] is not v:
                return None
            if params is not None and e.params != params:
                return None
            params = e.params
            found.append(e)
    return found or None
