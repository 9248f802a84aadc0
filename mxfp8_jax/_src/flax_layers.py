"""The layers whose kernels FSDP keeps as MXFP8 units, and how their calls reach the unit GEMM.

Two kinds of layer qualify, both with ``in_features`` and ``out_features`` multiples of 32:

- ``flax.nnx.Linear`` as users write it (default ``dot_general`` and ``promote_dtype``): inside
  a step, FSDP hands the layer a ``dot_general`` and a ``promote_dtype`` that understand a
  ``ShardedKernel`` (``intercept``), so the model needs no rewrite; a kernel stacked by
  ``nnx.vmap`` (``[*stack, in, out]``) qualifies as well.
- ``mxfp8_jax.flax.Linear``, this package's dense layer (a ``Kernel`` parameter, operands in
  ``dtype`` with fp32 accumulation), which reads its kernel and calls ``unit_matmul`` itself.

Outside a step both are ordinary dense layers.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax
from jax.typing import DTypeLike

from mxfp8_jax._src.format import BLOCK
from mxfp8_jax._src.fsdp_unit import ShardedKernel, compute_dot, unit_matmul

_LECUN_NORMAL = nnx.initializers.lecun_normal()


class Kernel(nnx.Param):
    """A ``Linear`` weight ``[in, out]``: the parameters ``FSDP`` may keep as MXFP8."""


class Linear(nnx.Module):
    """``y = x @ kernel + bias`` with a ``Kernel`` parameter ``[in, out]``, like ``nnx.Linear``.

    Operands in ``dtype``, fp32 accumulation, output in ``dtype``. Inside an FSDP step an
    eligible kernel holds a ``ShardedKernel`` and the product is the unit's GEMM.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: DTypeLike = jnp.bfloat16,
        param_dtype: DTypeLike = jnp.float32,
        kernel_init: nnx.Initializer = _LECUN_NORMAL,
        rngs: nnx.Rngs,
    ) -> None:
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.kernel = Kernel(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x):
        kernel = self.kernel.get_value()
        if isinstance(kernel, ShardedKernel):
            y = unit_matmul(x, kernel, compute_dtype=self.dtype)
        else:
            y = compute_dot(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), self.dtype).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias.get_value().astype(self.dtype)
        return y


# ------------------------------------------------------------------------------------------------
# Which kernels qualify


def unit_kernel_shape(module, kernel_shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
    """``(stack, in, out)`` when ``module``'s kernel can be an FSDP unit, else None.

    ``kernel_shape`` is ``[*stack, in, out]``; leading axes beyond the layer's own two are stack
    axes (``nnx.vmap``). ``nnx.Linear`` must use the default ``dot_general`` and
    ``promote_dtype`` (a custom one is the user's own GEMM and is left alone).
    """
    if isinstance(module, Linear):
        pass
    elif isinstance(module, nnx.Linear):
        if module.dot_general is not lax.dot_general or module.promote_dtype is not nnx_dtypes.promote_dtype:
            return None
    else:
        return None
    if len(kernel_shape) < 2:
        return None
    *stack, k_in, k_out = kernel_shape
    if (k_in, k_out) != (module.in_features, module.out_features):
        return None
    if k_in % BLOCK or k_out % BLOCK:
        return None
    return tuple(stack), k_in, k_out


# ------------------------------------------------------------------------------------------------
# Tensor parallelism


TP_ROLES = ("column", "row")


def tensor_parallel(layer, role: str):
    """Marks ``layer`` (an ``nnx.Linear`` or ``mxfp8_jax.flax.Linear``) as column-parallel
    (``out`` features split over the tp axis: QKV, gate/up) or row-parallel (``in`` features
    split: attention output, down) for ``FSDP(..., tp_axis=...)``; returns the layer.

    Without a ``tp_axis`` the mark is ignored. Under one, the layer's GEMM inside the step
    reads and writes its slice only: the model's code shapes its activations for the slice
    and reduces the row-parallel outputs over the tp axis itself (see
    ``mxfp8_jax.models.TransformerLM``). Bias-free layers only (a bias would need splitting).
    """
    if role not in TP_ROLES:
        raise ValueError(f"role={role!r} must be one of {TP_ROLES}")
    if getattr(layer, "bias", None) is not None and getattr(layer, "use_bias", True):
        raise ValueError("a tensor-parallel layer must have no bias (use_bias=False)")
    layer.tensor_parallel = role
    return layer


# ------------------------------------------------------------------------------------------------
# nnx.Linear inside a step


def intercept(module) -> None:
    """Lets an ``nnx.Linear`` whose kernel holds a ``ShardedKernel`` run the unit GEMM.

    Sets the layer's ``promote_dtype`` and ``dot_general`` to the two functions below (static
    attributes: ``nnx.scan``/``nnx.remat`` carry them into their bodies). ``mxfp8_jax.flax.Linear``
    needs nothing.
    """
    if isinstance(module, nnx.Linear):
        module.promote_dtype = promote_dtype
        module.dot_general = dot_general


def promote_dtype(args, /, *, dtype=None, inexact=True):
    """``nnx.Linear``'s dtype promotion with a ``ShardedKernel`` kept as it is.

    The compute dtype is what flax would infer from ``(inputs, kernel, bias)`` (the kernel by its
    parameter dtype); inputs and bias are cast to it, the kernel is cast inside its GEMM.
    """
    inputs, kernel, bias = args
    if not isinstance(kernel, ShardedKernel):
        return nnx_dtypes.promote_dtype(args, dtype=dtype, inexact=inexact)
    dtype = nnx_dtypes.canonicalize_dtype(inputs, jnp.zeros((), kernel.dtype), bias, dtype=dtype, inexact=inexact)
    return jnp.asarray(inputs, dtype), kernel, None if bias is None else jnp.asarray(bias, dtype)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``lax.dot_general``, or the unit GEMM when ``rhs`` is a ``ShardedKernel``."""
    if not isinstance(rhs, ShardedKernel):
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
    expected = (((lhs.ndim - 1,), (0,)), ((), ()))
    if _normalise(dimension_numbers) != expected:
        raise ValueError(f"an FSDP kernel supports x @ kernel (dimension_numbers {expected}), got {dimension_numbers}")
    if out_sharding is not None:
        raise ValueError("an FSDP kernel runs inside the step's shard_map: out_sharding must be None")
    return unit_matmul(lhs, rhs, compute_dtype=lhs.dtype, out_dtype=preferred_element_type, precision=precision)


def _normalise(dims):
    (lc, rc), (lb, rb) = dims
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
