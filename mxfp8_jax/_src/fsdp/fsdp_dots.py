"""The GEMMs of a dequantized unit as the platform multiplies them: the layer's own forward
``dot_general`` and its dgrad and wgrad.

``op`` is the unit's ``fsdp_unit.UnitOp``: the layer's primitive and parameters, the unit's
operand position and ``gemm.backward`` (``"auto"``, ``"fp32"`` or ``"layer"``). Where a choice
depends on the platform it is made where the step is lowered (``lax.platform_dependent``):
XLA:CPU multiplies 16-bit operands as fp32 (the same products, exact), GPUs in the layer's
dtype with fp32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def backward_dots(op, act, v, dy) -> tuple[jax.Array, jax.Array]:
    """The dgrad and wgrad of the layer's ``dot_general`` at ``act`` and the unit's operand ``v``:
    ``(d_act, d_v)``, both fp32 (accumulated in fp32), on operands as ``op.gemm.backward`` says:
    fp32 (exact products), or the forward's dtype with ``dy`` rounded to it (a bf16 layer's
    backward GEMMs are bf16 GEMMs, as in XLA's own backward); ``"auto"``: fp32 where the step is
    lowered for CPUs, the layer's dtype elsewhere. XLA:CPU multiplies the layer's rounded values
    as fp32 (the same numbers: its GEMMs of 16-bit operands into fp32 are not all implemented)."""
    layer = jnp.promote_types(act.dtype, v.dtype)
    dims, precision = op.params["dimension_numbers"], op.params.get("precision")

    def grads(dtype, widen: bool = False):
        def run(act, v, dy):
            act, v, dy = (x.astype(dtype) for x in (act, v, dy))
            if widen:
                act, v, dy = (x.astype(jnp.float32) for x in (act, v, dy))
            lhs, rhs = in_order(op, act, v)
            d_lhs, d_rhs = dot_general_grads(lhs, rhs, dy, dims, precision)
            return (d_rhs, d_lhs) if op.position == 0 else (d_lhs, d_rhs)

        return run

    if op.gemm.backward == "fp32":
        return grads(jnp.float32)(act, v, dy)
    cpu = grads(jnp.float32) if op.gemm.backward == "auto" else grads(layer, widen=True)
    return lax.platform_dependent(act, v, dy, cpu=cpu, default=grads(layer))


def dot_general_grads(lhs, rhs, dy, dimension_numbers, precision=None) -> tuple[jax.Array, jax.Array]:
    """``(d lhs, d rhs)`` of ``y = dot_general(lhs, rhs, dimension_numbers)`` at cotangent ``dy``:
    each one ``dot_general`` of ``dy`` with the other operand, in the operands' dtype, accumulated
    and returned in fp32 (jax's own transpose multiplies an fp32 cotangent by a bf16 operand,
    which XLA widens to an fp32 GEMM)."""
    (lc, rc), (lb, rb) = dimension_numbers

    def grad(mine, other, my_c, other_c, my_b, other_b, mine_first: bool):
        my_free = [a for a in range(mine.ndim) if a not in my_c and a not in my_b]
        other_free = [a for a in range(other.ndim) if a not in other_c and a not in other_b]
        nb = len(my_b)
        start = nb + (len(my_free) if mine_first else 0)  # where other's free axes sit in dy
        dy_other = tuple(range(start, start + len(other_free)))
        out = lax.dot_general(
            dy,
            other,
            ((dy_other, tuple(other_free)), (tuple(range(nb)), tuple(other_b))),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [batch, my free, other's contracting axes in their order]
        order = list(my_b) + my_free + [my_c[k] for k in np.argsort(other_c)]
        return jnp.transpose(out, np.argsort(order))

    d_lhs = grad(lhs, rhs, list(lc), list(rc), list(lb), list(rb), True)
    d_rhs = grad(rhs, lhs, list(rc), list(lc), list(rb), list(lb), False)
    return d_lhs, d_rhs


def forward_dot(op, act, v):
    """The layer's own ``dot_general``; where the step is lowered for CPUs its 16-bit operands
    are multiplied as fp32 (exact products, fp32 accumulation, the result cast back: XLA:CPU
    does not implement every GEMM of 16-bit operands into fp32)."""
    narrow = lambda a: jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize < 4
    as_written = lambda act, v: op.prim.bind(*in_order(op, act, v), **op.params)
    if not (narrow(act) and narrow(v)):
        return as_written(act, v)

    def widened(act, v):
        out = op.params.get("preferred_element_type") or jnp.result_type(act, v)
        params = dict(op.params, preferred_element_type=jnp.float32)
        return op.prim.bind(*in_order(op, act.astype(jnp.float32), v.astype(jnp.float32)), **params).astype(out)

    return lax.platform_dependent(act, v, cpu=widened, default=as_written)


def in_order(op, act, v):
    return (act, v) if op.position == 1 else (v, act)
