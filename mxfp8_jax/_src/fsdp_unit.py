"""One FSDP unit inside a training step: a weight's local shards, gathered just in time.

A unit is one eligible kernel (the weight of one ``Linear`` layer), or, for a stack of layers
scanned with ``nnx.scan``, one layer's slice of the stacked kernel. Each device stores its rows
of ``W = kernel.T`` (``[out, in]``, Transformer Engine's orientation) in whole 32-row blocks:

    master      fp32        [*stack, rows, in]        rows = out_padded / n
    rowwise     E4M3 codes  [*stack, rows, in]        E8M0 scales [*stack, rows, in/32]
    columnwise  E4M3 codes  [*stack, rows, in]        E8M0 scales [*stack, rows/32, in]

(codes and scales are uint8 arrays: bytes, gathered as bytes).

Rowwise blocks run along ``in``, the forward GEMM's contraction axis; columnwise blocks along
``out``, the dgrad GEMM's. A device's rows are whole 32-row blocks, so quantizing its shard
equals quantizing the whole weight (no cross-device amax).

``unit_matmul(x, kernel)`` is ``x @ kernel`` as ONE ``custom_vjp`` over these local shards, so it
composes with ``scan``, ``remat`` and ``vmap`` like any JAX function:

    forward   all-gather the rowwise planes (8-bit), dequantize (exactly) to the compute dtype,
              ``y = x @ W.T``; save ``x`` and the LOCAL columnwise planes: no gathered weight
              outlives the call
    backward  all-gather the columnwise planes, ``dx = dy @ W``; ``dW = dy.T @ x`` in fp32 leaves
              through one reduce-scatter into this device's master rows

Under ``remat`` the recomputed forward gathers the rowwise planes again. ``precision="bf16"``
is the baseline with the same structure: the master rows are rounded to bf16 and gathered as
16-bit words, once for the forward and once for the backward.

Hopper and CPUs have no MXFP8 GEMM: the gathered planes are dequantized per GEMM operand (exact
in bf16 for normal-range values) and the GEMMs run in the compute dtype with fp32 accumulation.
Quantization is the identity for the gradient (straight-through).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from mxfp8_jax._src import spmd
from mxfp8_jax._src.format import BLOCK
from mxfp8_jax._src.layout import GlobalLayout
from mxfp8_jax._src.quantize import dequantize
from mxfp8_jax._src.tensor import MXFP8Tensor

PRECISIONS = ("mxfp8", "bf16")


@dataclasses.dataclass(frozen=True)
class UnitGeometry:
    """Static geometry of one unit: ``W [out, in]`` stored as ``out_padded`` rows split evenly
    over ``num_shards`` devices (``axes``: the collective axis name(s), in shard order)."""

    in_features: int
    out_features: int
    out_padded: int
    num_shards: int
    axes: Any
    precision: str

    @classmethod
    def build(
        cls, in_features: int, out_features: int, num_shards: int, axes: str | tuple[str, ...], precision: str
    ) -> UnitGeometry:
        if in_features % BLOCK or out_features % BLOCK:
            raise ValueError(
                f"a unit's kernel [in={in_features}, out={out_features}] needs both dimensions "
                f"to be multiples of {BLOCK} (MXFP8 blocks)"
            )
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
        # W [out, in] alone in a layout of 32-row blocks, one segment per device: its storage is
        # out rounded up so that every device holds the same number of whole blocks.
        layout = GlobalLayout.build([(out_features, in_features)], num_shards, block_size=BLOCK)
        return cls(in_features, out_features, layout.physical_size // in_features, num_shards, axes, precision)

    @property
    def rows(self) -> int:
        """Rows of ``W`` each device stores (a multiple of 32)."""
        return self.out_padded // self.num_shards

    def padded_shape(self, stack: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The stored master ``[*stack, out_padded, in]`` (all devices' rows)."""
        return (*stack, self.out_padded, self.in_features)

    def plane_shapes(self, stack: tuple[int, ...] = (), rows: int | None = None) -> tuple[tuple[int, ...], ...]:
        """``(codes, rowwise scales, columnwise scales)`` of ``rows`` rows of ``W`` (default all,
        ``out_padded``): ``[*stack, rows, in]``, ``[*stack, rows, in/32]``, ``[*stack, rows/32, in]``."""
        rows = self.out_padded if rows is None else rows
        k = self.in_features
        return (*stack, rows, k), (*stack, rows, k // BLOCK), (*stack, rows // BLOCK, k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedKernel:
    """What an eligible ``Linear`` kernel holds inside an FSDP step (a pytree of local shards).

    ``master`` is this device's fp32 rows of ``W = kernel.T``; ``rowwise`` / ``columnwise`` are
    its MXFP8 planes ``(codes, scales)`` (None under ``precision="bf16"``). Leading axes are the
    stack axes of a stacked (``nnx.vmap``-created) kernel; ``nnx.scan`` slices them away. The
    kernel's logical ``shape`` is ``(*stack, in, out)`` and ``dtype`` the parameter's dtype, as
    the layer would see without FSDP. ``kernel[...]`` is the kernel itself (what ``nnx.Linear``
    reads); ``x @ kernel`` runs ``unit_matmul``.
    """

    master: jax.Array
    rowwise: tuple[jax.Array, jax.Array] | None
    columnwise: tuple[jax.Array, jax.Array] | None
    geometry: UnitGeometry = dataclasses.field(metadata=dict(static=True))
    param_dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (*self.master.shape[:-2], g.in_features, g.out_features)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(self.param_dtype)

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError(
            f"an FSDP kernel inside a train step is read whole (kernel[...]) by the layer that "
            f"owns it; indexing it with {key!r} would gather it outside its GEMM"
        )

    def __rmatmul__(self, x):
        return unit_matmul(x, self)

    def __jax_array__(self):
        raise TypeError(
            f"an FSDP unit's kernel {self.shape} exists only as this device's shards inside the "
            f"step; it is usable by its own layer's GEMM (x @ kernel), not as an array (tied "
            f"weights and other reads of a Linear's kernel are not supported for FSDP units)"
        )

    @property
    def T(self):
        return self.__jax_array__()


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static arguments of one GEMM: geometry, dtypes, dot precision."""

    geometry: UnitGeometry
    compute_dtype: Any
    out_dtype: Any
    precision: Any


def unit_matmul(
    x: jax.Array,
    kernel: ShardedKernel,
    *,
    compute_dtype: DTypeLike | None = None,
    out_dtype: DTypeLike | None = None,
    precision: lax.PrecisionLike = None,
) -> jax.Array:
    """``x @ kernel``: ``x [..., in]`` times the unit's kernel ``[in, out]`` -> ``[..., out]``.

    Operands are rounded to ``compute_dtype`` (default ``x.dtype``) and accumulated in fp32;
    the result has ``out_dtype`` (default ``compute_dtype``). Runs inside the step's
    ``shard_map``; the kernel must have no stack axes left (call stacked layers under
    ``nnx.scan`` or ``nnx.vmap``).
    """
    if not isinstance(kernel, ShardedKernel):
        raise TypeError(f"kernel must be a ShardedKernel, got {type(kernel).__name__}")
    g = kernel.geometry
    if kernel.master.ndim != 2:
        raise ValueError(
            f"kernel of shape {kernel.shape} still has stack axes {kernel.shape[:-2]}: a stacked "
            f"layer must run under nnx.scan (or nnx.vmap), which gives each call one layer"
        )
    if x.ndim < 1 or x.shape[-1] != g.in_features:
        raise ValueError(f"x of shape {tuple(x.shape)} must end in in_features={g.in_features}")
    compute = jnp.dtype(compute_dtype if compute_dtype is not None else x.dtype)
    out = jnp.dtype(out_dtype if out_dtype is not None else compute)
    return _matmul(_Config(g, compute, out, precision), x, kernel.master, kernel.rowwise, kernel.columnwise)


# ------------------------------------------------------------------------------------------------
# The GEMM and its gradient


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(cfg: _Config, x, master, rowwise, columnwise):
    return _forward(cfg, x, master, rowwise)


def _matmul_fwd(cfg: _Config, x, master, rowwise, columnwise):
    y = _forward(cfg, x, master, rowwise)
    # local shards only (the inputs themselves: scan forwards them, nothing is copied)
    keep = columnwise if cfg.geometry.precision == "mxfp8" else master
    return y, (x, keep)


def _matmul_bwd(cfg: _Config, residuals, dy):
    x, keep = residuals
    keep = _after(keep, dy)  # the backward gather waits for the gradient that needs it
    g = cfg.geometry
    w = _gathered_weight(cfg, keep, columnwise=True)
    # dx [..., in] = dy @ W contracts over out: the columnwise blocks of W
    dx = _dot(dy, w, (((dy.ndim - 1,), (0,)), ((), ())), cfg)
    # dW [out, in] = dy.T @ x over every leading axis, fp32; padded rows get zeros
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    dw = _dot(dy2, x2, (((0,), (0,)), ((), ())), cfg)
    dw = jnp.pad(dw, ((0, g.out_padded - g.out_features), (0, 0)))
    dw_local = lax.psum_scatter(dw, g.axes, scatter_dimension=0, tiled=True)
    return dx.astype(x.dtype), dw_local, None, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _forward(cfg: _Config, x, master, rowwise):
    w = _gathered_weight(cfg, rowwise if cfg.geometry.precision == "mxfp8" else master, columnwise=False)
    # y [..., out] = x @ W.T contracts over in: the rowwise blocks of W
    y = _dot(x, w, (((x.ndim - 1,), (1,)), ((), ())), cfg)
    return y.astype(cfg.out_dtype)


def _dot(a, b, dims, cfg: _Config):
    return compute_dot(a, b, dims, cfg.compute_dtype, cfg.precision)


def compute_dot(a, b, dims, compute_dtype, precision=None) -> jax.Array:
    """``dot_general`` of operands rounded to ``compute_dtype``, accumulated in fp32.

    XLA:CPU has no fast bf16 GEMM, so there the rounded operands are multiplied as fp32 (bf16
    products are exact in fp32: the same numbers up to summation order, several times faster).
    """
    a, b = a.astype(compute_dtype), b.astype(compute_dtype)
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------------
# Gathers


def all_gather_rows(x: jax.Array, axes) -> jax.Array:
    """This device's rows ``[..., rows, K]`` -> every device's, in shard order (narrow floats as bits)."""
    return spmd.all_gather_bits(x, axes, axis=x.ndim - 2)


def _gathered_weight(cfg: _Config, local, *, columnwise: bool) -> jax.Array:
    """``W [out, in]`` in the compute dtype from this device's ``local`` shards: the planes of
    one direction under MXFP8, the master rows under bf16."""
    if cfg.geometry.precision == "mxfp8":
        return _gathered_mxfp8(cfg.geometry, local, columnwise=columnwise, dtype=cfg.compute_dtype)
    return _gathered_bf16(cfg.geometry, local).astype(cfg.compute_dtype)


def _gathered_mxfp8(g: UnitGeometry, planes, *, columnwise: bool, dtype) -> jax.Array:
    """``W [out, in]`` in ``dtype`` from the gathered rowwise or columnwise planes (exact)."""
    codes, scales = (all_gather_rows(p, g.axes) for p in planes)
    codes = lax.bitcast_convert_type(codes[: g.out_features], jnp.float8_e4m3fn)
    scales = scales[: g.out_features // BLOCK] if columnwise else scales[: g.out_features]
    shape = (g.out_features, g.in_features)
    if columnwise:
        t = MXFP8Tensor(
            rowwise_data=None, rowwise_scale=None, columnwise_data=codes, columnwise_scale=scales, shape=shape
        )
    else:
        t = MXFP8Tensor(
            rowwise_data=codes, rowwise_scale=scales, columnwise_data=None, columnwise_scale=None, shape=shape
        )
    return dequantize(t, columnwise=columnwise, dtype=dtype)


def _gathered_bf16(g: UnitGeometry, master) -> jax.Array:
    """``W [out, in]`` rounded to bf16 on each device, gathered as 16-bit words."""
    return all_gather_rows(master.astype(jnp.bfloat16), g.axes)[: g.out_features]


def _after(tree, token: jax.Array):
    """``tree`` unchanged, but computed from ``token``: work on the result can neither start
    before ``token`` exists nor be merged with the same work on ``tree`` itself (the forward's
    gather of the same bytes under ``precision="bf16"``).

    ``lax.optimization_barrier`` means this, but XLA:CPU expands barriers before common-
    subexpression elimination; a select on ``token < -inf`` (never true, not even for NaN, yet
    not folded by XLA) is a real data dependency for the cost of one pass over a local shard.
    """
    if token.size == 0:
        return tree
    never = token.reshape(-1)[0] < -jnp.inf
    return jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x), tree)
