"""A unit's MXFP8 planes as one named value: encoded from master rows, gathered a direction at a
time, decoded to the weight.

A unit's master rows ``W [*stack, rows, K]`` have up to two planes:

    rowwise     E4M3 codes [*stack, rows, K]   E8M0 scales [*stack, rows, K/32]    blocks along K
    columnwise  E4M3 codes [*stack, rows, K]   E8M0 scales [*stack, rows/32, K]    blocks along N

A GEMM that contracts ``K`` reads the rowwise plane, its dgrad (contracting ``N``) the
columnwise one. Both are stored as uint8 (XLA:CPU widens float8 arrays that cross a loop to
f16, twice the bytes); the codes are bitcast to ``float8_e4m3fn`` where they are decoded.

A unit of 32x32 blocks has one plane, which serves both directions: the codes and one scale per
32x32 tile of each layer's ``W``,

    tiles       E4M3 codes [*stack, rows, K]   E8M0 scales [*stack, rows/32, K/32]

held in the rowwise fields (``columnwise`` is None). A tile's scale is the scale of each of its
32 rowwise blocks and of each of its 32 columnwise ones, so either direction's scales are the
tile scales repeated (``direction``), expanded after the gather.

``UnitShards`` is what a device holds of one unit in a step: its master rows and its planes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mxfp8_jax._src.numerics.format import BLOCK
from mxfp8_jax._src.numerics.tensor import MXFP8Tensor
from mxfp8_jax._src.ops.quantize import dequantize, quantize


class Plane(NamedTuple):
    """One direction's plane: E4M3 codes and E8M0 scales, both as uint8."""

    data: jax.Array
    scale: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitPlanes:
    """The MXFP8 planes of one unit's master ``[*stack, N_padded, K]``, sharded like it.

    ``rowwise_data``/``columnwise_data``: E4M3 bit patterns as uint8 ``[*stack, N_padded, K]``;
    ``rowwise_scale``: uint8 ``[*stack, N_padded, K/32]``; ``columnwise_scale``: uint8
    ``[*stack, N_padded/32, K]``. Every device's rows are whole 32-row blocks of each layer. The
    columnwise fields are None for a unit with one plane.
    """

    rowwise_data: jax.Array
    rowwise_scale: jax.Array
    columnwise_data: jax.Array | None = None
    columnwise_scale: jax.Array | None = None

    @property
    def tiled(self) -> bool:
        """One plane of 32x32 blocks (the rowwise fields), serving both directions."""
        return self.columnwise_data is None

    @property
    def rowwise(self) -> Plane:
        """The plane blocked along ``K`` (what a GEMM contracting ``K`` gathers)."""
        return Plane(self.rowwise_data, self.rowwise_scale)

    @property
    def columnwise(self) -> Plane | None:
        """The plane blocked along ``N`` (what a GEMM contracting ``N`` gathers), or None."""
        if self.columnwise_data is None:
            return None
        return Plane(self.columnwise_data, self.columnwise_scale)

    def along(self, columnwise: bool) -> Plane:
        """The plane of one direction.

        Args:
          columnwise: the plane blocked along ``N`` (True) or along ``K`` (False).

        Returns:
          The ``Plane`` (codes and scales).

        A unit of 32x32 blocks gives its one plane for either direction (its scales are the
        tiles': ``direction`` expands them).
        """
        if not columnwise or self.tiled:
            return self.rowwise
        return self.columnwise

    @classmethod
    def like(cls, value, blocks: str = "1x32") -> UnitPlanes:
        """Planes whose fields are all ``value``.

        Args:
          value: anything one array of the planes is described by (a sharding, a spec).
          blocks: the unit's weight blocks: ``"1x32"`` (four fields) or ``"32x32"`` (two).

        Returns:
          ``UnitPlanes(value, value, value, value)``, or ``UnitPlanes(value, value)``.
        """
        return cls(value, value) if blocks == "32x32" else cls(value, value, value, value)

    @classmethod
    def encode(cls, w: jax.Array, scale_rule, blocks: str = "1x32") -> UnitPlanes:
        """The planes of master rows, with no communication.

        Args:
          w: rows ``[*stack, rows, K]`` of a unit's master, ``rows`` whole 32-row blocks of each
            layer (any floating dtype; quantized from its fp32 values).
          scale_rule: the MXFP8 scale rule (``format.ScaleRule`` or its name or value).
          blocks: ``"1x32"`` (both planes) or ``"32x32"`` (the one plane of tiles; a tile never
            spans two layers, whose rows are whole 32-row blocks).

        Returns:
          The ``UnitPlanes`` of these rows: the bytes quantizing the whole weight gives for them.
        """
        stack, rows, k = w.shape[:-2], w.shape[-2], w.shape[-1]
        as_bytes = lambda q: lax.bitcast_convert_type(q, jnp.uint8).reshape(w.shape)
        if blocks == "32x32":
            t = quantize(w.astype(jnp.float32).reshape(-1, k), scale_rule=scale_rule, blocks="32x32")
            return cls(as_bytes(t.data), t.scale.reshape(*stack, rows // BLOCK, k // BLOCK))
        t = quantize(w.astype(jnp.float32).reshape(-1, k), scale_rule=scale_rule)
        return cls(
            as_bytes(t.rowwise_data),
            t.rowwise_scale.reshape(*stack, rows, k // BLOCK),
            as_bytes(t.columnwise_data),
            t.columnwise_scale.reshape(*stack, rows // BLOCK, k),
        )


def direction(plane: Plane, *, columnwise: bool, tiled: bool) -> Plane:
    """``plane`` with one direction's scales: a ``tiled`` plane's tile scales ``[*batch, rows/32,
    K/32]`` repeated to that direction's layout (rowwise ``[*batch, rows, K/32]``, columnwise
    ``[*batch, rows/32, K]``); any other plane as it is."""
    if not tiled:
        return plane
    codes, scales = plane
    return Plane(codes, jnp.repeat(scales, BLOCK, axis=-1 if columnwise else -2))


def decode(plane: Plane, n: int, *, columnwise: bool, tiled: bool = False) -> jax.Array:
    """``W [*batch, n, K]`` fp32 from a gathered ``plane`` of ``[*batch, rows, K]`` (``rows >= n``:
    the padding rows are dropped), dequantized exactly; a ``tiled`` plane (32x32 blocks) gives
    the same values for either direction."""
    if tiled:
        plane, columnwise = direction(plane, columnwise=False, tiled=True), False
    codes, scales = plane
    batch, k = codes.shape[:-2], codes.shape[-1]
    codes = lax.bitcast_convert_type(codes[..., :n, :], jnp.float8_e4m3fn).reshape(-1, k)
    scales = scales[..., : n // BLOCK, :] if columnwise else scales[..., :n, :]
    scales = scales.reshape(-1, scales.shape[-1])
    if columnwise:
        t = MXFP8Tensor(None, None, codes, scales, shape=(*batch, n, k))
    else:
        t = MXFP8Tensor(codes, scales, None, None, shape=(*batch, n, k))
    return dequantize(t, columnwise=columnwise, dtype=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitShards:
    """What one unit is in a step: its ``master`` rows (fp32; a frozen unit's in its own dtype)
    and, for an MXFP8 unit, its ``planes`` (None for a bf16 unit)."""

    master: jax.Array
    planes: UnitPlanes | None = None
