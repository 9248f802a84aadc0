"""GlobalLayout / ShardLayout: the design doc's worked example and properties of random layouts.

Expected offsets below are worked by hand from the algorithm as docs/design.md §3 states it; the
properties are checked from the layout's plain fields (offsets, bounds), not its helpers.
"""

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mxfp8_jax as mx
from mxfp8_jax import GlobalLayout, ShardLayout

PADDED, UNPADDED = ShardLayout.PADDED, ShardLayout.UNPADDED


# -- worked examples -----------------------------------------------------------------------------


def test_spec_worked_example():
    lay = GlobalLayout.build([(5, 4), (2, 6), (3,)], 2)
    # chunk = lcm(4, 6, 1) = 12; (5,4) at 0 leaves gap [20, 24) that (3,) fills; (2,6) at 24.
    assert lay.tensor_to_offset == (0, 24, 20)
    assert lay.size == 48
    assert lay.rank_segment_offsets == (0, 24, 48)
    assert lay.rank_segments == ((0, 24), (24, 48))
    assert lay.dp_size == 2 and lay.is_uniform
    assert lay.physical_size == 48 and lay.segment_capacity == 24
    assert lay.padding_overhead == pytest.approx((48 - 35) / 48)
    assert lay.row_size(0) == 4 and lay.numel(1) == 12 and lay.row_size(2) == 1
    # Segment 0: rows 0..4 of (5,4) at 0, (3,) at 20; segment 1: (2,6) at 0.
    assert lay.pieces(0) == ((0, 0, 5, 0), (2, 0, 3, 20))
    assert lay.pieces(1) == ((1, 0, 2, 0),)


def test_padded_conjugate_remainder():
    # chunk 6: (4,2) has remainder 2, its gap [8, 12) is closed by (5,2) (remainder 4) placed at
    # 12 - 4 = 8; (2,3) (remainder 0) follows at 18.
    lay = GlobalLayout.build([(4, 2), (2, 3), (5, 2)], 4)
    assert lay.tensor_to_offset == (0, 18, 8)
    assert lay.size == 24 and lay.padding_overhead == 0.0


def test_padded_fragments_gap_then_tail():
    # chunk = lcm(4, 6, 2, 1, 3) = 12. Fragments by size: (1,6)=6, (2,2)=4, (3,)=3.
    # (5,4) at 0 leaves [20, 24): (1,6) would start at 24 (no fit), (2,2) fits at 20, (3,) not.
    # (4,3) at 24; tail: (1,6) at 36, (3,) at 42; size = pad(45, 12 * 2) = 48.
    lay = GlobalLayout.build([(5, 4), (1, 6), (2, 2), (3,), (4, 3)], 2)
    assert lay.tensor_to_offset == (0, 36, 20, 42, 24)
    assert lay.size == 48


def test_pathological_pair_padded_vs_unpadded():
    shapes = [(96, 64), (64, 96)]
    pad = GlobalLayout.build(shapes, 4, block_size=32)
    # chunk = lcm(32*64, 32*96) = 6144: each tensor gets a chunk, size pads to 4 * 6144.
    assert pad.tensor_to_offset == (0, 6144)
    assert pad.physical_size == 24576 and pad.padding_overhead == 0.5
    unp = GlobalLayout.build(shapes, 4, block_size=32, shard_layout=UNPADDED)
    # Cuts exist at 0, 2048, 4096, 6144, 9216, 12288: a max segment of 3072 needs 5 segments,
    # 4096 suffices -> physical 4 * 4096.
    assert unp.tensor_to_offset == (0, 6144) and unp.size == 12288
    assert unp.segment_capacity == 4096 and unp.physical_size == 16384
    assert unp.padding_overhead == 0.25
    assert not unp.is_uniform


def test_unpadded_uniform_and_more_ranks_than_blocks():
    lay = GlobalLayout.build([(8, 4), (8, 4)], 4, shard_layout=UNPADDED)
    assert lay.rank_segment_offsets == (0, 16, 32, 48, 64) and lay.padding_overhead == 0.0
    small = GlobalLayout.build([(2, 3)], 4, shard_layout=UNPADDED)
    assert small.segment_capacity == 3 and small.physical_size == 12
    assert sorted(small.segment_lengths) == [0, 0, 3, 3]
    assert [p for k in range(4) for p in small.pieces(k)] == [(0, 0, 1, 0), (0, 1, 1, 0)]


def test_unpadded_keeps_id_order_when_it_is_no_worse():
    # Id order: (5,4) [0,20), (2,6) aligned to 6 at 24, (3,) at 36; size 39. PADDED's order
    # ((5,4), (3,), (2,6)) also needs a longest segment of 20, so id order stays.
    lay = GlobalLayout.build([(5, 4), (2, 6), (3,)], 2, shard_layout=UNPADDED)
    assert lay.tensor_to_offset == (0, 24, 36) and lay.size == 39
    assert lay.rank_segment_offsets == (0, 20, 39) and lay.physical_size == 40


def test_unpadded_never_worse_than_padded_with_mixed_rows():
    # Id order ((4,2), (2,3), (5,2)) cannot be cut into 4 segments of <= 6; PADDED's order can.
    shapes = [(4, 2), (2, 3), (5, 2)]
    unp = GlobalLayout.build(shapes, 4, shard_layout=UNPADDED)
    assert unp.padding_overhead <= GlobalLayout.build(shapes, 4).padding_overhead == 0.0
    assert unp.segment_capacity == 6


def test_layout_is_frozen_hashable_static():
    a = GlobalLayout.build([(64, 32), (32,)], 8, block_size=32, shard_layout=UNPADDED)
    b = GlobalLayout.build([(64, 32), (32,)], 8, block_size=32, shard_layout=UNPADDED)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.size = 3
    assert mx.ShardLayout.PADDED is PADDED


# -- properties of random layouts ------------------------------------------------------------------


@st.composite
def layouts_args(draw):
    block = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 6))
    shapes = []
    for _ in range(n):
        ndim = draw(st.integers(1, 3))
        d0 = block * draw(st.integers(1, 6))
        rest = [draw(st.integers(1, 7)) for _ in range(ndim - 1)]
        shapes.append((d0, *rest))
    return shapes, draw(st.integers(1, 8)), block


def check_layout(lay: GlobalLayout, shapes, dp, block):
    assert lay.tensor_shapes == tuple(map(tuple, shapes)) and lay.dp_size == dp
    bounds = lay.rank_segment_offsets
    assert bounds[0] == 0 and bounds[-1] == lay.size and list(bounds) == sorted(bounds)
    spans = []
    for shape, off in zip(shapes, lay.tensor_to_offset):
        grain = block * math.prod(shape[1:])
        assert off % grain == 0, (shape, off)  # alignment
        spans.append((off, off + math.prod(shape), grain))
        assert 0 <= off and off + math.prod(shape) <= lay.size
    spans.sort()
    for (_, e0, _), (s1, _, _) in zip(spans, spans[1:]):
        assert e0 <= s1  # no overlap
    for off, end, grain in spans:
        rows_seen = 0
        for k in range(dp):  # segments partition [0, size): each element in exactly one
            a, b = max(off, bounds[k]), min(end, bounds[k + 1])
            if a < b:
                assert (a - off) % grain == 0 and (b - a) % grain == 0  # whole blocks
                rows_seen += b - a
        assert rows_seen == end - off
    assert all(b % block == 0 for b in bounds)  # MXFP8 scale layouts divide bounds by the block
    cap = max(b - a for a, b in zip(bounds, bounds[1:]))
    assert lay.segment_capacity == cap and lay.physical_size == dp * cap >= lay.size
    # pieces: the rows of every tensor, each exactly once, offsets inside the segment
    got = {i: [] for i in range(len(shapes))}
    stored = np.zeros(lay.physical_size, np.int64)  # how many elements each physical slot holds
    for k in range(dp):
        for i, row, n_rows, off in lay.pieces(k):
            rs = math.prod(shapes[i][1:])
            assert row % block == 0 and n_rows % block == 0 and n_rows > 0
            assert lay.tensor_to_offset[i] + row * rs == bounds[k] + off
            assert off + n_rows * rs <= cap  # inside its own segment's storage
            stored[k * cap + off : k * cap + off + n_rows * rs] += 1
            got[i].append((row, n_rows))
    # padding is what no piece occupies (counted from the pieces, not from the sizes)
    assert stored.max(initial=0) <= 1
    padding = int((stored == 0).sum())
    assert padding == lay.physical_size - sum(math.prod(s) for s in shapes)
    assert lay.padding_overhead == (padding / lay.physical_size if lay.physical_size else 0.0)
    for i, runs in got.items():
        assert sorted(runs) == runs and sum(n for _, n in runs) == shapes[i][0]
        assert all(r0 + n0 == r1 for (r0, n0), (r1, _) in zip(runs, runs[1:]))


@given(layouts_args())
def test_random_layouts_properties(args):
    shapes, dp, block = args
    pad = GlobalLayout.build(shapes, dp, block_size=block)
    unp = GlobalLayout.build(shapes, dp, block_size=block, shard_layout=UNPADDED)
    check_layout(pad, shapes, dp, block)
    check_layout(unp, shapes, dp, block)
    assert pad.is_uniform and pad.physical_size == pad.size and pad.size % dp == 0
    chunk = math.lcm(*(block * math.prod(s[1:]) for s in shapes))
    assert pad.size % (chunk * dp) == 0
    assert unp.padding_overhead <= pad.padding_overhead + 1e-12
    assert unp.physical_size <= pad.physical_size


def allowed_cuts(lay, shapes, block):
    """Every position a segment bound may take (from the layout's offsets alone): the ends of the
    tensors, their block boundaries, and block_size multiples in the gaps between them."""
    cuts = {0, lay.size}
    starts = sorted((off, off + math.prod(s), block * math.prod(s[1:])) for s, off in zip(shapes, lay.tensor_to_offset))
    at = 0
    for off, end, grain in starts:
        cuts.update({at, off, *range(-(-at // block) * block, off, block)})  # gap: block multiples
        cuts.update(range(off, end + 1, grain))
        at = end
    return sorted(cuts)


@given(layouts_args())
def test_unpadded_segments_are_as_short_as_cuts_allow(args):
    """No choice of cuts gives a shorter longest segment than UNPADDED's (brute force, small)."""
    shapes, dp, block = args
    lay = GlobalLayout.build(shapes, dp, block_size=block, shard_layout=UNPADDED)
    cuts = allowed_cuts(lay, shapes, block)

    def feasible(cap):  # greedy farthest cut within cap
        pos, used = 0, 0
        while pos < lay.size:
            nxt = max(c for c in cuts if c <= pos + cap)
            if nxt == pos:
                return False
            pos, used = nxt, used + 1
        return used <= dp

    assert feasible(lay.segment_capacity)
    assert lay.segment_capacity == 0 or not feasible(lay.segment_capacity - 1)


@given(layouts_args())
def test_unpadded_bounds_are_as_even_as_cuts_allow(args):
    """Balance, not only the longest segment: no single bound can be moved to an allowed cut
    nearer its even share ``k * size / dp`` without making a segment longer than the longest.
    (A greedy cut -- every segment as long as allowed, the last ones short or empty -- fails.)"""
    shapes, dp, block = args
    lay = GlobalLayout.build(shapes, dp, block_size=block, shard_layout=UNPADDED)
    cuts, b, cap = allowed_cuts(lay, shapes, block), lay.rank_segment_offsets, lay.segment_capacity
    for k in range(1, dp):
        ideal = Fraction(k * lay.size, dp)
        for c in cuts:
            if b[k - 1] <= c <= b[k + 1] and abs(c - ideal) < abs(b[k] - ideal):
                assert max(c - b[k - 1], b[k + 1] - c) > cap, (
                    f"bound {k} at {b[k]} could move to {c}, nearer {float(ideal)}, keeping every "
                    f"segment <= {cap}: bounds {b}"
                )


def test_unpadded_even_bounds_worked_example():
    # 40 rows of 1 element, block 1, on 8 ranks: every position is a cut, 5 rows each.
    lay = GlobalLayout.build([(16,), (24,)], 8, shard_layout=UNPADDED)
    assert lay.rank_segment_offsets == tuple(range(0, 41, 5))
    # (4,8) at [0, 32) and (2,4) at [32, 40), block 2: cuts {0, 16, 32, 40}, a longest segment
    # of 16. The even shares 10, 20, 30 take the nearest cuts that keep it: 16, 16 (nearer 20
    # than 32), 32. A greedy cut (0, 16, 32, 40, 40) would put its last bound 10 away from 30.
    lay = GlobalLayout.build([(4, 8), (2, 4)], 4, block_size=2, shard_layout=UNPADDED)
    assert lay.rank_segment_offsets == (0, 16, 16, 32, 40)


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        ([(4, 4), ()], {}, r"tensor_shapes\[1\]=\(\) is 0-D"),
        ([(48, 32)], dict(block_size=32), r"dim 0 \(48\) must be divisible by block_size=32"),
        ([(4, 0)], {}, r"dimension < 1"),
        ([(4,)], dict(block_size=0), r"block_size=0 must be a positive int"),
    ],
)
def test_build_rejects_bad_shapes(shapes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        GlobalLayout.build(shapes, 2, **kwargs)


def test_build_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"dp_size=0 must be a positive int"):
        GlobalLayout.build([(4,)], 0)
    # NumPy integers are integers; floats (even integral ones) and bools are not
    lay = GlobalLayout.build([(64, 4)], np.int64(2), block_size=np.int32(32))
    assert (lay.dp_size, lay.block_size) == (2, 32) and type(lay.block_size) is int
    for bad in (32.5, 32.0, True):
        with pytest.raises(ValueError, match="block_size=.* must be a positive int"):
            GlobalLayout.build([(64, 4)], 2, block_size=bad)
        with pytest.raises(ValueError, match="dp_size=.* must be a positive int"):
            GlobalLayout.build([(64, 4)], bad)
    # the same rule for the dimensions of tensor_shapes (64.5 was truncated to 64)
    assert GlobalLayout.build([(np.int64(64), np.int32(4))], 2).tensor_shapes == ((64, 4),)
    for bad in ((64.5, 4), (64.0, 4), (True, 4)):
        with pytest.raises(TypeError, match=r"tensor_shapes\[0\]=.* must be a tuple of ints"):
            GlobalLayout.build([bad], 2)
    with pytest.raises(TypeError, match=r"shard_layout='padded' must be a ShardLayout"):
        GlobalLayout.build([(4,)], 2, shard_layout="padded")
    with pytest.raises(TypeError, match=r"tensor_shapes\[0\]=4 must be a tuple of ints"):
        GlobalLayout.build([4], 2)
    with pytest.raises(ValueError, match=r"segment index k=2 must be in \[0, 2\)"):
        GlobalLayout.build([(4,)], 2).pieces(2)


@pytest.mark.parametrize(
    "fields, match",
    [
        ((((8,), (4,)), (0, 4), 12, (0, 6, 12)), r"tensors 0 and 1 overlap"),
        ((((2, 4),), (2,), 12, (0, 6, 12)), r"offset 2 must be a multiple of block_size \* row_size = 4"),
        ((((2, 4),), (8,), 12, (0, 6, 12)), r"lies outside \[0, size=12\)"),
        ((((2, 4),), (0,), 12, (0, 6, 12)), r"bound 6 cuts tensor 0 \(2, 4\) inside a block"),
        ((((2, 4),), (0,), 12, (0, 8, 4)), r"must be non-decreasing from 0 to size=12"),
        ((((2, 4),), (0,), 12, (0, 4, 12)), r"PADDED layout needs equal segments"),
    ],
)
def test_constructor_validates(fields, match):
    with pytest.raises(ValueError, match=match):
        GlobalLayout(*fields)


def test_constructor_accepts_unequal_unpadded():
    lay = GlobalLayout(((2, 4),), (0,), 12, (0, 4, 12), shard_layout=UNPADDED)
    assert lay.segment_capacity == 8 and lay.physical_size == 16
