"""Varying manual axes: the type shard_map(check_vma=True) gives every value.

Under ``jax.shard_map`` with its default checking, jax tracks for each value the mesh axes along
which it may differ between devices. Custom calls, ``lax.platform_dependent`` branches and
``custom_vjp`` rules must agree with it: a branch or a cotangent whose type lacks an axis its
counterpart has is an error. These helpers read that set (its attribute moved between jax
versions: ``aval.vma``, later ``aval.mat.varying``) and cast to it. With the checking off, or
outside shard_map, every value reports no axes and the helpers change nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax


def varying_axes(x) -> frozenset:
    """The manual axes along which ``x`` varies (empty where nothing is tracked)."""
    aval = jax.typeof(x)
    for path in (("vma",), ("mat", "varying")):
        v = aval
        for attr in path:
            v = getattr(v, attr, None)
        if v is not None:
            return frozenset(v)
    return frozenset()


def tracked(axis_name: str) -> bool:
    """Whether shard_map checks varying axes here (inside it, ``axis_index`` varies exactly then)."""
    return axis_name in varying_axes(jax.lax.axis_index(axis_name))


def vary(x, axes: Iterable[str]):
    """``x`` typed as varying along ``axes`` too (an invariant value is, trivially)."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not missing:
        return x
    cast = getattr(jax.lax, "pcast", None)
    if cast is not None:
        return cast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def vary_tree(tree, axes: Iterable[str]):
    axes = frozenset(axes)
    return jax.tree.map(lambda leaf: vary(leaf, axes), tree)


def union(*trees) -> frozenset:
    """The axes along which any leaf of ``trees`` varies."""
    out = frozenset()
    for leaf in jax.tree.leaves(trees):
        out |= varying_axes(leaf)
    return out


def cotangent_like(ct, primal):
    """A cotangent typed as its primal: summed over the axes along which it varies but the
    primal does not (an input the same on every device collects every device's share, as jax's
    own transposes do), and cast to varying along the primal's other axes."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return vary(ct, varying_axes(primal))
