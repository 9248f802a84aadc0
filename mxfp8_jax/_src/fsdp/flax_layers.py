"""This package's dense layer, the layer classes FSDP recognises without a trace, and the
tensor-parallel marks.

- ``Linear``: ``y = x @ kernel + bias`` with a ``Kernel`` parameter, operands in ``dtype`` and
  fp32 accumulation. Inside an FSDP step it is traced like any other layer: its kernel is a unit
  because a GEMM contracts it.
- ``unit_kernel_shape``: the layers whose kernels are units when ``FSDP`` has no example batch to
  trace: ``flax.nnx.Linear`` with the default ``dot_general`` and ``mxfp8_jax.flax.Linear``,
  both sides multiples of 32.
- ``tensor_parallel``: marks a Linear layer column- or row-parallel for ``FSDP(tp_axis=...)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax
from jax.typing import DTypeLike

from mxfp8_jax._src.numerics.format import BLOCK

_LECUN_NORMAL = nnx.initializers.lecun_normal()


class Kernel(nnx.Param):
    """A ``Linear`` weight ``[in, out]``: the parameters ``FSDP`` may keep as MXFP8."""


class Linear(nnx.Module):
    """``y = x @ kernel + bias`` with a ``Kernel`` parameter ``[in, out]``, like ``nnx.Linear``.

    Operands in ``dtype``, fp32 accumulation, output in ``dtype``.
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
        y = compute_dot(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), self.dtype).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias.get_value().astype(self.dtype)
        return y


# ------------------------------------------------------------------------------------------------
# Which kernels qualify


def unit_kernel_shape(module, kernel_shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
    """``(stack, in, out)`` when ``module``'s kernel is an FSDP unit by class, else None.

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

    Args:
      layer: an ``nnx.Linear`` or ``mxfp8_jax.flax.Linear`` without a bias (a bias is a
        ``ValueError``).
      role: ``"column"`` or ``"row"``.

    Returns:
      ``layer`` itself, its ``tensor_parallel`` attribute set to ``role``.
    """
    if role not in TP_ROLES:
        raise ValueError(f"role={role!r} must be one of {TP_ROLES}")
    if getattr(layer, "bias", None) is not None and getattr(layer, "use_bias", True):
        raise ValueError("a tensor-parallel layer must have no bias (use_bias=False)")
    layer.tensor_parallel = role
    return layer


# ------------------------------------------------------------------------------------------------
# The GEMM


def compute_dot(a, b, dims, compute_dtype, precision=None) -> jax.Array:
    """``dot_general`` of operands rounded to ``compute_dtype``, accumulated in fp32: one GEMM in
    the compute dtype on every platform (XLA:CPU's bf16 GEMM accumulates in fp32 too)."""
    a, b = a.astype(compute_dtype), b.astype(compute_dtype)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
