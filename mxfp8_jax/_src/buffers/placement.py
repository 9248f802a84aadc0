"""Placements of a flat buffer over a device mesh, and the PartitionSpec they mean (docs/design.md §3).

One placement per mesh axis:

- ``Replicate()``: every device along the axis holds the same values.
- ``Partial("sum" | "avg")``: devices along the axis hold addends; the value is their sum (mean).
- ``RowAtomic()`` / ``BlockAtomic(n)``: the flat buffer is split along the axis ("Shard(0)");
  the split falls on whole rows / whole ``n``-row blocks of every tensor, which the layout
  guarantees (``BlockAtomic(n)`` needs a layout whose ``block_size`` is a multiple of ``n``).

Suffix rule: the Shard axes are the LAST axes of the mesh, so every device's local buffer is one
contiguous range of the flat buffer. The shard index counts the innermost Shard axis as the most
significant digit: on a mesh ``("a", "b")`` with ``[Shard, Shard]`` the device at ``(a, b)`` holds
shard ``b * size("a") + a`` and the PartitionSpec is ``P(("b", "a"))``. Gathering the outer Shard
axes therefore concatenates neighbouring shards: ``[Shard, Shard] -> [Replicate, Shard]`` is one
all-gather over ``"a"`` and leaves shard ``b`` of the coarser split on device ``(a, b)``.

Layouts are built with ``dp_size = mesh.size``; under placements with ``num_shards`` shards each
shard holds ``mesh.size // num_shards`` consecutive layout segments (``segments_of_shard``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from mxfp8_jax._src.core import checks

REDUCE_OPS = ("sum", "avg")


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every device along the mesh axis holds the whole (local) buffer."""


@dataclasses.dataclass(frozen=True)
class Partial:
    """Devices along the mesh axis hold addends of the value: ``sum`` or ``avg`` of them."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op={self.reduce_op!r}): reduce_op must be one of {REDUCE_OPS}")


@dataclasses.dataclass(frozen=True)
class RowAtomic:
    """Shard(0) of the flat buffer; every split falls between whole rows of each tensor."""


@dataclasses.dataclass(frozen=True)
class BlockAtomic:
    """Shard(0) of the flat buffer; every split falls between whole ``n``-row blocks."""

    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", checks.positive_int(self.n, "BlockAtomic(n)"))


Placement = Replicate | Partial | RowAtomic | BlockAtomic
Placements = Sequence[Placement]  # one per mesh axis
_KINDS = (Replicate, Partial, RowAtomic, BlockAtomic)


def is_shard(p: Placement) -> bool:
    """Whether ``p`` splits the flat buffer (``RowAtomic`` or ``BlockAtomic``)."""
    return isinstance(p, (RowAtomic, BlockAtomic))


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def validate_placements(mesh: Mesh, placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Checks one placement per mesh axis and the suffix rule; returns them as a tuple."""
    if isinstance(placements, _KINDS) or not isinstance(placements, Sequence):
        raise TypeError(f"placements={placements!r} must be a sequence with one placement per mesh axis")
    placements = tuple(placements)
    for j, p in enumerate(placements):
        if not isinstance(p, _KINDS):
            raise TypeError(f"placements[{j}]={p!r} is not a placement (Replicate, Partial, RowAtomic, BlockAtomic)")
    names = tuple(mesh.axis_names)
    if len(placements) != len(names):
        raise ValueError(
            f"placements {placements} has {len(placements)} entries but the mesh has "
            f"{len(names)} axes {names}; give one placement per mesh axis"
        )
    shard = [is_shard(p) for p in placements]
    first = shard.index(True) if any(shard) else len(shard)
    if not all(shard[first:]):
        raise ValueError(
            f"placements {placements}: Shard placements (RowAtomic/BlockAtomic) must form a suffix "
            f"of the list (the last mesh axes), so every local buffer stays contiguous"
        )
    return placements


def shard_axes(mesh: Mesh, placements: Sequence[Placement]) -> tuple[str, ...]:
    """Names of the Shard axes, in mesh order (outermost first)."""
    placements = validate_placements(mesh, placements)
    return tuple(n for n, p in zip(mesh.axis_names, placements) if is_shard(p))


def partition_spec(mesh: Mesh, placements: Sequence[Placement]) -> PartitionSpec:
    """The PartitionSpec of the flat 1-D buffer: the Shard axes, innermost first (most significant).

    Args:
      mesh: the device mesh.
      placements: one per mesh axis, Shard placements a suffix (checked).

    Returns:
      ``PartitionSpec(None)`` without Shard axes, ``PartitionSpec(name)`` with one, and
      ``PartitionSpec((innermost, ..., outermost))`` with several.
    """
    axes = tuple(reversed(shard_axes(mesh, placements)))
    if not axes:
        return PartitionSpec(None)
    return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def num_shards(mesh: Mesh, placements: Sequence[Placement]) -> int:
    """How many pieces the flat buffer is split into."""
    return math.prod(mesh.shape[n] for n in shard_axes(mesh, placements))


def shard_index(mesh: Mesh, placements: Sequence[Placement], position: Sequence[int]) -> int:
    """The shard held by the device at mesh ``position`` (one index per axis)."""
    axes = shard_axes(mesh, placements)
    idx = 0
    for name in reversed(axes):  # innermost Shard axis is the most significant digit
        j = mesh.axis_names.index(name)
        idx = idx * mesh.shape[name] + int(position[j])
    return idx


def device_position(mesh: Mesh, device) -> tuple[int, ...]:
    """Mesh coordinates of ``device`` (a ``jax.Device`` of the mesh)."""
    hits = np.argwhere(mesh.devices == device)
    if len(hits) != 1:
        raise ValueError(f"device {device} is not in the mesh {dict(mesh.shape)}")
    return tuple(int(c) for c in hits[0])


def segments_of_shard(mesh: Mesh, placements: Sequence[Placement], index: int) -> range:
    """Layout segments (of a layout with ``dp_size = mesh.size``) held by shard ``index``.

    Shard ``s`` holds segments ``[s * g, (s + 1) * g)`` with ``g = mesh.size // num_shards``,
    stored back to back in its local buffer (each ``layout.segment_capacity`` elements).

    Args:
      mesh: the device mesh.
      placements: one per mesh axis, Shard placements a suffix (checked).
      index: the shard index, in ``[0, num_shards(mesh, placements))``.

    Returns:
      ``range(index * g, (index + 1) * g)``.
    """
    n = num_shards(mesh, placements)
    if not 0 <= index < n:
        raise ValueError(f"shard index {index} must be in [0, {n}) for placements {tuple(placements)}")
    g = mesh.size // n
    return range(index * g, (index + 1) * g)


def check_layout_fits(placements: Sequence[Placement], block_size: int) -> None:
    """``BlockAtomic(n)`` placements need the layout's ``block_size`` to be a multiple of ``n``."""
    for j, p in enumerate(placements):
        if isinstance(p, BlockAtomic) and block_size % p.n:
            raise ValueError(
                f"placements[{j}]={p} needs a layout whose block_size is a multiple of {p.n}, "
                f"got block_size={block_size}"
            )
