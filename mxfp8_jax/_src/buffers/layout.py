"""How N logical tensors pack into one flat 1-D buffer split into ``dp_size`` segments (docs/design.md §3).

Pure Python: nothing here touches a jax array, so a layout is static metadata (frozen, hashable)
that can sit in a pytree's static fields and key a jit cache.

Words used below, for tensor ``i`` of shape ``(d0, d1, ...)`` and ``block_size`` ``b``:

- ``row_size(i) = d1 * d2 * ...`` (1 for a 1-D tensor); ``numel(i) = d0 * row_size(i)``.
- a *block* is ``b`` consecutive rows (``b * row_size(i)`` elements); ``d0 % b == 0``.
- *logical* coordinates index the packed buffer ``[0, size)``; segment ``k`` is the logical range
  ``[rank_segment_offsets[k], rank_segment_offsets[k+1])`` and every segment boundary falls on a
  block boundary of any tensor it cuts, so each segment owns whole blocks (possibly none).
- *physical* coordinates index the stored array of ``physical_size = dp_size * segment_capacity``
  elements: segment ``k`` lives at ``[k * segment_capacity, (k+1) * segment_capacity)``, its
  logical elements first, then zero or more padding elements. Under PADDED every segment is full,
  so physical and logical coordinates coincide.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

from mxfp8_jax._src.core import checks

Shape = tuple[int, ...]


class ShardLayout(enum.Enum):
    """How the packed buffer is cut into segments.

    ``PADDED``: Megatron's packing (lcm chunk, conjugate remainders, fragments in gaps); equal
    segments, the buffer padded to ``chunk * dp_size``.
    ``UNPADDED``: tensors back to back in id order (each at the first offset that keeps its
    alignment), cut into segments as equal as block boundaries allow; storage is
    ``dp_size * max_segment`` (each segment padded at its end).
    """

    PADDED = "padded"
    UNPADDED = "unpadded"


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------------------------------------
# The layout


@dataclasses.dataclass(frozen=True)
class GlobalLayout:
    """Static packing of ``tensor_shapes`` into one flat buffer cut into ``dp_size`` segments.

    Invariants (checked by ``_validate`` on construction):

    - every shape has at least one axis and only positive dimensions; ``d0 % block_size == 0``;
    - ``tensor_to_offset[i]`` is a multiple of ``block_size * row_size(i)``; tensors lie inside
      ``[0, size)`` and do not overlap;
    - ``rank_segment_offsets`` is non-decreasing from 0 to ``size``; each bound falls on a block
      boundary of the tensor it cuts (or between tensors);
    - PADDED layouts have equal segments.

    Build one with ``GlobalLayout.build``; the constructor takes an explicit packing.
    """

    tensor_shapes: tuple[Shape, ...]
    tensor_to_offset: tuple[int, ...]
    size: int
    rank_segment_offsets: tuple[int, ...]
    block_size: int = 1
    shard_layout: ShardLayout = ShardLayout.PADDED

    def __post_init__(self):
        object.__setattr__(self, "tensor_shapes", tuple(tuple(int(d) for d in s) for s in self.tensor_shapes))
        object.__setattr__(self, "tensor_to_offset", tuple(int(o) for o in self.tensor_to_offset))
        object.__setattr__(self, "rank_segment_offsets", tuple(int(o) for o in self.rank_segment_offsets))
        object.__setattr__(self, "size", int(self.size))
        object.__setattr__(self, "block_size", checks.positive_int(self.block_size, "block_size"))
        object.__setattr__(self, "shard_layout", ShardLayout(self.shard_layout))
        self._validate()

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        tensor_shapes: Iterable[Sequence[int]],
        dp_size: int,
        *,
        block_size: int = 1,
        shard_layout: ShardLayout = ShardLayout.PADDED,
    ) -> GlobalLayout:
        """Packs ``tensor_shapes`` for ``dp_size`` segments with the chosen ``shard_layout``.

        Args:
          tensor_shapes: the tensors' shapes, in id order; each has at least one axis, positive
            dimensions, and ``shape[0] % block_size == 0``.
          dp_size: the number of segments, a positive int.
          block_size: rows per block, a positive int; segment bounds fall on block boundaries.
          shard_layout: ``ShardLayout.PADDED`` or ``ShardLayout.UNPADDED``.

        Returns:
          The ``GlobalLayout``.
        """
        block_size = checks.positive_int(block_size, "block_size")
        shapes = _check_shapes(tensor_shapes, block_size)
        dp_size = checks.positive_int(dp_size, "dp_size")
        if not isinstance(shard_layout, ShardLayout):
            raise TypeError(f"shard_layout={shard_layout!r} must be a ShardLayout (PADDED or UNPADDED)")
        grains = [block_size * math.prod(s[1:]) for s in shapes]
        numels = [math.prod(s) for s in shapes]
        offsets, size = _padded_offsets(numels, grains, dp_size)
        if shard_layout is ShardLayout.PADDED:
            bounds = tuple(k * size // dp_size for k in range(dp_size + 1))
        else:
            offsets, size, bounds = _unpadded(numels, grains, dp_size, block_size=block_size, padded_offsets=offsets)
        return cls(shapes, tuple(offsets), size, bounds, block_size, shard_layout)

    # -- geometry ------------------------------------------------------------------------------

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_shapes)

    @property
    def dp_size(self) -> int:
        return len(self.rank_segment_offsets) - 1

    @property
    def rank_segments(self) -> tuple[tuple[int, int], ...]:
        """Logical ``(start, end)`` of each segment."""
        b = self.rank_segment_offsets
        return tuple((b[k], b[k + 1]) for k in range(self.dp_size))

    @property
    def segment_lengths(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.rank_segments)

    @property
    def is_uniform(self) -> bool:
        """Whether all segments have the same length."""
        return len(set(self.segment_lengths)) <= 1

    @property
    def segment_capacity(self) -> int:
        """Physical elements per segment: the longest segment (= ``size / dp_size`` if PADDED)."""
        return max(self.segment_lengths, default=0)

    @property
    def physical_size(self) -> int:
        """Elements of the stored array: ``dp_size * segment_capacity`` (``size`` if PADDED)."""
        return self.dp_size * self.segment_capacity

    @property
    def numel_total(self) -> int:
        """Elements that hold tensor data."""
        return sum(self.numel(i) for i in range(self.num_tensors))

    @property
    def padding_overhead(self) -> float:
        """Fraction of the physical storage that is padding (0.0 for an empty layout)."""
        phys = self.physical_size
        return 0.0 if phys == 0 else (phys - self.numel_total) / phys

    def row_size(self, i: int) -> int:
        """Elements per row of tensor ``i``.

        Args:
          i: the tensor index.

        Returns:
          The product of ``tensor_shapes[i][1:]`` (1 for a 1-D tensor).
        """
        return math.prod(self.tensor_shapes[i][1:])

    def numel(self, i: int) -> int:
        """Elements of tensor ``i``.

        Args:
          i: the tensor index.

        Returns:
          The product of ``tensor_shapes[i]``.
        """
        return math.prod(self.tensor_shapes[i])

    def tensor_range(self, i: int) -> tuple[int, int]:
        """Logical ``(start, end)`` of tensor ``i``.

        Args:
          i: the tensor index.

        Returns:
          ``(tensor_to_offset[i], tensor_to_offset[i] + numel(i))``.
        """
        o = self.tensor_to_offset[i]
        return o, o + self.numel(i)

    def local_size(self, num_shards: int) -> int:
        """Elements of each device's local buffer when the physical array is split into
        ``num_shards`` equal shards (a shard holds ``dp_size / num_shards`` whole segments).

        Args:
          num_shards: the number of shards; must divide ``dp_size``.

        Returns:
          ``physical_size // num_shards``.
        """
        if self.dp_size % num_shards:
            raise ValueError(f"num_shards={num_shards} must divide dp_size={self.dp_size}")
        return self.physical_size // num_shards

    def overlap(self, i: int, k: int) -> tuple[int, int] | None:
        """Logical ``(start, end)`` of the part of tensor ``i`` that segment ``k`` holds, or None.

        Args:
          i: the tensor index.
          k: the segment index, in ``[0, dp_size)``.

        Returns:
          The logical ``(start, end)`` of the intersection, or ``None`` when it is empty.
        """
        return self._intersect(i, *self.rank_segments[k])

    def _intersect(self, i: int, start: int, end: int) -> tuple[int, int] | None:
        lo, hi = self.tensor_range(i)
        a, b = max(lo, start), min(hi, end)
        return (a, b) if a < b else None

    def local_offset(self, logical: int, segment: int, slot: int) -> int:
        """Where logical position ``logical`` of ``segment`` is stored in a buffer that holds the
        segment as its ``slot``-th (segments back to back, ``segment_capacity`` elements each):
        a device's local buffer, or the physical array (``slot == segment``).

        Args:
          logical: a logical position inside ``segment``.
          segment: the segment index.
          slot: the segment's position in the buffer.

        Returns:
          ``slot * segment_capacity + logical - rank_segment_offsets[segment]``.
        """
        return slot * self.segment_capacity + logical - self.rank_segment_offsets[segment]

    def physical_offset(self, logical: int, segment: int) -> int:
        """Where logical position ``logical`` of ``segment`` is stored in the physical array.

        Args:
          logical: a logical position inside ``segment``.
          segment: the segment index.

        Returns:
          ``local_offset(logical, segment, segment)``.
        """
        return self.local_offset(logical, segment, segment)

    def pieces(self, k: int) -> tuple[tuple[int, int, int, int], ...]:
        """The whole rows segment ``k`` owns, as ``(tensor, first_row, n_rows, offset_in_segment)``.

        One entry per tensor that intersects the segment, in storage order; ``offset_in_segment``
        counts from the segment's first element (physical ``k * segment_capacity``).

        Args:
          k: the segment index, in ``[0, dp_size)``.

        Returns:
          A tuple of ``(tensor, first_row, n_rows, offset_in_segment)`` int tuples, sorted by
          ``offset_in_segment``; empty when the segment holds no tensor data.
        """
        if not 0 <= k < self.dp_size:
            raise ValueError(f"segment index k={k} must be in [0, {self.dp_size})")
        s = self.rank_segment_offsets[k]
        out = []
        for i in range(self.num_tensors):
            part = self.overlap(i, k)
            if part is not None:
                (a, b), rs = part, self.row_size(i)
                out.append((i, (a - self.tensor_to_offset[i]) // rs, (b - a) // rs, a - s))
        return tuple(sorted(out, key=lambda p: p[3]))

    def rows_in_segments(self, i: int, first: int, stop: int) -> tuple[int, int]:
        """``(first_row, n_rows)`` of tensor ``i`` held by the consecutive segments ``[first, stop)``.

        Consecutive segments cover one logical range, so the rows form one contiguous run.

        Args:
          i: the tensor index.
          first, stop: segment indices, ``0 <= first <= stop <= dp_size``.

        Returns:
          ``(first_row, n_rows)``, rows counted from the tensor's first row; ``(0, 0)`` when the
          segments hold none of tensor ``i``.
        """
        part = self._intersect(i, self.rank_segment_offsets[first], self.rank_segment_offsets[stop])
        if part is None:
            return 0, 0
        (a, b), rs = part, self.row_size(i)
        return (a - self.tensor_to_offset[i]) // rs, (b - a) // rs

    # -- validation ----------------------------------------------------------------------------

    def _validate(self) -> None:
        shapes = _check_shapes(self.tensor_shapes, self.block_size)
        if len(self.tensor_to_offset) != len(shapes):
            raise ValueError(f"tensor_to_offset has {len(self.tensor_to_offset)} entries for {len(shapes)} tensors")
        if not isinstance(self.shard_layout, ShardLayout):
            raise TypeError(f"shard_layout={self.shard_layout!r} must be a ShardLayout")
        spans = []
        for i, (shape, off) in enumerate(zip(shapes, self.tensor_to_offset)):
            grain = self.block_size * math.prod(shape[1:])
            end = off + math.prod(shape)
            if off < 0 or end > self.size:
                raise ValueError(f"tensor {i} {shape} at offset {off} lies outside [0, size={self.size})")
            if off % grain:
                raise ValueError(
                    f"tensor {i} {shape}: offset {off} must be a multiple of block_size * row_size = {grain}"
                )
            spans.append((off, end, i))
        spans.sort()
        for (_, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ValueError(f"tensors {i0} and {i1} overlap (tensor {i0} ends at {e0}, {i1} starts at {s1})")
        b = self.rank_segment_offsets
        if len(b) < 2 or b[0] != 0 or b[-1] != self.size or any(x > y for x, y in zip(b, b[1:])):
            raise ValueError(
                f"rank_segment_offsets={b} must be non-decreasing from 0 to size={self.size} with dp_size + 1 entries"
            )
        starts = [s for s, _, _ in spans]
        for bound in b[1:-1]:
            j = bisect.bisect_right(starts, bound) - 1
            if j >= 0:
                s, e, i = spans[j]
                grain = self.block_size * self.row_size(i)
                if s < bound < e and (bound - s) % grain:
                    raise ValueError(
                        f"segment bound {bound} cuts tensor {i} {self.tensor_shapes[i]} inside a "
                        f"block of {self.block_size} rows ({grain} elements)"
                    )
        if self.shard_layout is ShardLayout.PADDED and not self.is_uniform:
            raise ValueError(f"a PADDED layout needs equal segments, got lengths {self.segment_lengths}")


def _check_shapes(tensor_shapes, block_size) -> tuple[Shape, ...]:
    block_size = checks.positive_int(block_size, "block_size")
    if isinstance(tensor_shapes, (str, bytes)):
        raise TypeError(f"tensor_shapes must be a sequence of shapes, got {tensor_shapes!r}")
    shapes = []
    for i, s in enumerate(tensor_shapes):
        shape = checks.int_tuple(s, f"tensor_shapes[{i}]")
        if len(shape) == 0:
            raise ValueError(f"tensor_shapes[{i}]=() is 0-D; a layout holds tensors with at least one axis")
        if min(shape) < 1:
            raise ValueError(f"tensor_shapes[{i}]={shape} has a dimension < 1; dimensions must be positive")
        if shape[0] % block_size:
            raise ValueError(
                f"tensor_shapes[{i}]={shape}: dim 0 ({shape[0]}) must be divisible by "
                f"block_size={block_size} so every segment holds whole blocks"
            )
        shapes.append(shape)
    return tuple(shapes)


# ------------------------------------------------------------------------------------------------
# PADDED: Megatron's packing, step by step as docs/design.md §3 states it


def _padded_offsets(numels: list[int], grains: list[int], dp: int) -> tuple[list[int], int]:
    """Offsets and padded size. ``grains[i] = block_size * row_size(i)``."""
    n = len(numels)
    chunk = math.lcm(*grains) if grains else 1  # 1.
    fragments = sorted((i for i in range(n) if numels[i] < chunk), key=lambda i: -numels[i])  # 2.
    regular = [i for i in range(n) if numels[i] >= chunk]
    offsets = [0] * n
    placed = set()
    nxt = 0

    def fill_gap(start: int, end: int) -> None:
        for f in fragments:
            if f in placed:
                continue
            at = _pad(start, grains[f])
            if at + numels[f] <= end:
                offsets[f] = at
                placed.add(f)
                start = at + numels[f]

    for pos, i in enumerate(regular):  # 3.
        if i in placed:
            continue
        offsets[i] = nxt
        placed.add(i)
        r1 = numels[i] % chunk
        if r1 == 0:
            nxt += numels[i]
            continue
        gap_start, nxt = nxt + numels[i], nxt + _pad(numels[i], chunk)
        gap_end = nxt
        for j in regular[pos + 1 :]:
            r2 = numels[j] % chunk
            if j not in placed and r2 and r1 + r2 <= chunk:
                offsets[j] = gap_end = nxt - r2
                placed.add(j)
                nxt += (numels[j] // chunk) * chunk
                break
        fill_gap(gap_start, gap_end)
    for f in fragments:  # 4.
        if f not in placed:
            offsets[f] = _pad(nxt, grains[f])
            placed.add(f)
            nxt = offsets[f] + numels[f]
    return offsets, _pad(nxt, chunk * dp)  # 5.


# ------------------------------------------------------------------------------------------------
# UNPADDED: back to back, balanced cuts on block boundaries


class _Cuts:
    """Allowed segment bounds: the ends of every span, and ``base + j * grain`` inside it.

    Tensors are spans with ``base = start`` and ``grain = block_size * row_size`` (block
    boundaries); alignment gaps have ``base = 0`` and ``grain = block_size``, so every bound of
    a layout stays a multiple of ``block_size`` (PADDED's equal cuts are such multiples too).
    """

    def __init__(self, spans: list[tuple[int, int, int, int]]):  # (start, end, grain, base)
        self.spans = spans  # tiling [0, size) in order
        self.starts = [s for s, _, _, _ in spans]
        self.size = spans[-1][1] if spans else 0

    def floor(self, x: int) -> int:
        """The largest cut <= x."""
        if x >= self.size:
            return self.size
        s, _, g, base = self.spans[bisect.bisect_right(self.starts, x) - 1]
        return max(s, base + (x - base) // g * g)

    def ceil(self, x: int) -> int:
        """The smallest cut >= x."""
        if x <= 0:
            return 0
        if x >= self.size:
            return self.size
        s, e, g, base = self.spans[bisect.bisect_right(self.starts, x) - 1]
        return min(e, base + -(-(x - base) // g) * g)

    def segments_needed(self, start: int, cap: int) -> float:
        """Fewest segments of length <= cap covering ``[start, size)`` (greedy; inf if none)."""
        count = 0
        while start < self.size:
            nxt = self.floor(start + cap)
            if nxt <= start:
                return math.inf
            start, count = nxt, count + 1
        return count


def _balanced_bounds(cuts: _Cuts, dp: int) -> tuple[int, tuple[int, ...]]:
    """The smallest feasible max segment, and bounds each as close to ``k * size / dp`` as allowed."""
    size = cuts.size
    lo, hi = -(-size // dp), max(size, 1)
    while lo < hi:  # smallest cap that dp segments can cover
        mid = (lo + hi) // 2
        if cuts.segments_needed(0, mid) <= dp:
            hi = mid
        else:
            lo = mid + 1
    cap = lo if size else 0
    # from_end[m]: the smallest cut from which m segments of <= cap reach the end (greedy
    # from the right, the mirror of segments_needed)
    from_end = [size]
    for _ in range(dp):
        from_end.append(cuts.ceil(from_end[-1] - cap))
    bounds = [0]
    for k in range(1, dp):
        prev = bounds[-1]
        latest = cuts.floor(prev + cap)
        earliest = max(prev, from_end[dp - k])
        ideal = min(max(k * size / dp, earliest), latest)
        below, above = cuts.floor(int(ideal)), cuts.ceil(math.ceil(ideal))
        cands = [c for c in (below, above) if earliest <= c <= latest]
        bounds.append(min(cands, key=lambda c: (abs(c - ideal), c)))
    bounds.append(size)
    return cap, tuple(bounds)


def _unpadded(numels, grains, dp, *, block_size, padded_offsets):
    """Tight packing in id order, each tensor at the first offset its alignment allows.

    Returns ``(offsets, size, bounds)``. With mixed row granularities, id order can need longer
    segments than PADDED's equal ones (PADDED's reordering pairs remainders), so PADDED's own
    order is tried too, squeezed and as placed (whose equal cuts bound the result by PADDED's
    segment); id order is kept unless another order gives strictly shorter segments.
    """

    def attempt(order, fixed=None):
        offsets, spans, at = [0] * len(numels), [], 0
        for i in order:
            off = fixed[i] if fixed else _pad(at, grains[i])
            if off > at:
                spans.append((at, off, block_size, 0))  # gap: cut on any block_size multiple
            offsets[i] = off
            spans.append((off, off + numels[i], grains[i], off))
            at = off + numels[i]
        cap, bounds = _balanced_bounds(_Cuts(spans), dp)
        return cap, offsets, at, bounds

    by_padded = sorted(range(len(numels)), key=lambda i: padded_offsets[i])
    candidates = [
        attempt(range(len(numels))),
        attempt(by_padded),
        attempt(by_padded, fixed=padded_offsets),
    ]
    _, offsets, size, bounds = min(candidates, key=lambda c: c[0])  # first of the shortest
    return offsets, size, bounds
