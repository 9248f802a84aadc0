"""A unit's static geometry: the parameter as ``W [*stack, N, K]``, its rows split over the mesh.

A unit (``fsdp_unit``) is a parameter the loss contracts in GEMMs or reads by lookups. Its
geometry comes from how the loss reads it (``fsdp_trace``): ``K`` is the product of the axes its
GEMMs contract, ``N`` of the axes they keep; the axes scans or indices slice off are its layer
axes, wherever they are in the parameter, and the axes its GEMMs batch over (an MoE's experts)
follow them as stack axes. ``UnitGeometry`` maps the parameter to ``W`` and back, with or without
layers already sliced off; ``Gemms`` says how the unit's GEMMs multiply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mxfp8_jax._src.fsdp.fsdp_trace import product
from mxfp8_jax._src.numerics.format import BLOCK

PRECISIONS = ("mxfp8", "bf16")
# an MXFP8 unit's weight blocks: two planes of 1x32 blocks (one per GEMM direction), or one plane
# of 32x32 tiles whose scale serves both directions
WEIGHT_BLOCKS = ("1x32", "32x32")
BACKWARD_GEMMS = ("auto", "fp32", "layer")


@dataclasses.dataclass(frozen=True)
class Gemms:
    """How the GEMMs of a unit multiply (static).

    ``backward``: the dgrad and wgrad of a dequantized unit: ``"layer"`` on operands in the
    forward's dtype (bf16), accumulated in fp32; ``"fp32"`` on fp32 operands (exact products);
    ``"auto"``: chosen by the platform the step is lowered for, ``"fp32"`` on CPUs (exact, and
    as fast there) and ``"layer"`` elsewhere (``lax.platform_dependent``).
    ``mxfp8``: an ``mxfp8_gemm.GemmMode`` when an MXFP8 unit's GEMMs run in MXFP8, else None.
    """

    backward: str = "auto"
    mxfp8: Any = None

    def __post_init__(self):
        if self.backward not in BACKWARD_GEMMS:
            raise ValueError(f"backward_gemm={self.backward!r} must be one of {BACKWARD_GEMMS}")


@dataclasses.dataclass(frozen=True)
class UnitGeometry:
    """Static geometry of one unit: the parameter ``param_shape`` as ``W [*stack, N, K]``, its
    ``N`` rows padded to ``out_padded`` and split evenly over ``num_shards`` devices (``axes``:
    the collective axis name(s), in shard order).

    ``layer_axes`` are the parameter axes scans or indices slice off, in the order they do
    (``level`` of them: the leading axes of a stack on axis 0, any axes of a stack moved to lead
    before its scan); ``batch_axes`` are parameter axes its GEMMs batch over; ``n_axes`` /
    ``k_axes`` the kept and contracted ones. ``W``'s stack axes are the layer axes, then the
    batch axes, whatever their place in the parameter. ``in_features`` is ``K``,
    ``out_features`` is ``N`` (a Linear kernel ``[in, out]``). ``blocks``: an MXFP8 unit's
    weight blocks (``WEIGHT_BLOCKS``): ``"1x32"``, a rowwise and a columnwise plane, or
    ``"32x32"``, one plane with a scale per 32x32 tile of each layer's ``W``.
    """

    in_features: int
    out_features: int
    out_padded: int
    num_shards: int
    axes: Any
    precision: str
    param_shape: tuple[int, ...]
    layer_axes: tuple[int, ...]
    batch_axes: tuple[int, ...]
    n_axes: tuple[int, ...]
    k_axes: tuple[int, ...]
    blocks: str = "1x32"

    @classmethod
    def build(
        cls,
        param_shape: tuple[int, ...],
        *,
        layer_axes: tuple[int, ...],
        batch_axes: tuple[int, ...],
        n_axes: tuple[int, ...],
        k_axes: tuple[int, ...],
        num_shards: int,
        axes,
        precision: str,
    ) -> UnitGeometry:
        """The geometry of a parameter whose GEMMs contract ``k_axes`` and keep ``n_axes``.

        Args:
          param_shape: the parameter's shape (one tp slice under tensor parallelism).
          layer_axes: the parameter axes that scans or indices slice off (layers), in the order
            they slice them.
          batch_axes: the parameter axes its GEMMs batch over (stack axes after the layers).
          n_axes, k_axes: the parameter axes its GEMMs keep (``N``) and contract (``K``).
            ``layer_axes``, ``batch_axes``, ``n_axes`` and ``k_axes`` together must be a
            permutation of the parameter's axes (``ValueError`` otherwise).
          num_shards: the devices the rows are split over.
          axes: the collective axis name(s), in shard order.
          precision: ``"mxfp8"`` (``N`` and ``K`` multiples of 32, else ``ValueError``) or
            ``"bf16"``.

        Returns:
          The ``UnitGeometry``: ``K`` the product of the ``k_axes`` sizes, ``N`` of the
          ``n_axes`` sizes, ``out_padded`` ``N`` rounded up to a multiple of ``32 * num_shards``
          (MXFP8) or ``num_shards`` (bf16).
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
        shape = tuple(int(d) for d in param_shape)
        roles = tuple(layer_axes) + tuple(batch_axes) + tuple(n_axes) + tuple(k_axes)
        if sorted(roles) != list(range(len(shape))):
            raise ValueError(f"axes {roles} are not a permutation of the axes of {shape}")
        k, n = product([shape[a] for a in k_axes]), product([shape[a] for a in n_axes])
        if precision == "mxfp8" and (k % BLOCK or n % BLOCK):
            raise ValueError(f"an MXFP8 unit's W [N={n}, K={k}] needs both to be multiples of {BLOCK} (MXFP8 blocks)")
        # MXFP8: every device holds the same number of whole 32-row blocks; bf16: the same rows
        quantum = BLOCK * num_shards if precision == "mxfp8" else num_shards
        return cls(
            k,
            n,
            -(-n // quantum) * quantum,
            num_shards,
            axes,
            precision,
            shape,
            tuple(layer_axes),
            tuple(batch_axes),
            tuple(n_axes),
            tuple(k_axes),
        )

    @property
    def level(self) -> int:
        """How many layer axes scans or indices slice off."""
        return len(self.layer_axes)

    @property
    def tiled(self) -> bool:
        """32x32 blocks: one plane, which serves both GEMM directions."""
        return self.blocks == "32x32"

    @property
    def both_ways(self) -> bool:
        """A gather serves both GEMM directions: one plane of 32x32 blocks, or the bf16 weight."""
        return self.tiled or self.precision != "mxfp8"

    @property
    def plane_bytes(self) -> float:
        """Bytes a weight of one MXFP8 plane, its codes and scales (what one gather moves)."""
        return 1 + 1 / BLOCK**2 if self.tiled else 1 + 1 / BLOCK

    @property
    def rows(self) -> int:
        """Rows of ``W`` each device stores (a multiple of 32 for MXFP8)."""
        return self.out_padded // self.num_shards

    @property
    def stack(self) -> tuple[int, ...]:
        """The stack axes' sizes: the layers (scan), then the GEMM batch axes."""
        return tuple(self.param_shape[a] for a in (*self.layer_axes, *self.batch_axes))

    def padded_shape(self, stack: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The stored master ``[*stack, out_padded, K]`` (all devices' rows).

        Args:
          stack: the stack axes' sizes (default ``self.stack``).

        Returns:
          The shape as a tuple.
        """
        return (*(self.stack if stack is None else stack), self.out_padded, self.in_features)

    def plane_shapes(self, stack: tuple[int, ...] | None = None, rows: int | None = None):
        """``(codes, rowwise scales, columnwise scales)`` of ``rows`` rows (default all):
        ``[*stack, rows, K]``, ``[*stack, rows, K/32]``, ``[*stack, rows/32, K]``; for 32x32
        blocks ``(codes, tile scales [*stack, rows/32, K/32], None)``.

        Args:
          stack: the stack axes' sizes (default ``self.stack``).
          rows: the number of rows (default ``out_padded``), a multiple of 32.

        Returns:
          The three shapes as tuples (the last None for 32x32 blocks).
        """
        stack = self.stack if stack is None else stack
        rows = self.out_padded if rows is None else rows
        k = self.in_features
        if self.tiled:
            return (*stack, rows, k), (*stack, rows // BLOCK, k // BLOCK), None
        return (*stack, rows, k), (*stack, rows, k // BLOCK), (*stack, rows // BLOCK, k)

    @property
    def perm(self) -> tuple[int, ...]:
        """Parameter axes in the order of ``W``'s: layers, batch, N, K."""
        return self.layer_axes + self.batch_axes + self.n_axes + self.k_axes

    def sliced_shape(self, level: int = 0) -> tuple[int, ...]:
        """The parameter's shape with its first ``level`` layer axes sliced off.

        Args:
          level: how many of ``layer_axes`` are sliced off, in order (at most ``self.level``).

        Returns:
          The shape of the value a scan body or ``w[i]`` reads, as a tuple: the parameter's
          other axes in their order.
        """
        gone = set(self.layer_axes[:level])
        return tuple(d for a, d in enumerate(self.param_shape) if a not in gone)

    def _sliced_perm(self, level: int) -> list[int]:
        """``perm`` without the first ``level`` layer axes, numbered as the axes of the
        parameter with those axes sliced off."""
        gone = self.layer_axes[:level]
        return [a - sum(g < a for g in gone) for a in self.perm[level:]]

    def to_master(self, value: jax.Array, level: int = 0) -> jax.Array:
        """The parameter's value (its first ``level`` layer axes already sliced off) as ``W``
        with zero padding rows ``[*stack, out_padded, K]``.

        Args:
          value: the parameter's value, shape ``sliced_shape(level)``.
          level: how many layer axes are already sliced off (at most ``self.level``).

        Returns:
          ``W`` in ``value``'s dtype; ``stack`` lacks the sliced layer axes.
        """
        w = self.to_rows(value, level)
        pad = [(0, 0)] * (w.ndim - 2) + [(0, self.out_padded - self.out_features), (0, 0)]
        return jnp.pad(w, pad)

    def to_rows(self, value: jax.Array, level: int = 0) -> jax.Array:
        """The parameter's value as ``W [*stack, N, K]`` (no padding).

        Args:
          value: the parameter's value, shape ``sliced_shape(level)``.
          level: how many layer axes are already sliced off (at most ``self.level``).

        Returns:
          ``W`` in ``value``'s dtype; ``stack`` lacks the sliced layer axes.
        """
        w = jnp.transpose(value, self._sliced_perm(level))
        lead = w.shape[: w.ndim - len(self.n_axes) - len(self.k_axes)]
        return w.reshape(*lead, self.out_features, self.in_features)

    def from_master(self, w: jax.Array, level: int = 0) -> jax.Array:
        """``W [*stack, out_padded or N, K]`` (the first ``level`` layer axes sliced off) as the
        parameter's value (padding rows dropped).

        Args:
          w: ``W`` with or without its padding rows.
          level: how many layer axes are already sliced off (at most ``self.level``).

        Returns:
          An array of ``sliced_shape(level)`` in ``w``'s dtype.
        """
        w = w[..., : self.out_features, :]
        shape = self.param_shape
        w = w.reshape(*w.shape[:-2], *(shape[a] for a in self.n_axes), *(shape[a] for a in self.k_axes))
        return jnp.transpose(w, np.argsort(self._sliced_perm(level)))
