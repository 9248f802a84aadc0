// The both-plane fast path with 256-bit registers (AVX2), for bf16 input and for fp32 input
// staged as sticky bf16 (quantize_vec.h). It works on 32x32 chunks of a 32-row band tile that
// the band loop (avx2_band, quantize_band_avx2.h) has staged in L1, and computes every rowwise and
// columnwise block of the chunk from two sweeps of it: one for the statistics of the 32 rows and
// the 32 columns, one that casts each row for both planes.
//
// The cast is cut so that both planes share all but two operations per 16 elements. With
// a = |h| (16-bit bits), k = 127 - scale and d = (120 - k) << 7 = (scale - 7) << 7, the E4M3
// normal code of a block that takes the 16-bit cast (vec::cast16) is
//     RNE((a - d) / 16) = (a - d + 7 + bit4(a - d)) >> 4 = (a + bit4(a) - (d - 7)) >> 4,
// since d is a multiple of 128 (bit 4 of a - d is bit 4 of a). So every element gets
// rr = a + bit4(a) once, and each plane a saturating subtract of its block's d - 7 and a shift:
// a non-zero a is at least d + 128 in such a block (the normal_only condition), and a zero
// becomes 0 as long as d - 7 > 0, which scale >= 8 gives. The rceil scale never lets a code
// pass 0x7E (amax * 2^k <= 448); under floor a minimum with 0x7E saturates. The sign byte
// comes from a signed-saturating pack of the raw 16-bit values (negative -> 0x80..0xFF, else
// 0..0x7F) masked with 0x80, shared by the two planes.
//
// Lane order: a row of a chunk is staged as two registers [c0-7 | c16-23] and [c8-15 | c24-31],
// so that vpackuswb / vpacksswb of the pair (which interleave 128-bit lanes) give bytes in
// column order with no permute: codes, sign bytes, column scales and the column "redo" mask.
// The row statistics are visited in an order chosen so that the same packs give the row scales
// and the row mask in row order too.
//
// A block that cannot take this path (an Inf or NaN, a subnormal, an element that lands on an
// E4M3 subnormal, a scale byte below 8, rceil with a biased exponent below 16) is reported in a
// mask and gets garbage bytes here; the band loop redoes it from the source with the general
// code. Conditions per block, on 16-bit lanes:
//   - amax < 0x7F80; the scale byte from amax as in vec::scales (rceil: E - 8 + (mantissa >
//     0x60) for E >= 16) or floor (E - 8);
//   - a zero block takes scale 0 and codes 0 (plus the sign);
//   - otherwise scale >= 8 and the least non-zero |h| >= (scale - 6) << 7.
#pragma once

#include <cstdint>

#include "cpu/target.h"
#include "mxfp8/numerics.h"

#if MXFP8_X86_BUILDS

namespace mxfp8::cpu::avx2 {

MXFP8_TARGET_AVX2 inline __m256i splat16(int v) {
  return _mm256_set1_epi16(static_cast<int16_t>(v));
}

// Signed 16-bit maxima (Max) or minima of each of eight registers: the low word of dword
// slot(j) of the result reduces v[j]. 128-bit halves, then 64-bit and 32-bit pieces are folded,
// and the two words of each dword last (their high words are left unspecified).
constexpr int slot(int j) { return j / 2 + 4 * (j % 2); }

template <bool Max>
MXFP8_TARGET_AVX2 inline __m256i fold(__m256i a, __m256i b) {
  return Max ? _mm256_max_epi16(a, b) : _mm256_min_epi16(a, b);
}

template <bool Max>
MXFP8_TARGET_AVX2 inline __m256i reduce8(const __m256i v[8]) {
  __m256i r[4], t[2];
  for (int p = 0; p < 4; ++p)  // lane 0: v[2p], lane 1: v[2p + 1]
    r[p] = fold<Max>(_mm256_permute2x128_si256(v[2 * p], v[2 * p + 1], 0x20),
                     _mm256_permute2x128_si256(v[2 * p], v[2 * p + 1], 0x31));
  for (int q = 0; q < 2; ++q)  // lane L: qword 0 v[4q + L], qword 1 v[4q + 2 + L]
    t[q] = fold<Max>(_mm256_unpacklo_epi64(r[2 * q], r[2 * q + 1]),
                     _mm256_unpackhi_epi64(r[2 * q], r[2 * q + 1]));
  const __m256 t0 = _mm256_castsi256_ps(t[0]), t1 = _mm256_castsi256_ps(t[1]);
  // lane L: dword i reduces v[2i + L]
  const __m256i u = fold<Max>(_mm256_castps_si256(_mm256_shuffle_ps(t0, t1, 0x88)),
                              _mm256_castps_si256(_mm256_shuffle_ps(t0, t1, 0xDD)));
  return fold<Max>(u, _mm256_srli_epi32(u, 16));
}

// Per block (16-bit lane): the scale byte, d - 7 of the cast, and -1 where the block needs the
// general path. amax = max |h|; mn = least of |h| + 0x7FFF as int16 (0x7FFF for a zero block,
// least non-zero |h| - 0x8001 otherwise).
struct Scales {
  __m256i sc, d7, bad;
};

template <bool Floor>
MXFP8_TARGET_AVX2 inline Scales scales16(__m256i amax, __m256i mn) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i e = _mm256_srli_epi16(amax, 7);
  const __m256i is_zero = _mm256_cmpeq_epi16(amax, zero);
  __m256i bad = _mm256_cmpgt_epi16(amax, splat16(0x7F7F));  // Inf / NaN (amax <= 0x7FFF)
  __m256i s = _mm256_sub_epi16(e, splat16(8));
  if constexpr (Floor) {
    s = _mm256_max_epi16(s, zero);
  } else {
    // a true comparison is -1: subtracting it adds one
    s = _mm256_sub_epi16(s,
                         _mm256_cmpgt_epi16(_mm256_and_si256(amax, splat16(0x7F)), splat16(0x60)));
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi16(splat16(16), e));
  }
  // least non-zero |h| >= (s - 6) << 7, as mn >= ((s - 6) << 7) - 0x8001 (16-bit wrap)
  const __m256i thr =
      _mm256_add_epi16(_mm256_slli_epi16(_mm256_sub_epi16(s, splat16(6)), 7), splat16(0x7FFF));
  bad = _mm256_or_si256(
      bad, _mm256_or_si256(_mm256_cmpgt_epi16(splat16(8), s), _mm256_cmpgt_epi16(thr, mn)));
  Scales r;
  r.bad = _mm256_andnot_si256(is_zero, bad);
  r.sc = _mm256_andnot_si256(is_zero, s);
  // a zero block's rr are all 0: any d - 7 gives code 0
  r.d7 = _mm256_sub_epi16(_mm256_slli_epi16(_mm256_sub_epi16(s, splat16(7)), 7), splat16(7));
  return r;
}

// Row of the chunk whose statistics go to register j of reduction g (see the file comment):
// the packs of the two halves of the result then come out in row order.
constexpr int row_of(int g, int j) { return 16 * (j % 2) + 2 * (j / 2) + (g % 2) + 8 * (g / 2); }

// Codes of one plane for 32 elements: rr in lane order, d7 per lane, sign bytes sg.
template <bool Floor>
MXFP8_TARGET_AVX2 inline __m256i codes32(__m256i rr0, __m256i rr1, __m256i d0, __m256i d1,
                                         __m256i sg) {
  __m256i c0 = _mm256_srli_epi16(_mm256_subs_epu16(rr0, d0), 4);
  __m256i c1 = _mm256_srli_epi16(_mm256_subs_epu16(rr1, d1), 4);
  if constexpr (Floor) {
    c0 = _mm256_min_epu16(c0, splat16(0x7E));
    c1 = _mm256_min_epu16(c1, splat16(0x7E));
  }
  return _mm256_or_si256(_mm256_packus_epi16(c0, c1), sg);
}

// Half `half` (16 lane-ordered elements) of row r of a chunk.
MXFP8_TARGET_AVX2 inline __m256i load_half(const uint16_t* h, int64_t hs, int r, int half) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(h + r * hs + 16 * half));
}

// Blocks the fast path left to the caller: bit r of rows (row r's block), bit c of cols.
struct Redo {
  uint32_t rows = 0, cols = 0;
};

// One 32x32 chunk: h (lane order, rows hs elements apart) -> rowwise codes rq (rows rqs bytes
// apart) and scales rs [32] (one per row, in row order), columnwise codes cq (rows cqs apart)
// and scales cs [32]. Row / Col select the planes.
template <bool Row, bool Col, bool Floor>
MXFP8_TARGET_AVX2 inline Redo chunk32(const uint16_t* h, int64_t hs, uint8_t* rq, int64_t rqs,
                                      uint8_t* rs, uint8_t* cq, int64_t cqs, uint8_t* cs) {
  const __m256i abs = splat16(0x7FFF);
  // Sweep 1: statistics.
  __m256i cmx0 = _mm256_setzero_si256(), cmx1 = cmx0, cmn0 = abs, cmn1 = abs;
  __m256i rmx[4], rmn[4];
  for (int g = 0; g < 4; ++g) {
    __m256i vm[8], vn[8];
    for (int j = 0; j < 8; ++j) {
      const int r = Row ? row_of(g, j) : 8 * g + j;
      const __m256i a0 = _mm256_and_si256(load_half(h, hs, r, 0), abs),
                    a1 = _mm256_and_si256(load_half(h, hs, r, 1), abs);
      const __m256i n0 = _mm256_add_epi16(a0, abs), n1 = _mm256_add_epi16(a1, abs);
      if constexpr (Col) {
        cmx0 = _mm256_max_epi16(cmx0, a0), cmx1 = _mm256_max_epi16(cmx1, a1);
        cmn0 = _mm256_min_epi16(cmn0, n0), cmn1 = _mm256_min_epi16(cmn1, n1);
      }
      if constexpr (Row) vm[j] = _mm256_max_epi16(a0, a1), vn[j] = _mm256_min_epi16(n0, n1);
    }
    if constexpr (Row) rmx[g] = reduce8<true>(vm), rmn[g] = reduce8<false>(vn);
  }
  Redo redo;
  alignas(32) int16_t d7row[32];
  if constexpr (Row) {
    // words 2i, 2i + 1 of the halves: dword i of reductions 2m and 2m + 1
    const Scales s0 =
        scales16<Floor>(_mm256_blend_epi16(rmx[0], _mm256_slli_epi32(rmx[1], 16), 0xAA),
                        _mm256_blend_epi16(rmn[0], _mm256_slli_epi32(rmn[1], 16), 0xAA));
    const Scales s1 =
        scales16<Floor>(_mm256_blend_epi16(rmx[2], _mm256_slli_epi32(rmx[3], 16), 0xAA),
                        _mm256_blend_epi16(rmn[2], _mm256_slli_epi32(rmn[3], 16), 0xAA));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rs), _mm256_packus_epi16(s0.sc, s1.sc));
    redo.rows = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_packs_epi16(s0.bad, s1.bad)));
    // 16-bit words in row order: lane 0 of each half, then lane 1
    _mm256_store_si256(reinterpret_cast<__m256i*>(d7row),
                       _mm256_permute2x128_si256(s0.d7, s1.d7, 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(d7row + 16),
                       _mm256_permute2x128_si256(s0.d7, s1.d7, 0x31));
  }
  __m256i dc0 = _mm256_setzero_si256(), dc1 = dc0;
  if constexpr (Col) {
    const Scales s0 = scales16<Floor>(cmx0, cmn0), s1 = scales16<Floor>(cmx1, cmn1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cs), _mm256_packus_epi16(s0.sc, s1.sc));
    redo.cols = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_packs_epi16(s0.bad, s1.bad)));
    dc0 = s0.d7, dc1 = s1.d7;
  }
  // Sweep 2: both casts of each row.
  const __m256i one = splat16(1), sign = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int r = 0; r < kBlock; ++r) {
    const __m256i h0 = load_half(h, hs, r, 0), h1 = load_half(h, hs, r, 1);
    const __m256i a0 = _mm256_and_si256(h0, abs), a1 = _mm256_and_si256(h1, abs);
    const __m256i rr0 = _mm256_add_epi16(a0, _mm256_and_si256(_mm256_srli_epi16(a0, 4), one));
    const __m256i rr1 = _mm256_add_epi16(a1, _mm256_and_si256(_mm256_srli_epi16(a1, 4), one));
    const __m256i sg = _mm256_and_si256(_mm256_packs_epi16(h0, h1), sign);
    if constexpr (Row) {
      const __m256i dr = _mm256_set1_epi16(d7row[r]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(rq + r * rqs),
                         codes32<Floor>(rr0, rr1, dr, dr, sg));
    }
    if constexpr (Col)
      _mm256_store_si256(reinterpret_cast<__m256i*>(cq + r * cqs),
                         codes32<Floor>(rr0, rr1, dc0, dc1, sg));
  }
  return redo;
}

// Stages one row of n elements (n a multiple of 32) into lane order at t: bf16 as is, fp32 as
// sticky bf16 ((x >> 16) | (x & 0xFFFF != 0), see quantize_vec.h). vpackusdw packs per
// 128-bit lane; its values are at most 0xFFFF, so it never saturates.
MXFP8_TARGET_AVX2 inline void stage_row(const uint16_t* x, int64_t n, uint16_t* t) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16));
    _mm256_store_si256(reinterpret_cast<__m256i*>(t + i), _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(t + i + 16),
                       _mm256_permute2x128_si256(a, b, 0x31));
  }
}

MXFP8_TARGET_AVX2 inline __m256i sticky8(const uint32_t* x) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_or_si256(
      _mm256_srli_epi32(v, 16),
      _mm256_min_epu32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_set1_epi32(1)));
}

MXFP8_TARGET_AVX2 inline void stage_row(const uint32_t* x, int64_t n, uint16_t* t) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m256i s0 = sticky8(x + i), s1 = sticky8(x + i + 8);
    const __m256i s2 = sticky8(x + i + 16), s3 = sticky8(x + i + 24);
    // [c0-3 c16-19 | c4-7 c20-23] packed per lane -> [c0-7 | c16-23]
    _mm256_store_si256(reinterpret_cast<__m256i*>(t + i),
                       _mm256_packus_epi32(_mm256_permute2x128_si256(s0, s2, 0x20),
                                           _mm256_permute2x128_si256(s0, s2, 0x31)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(t + i + 16),
                       _mm256_packus_epi32(_mm256_permute2x128_si256(s1, s3, 0x20),
                                           _mm256_permute2x128_si256(s1, s3, 0x31)));
  }
}

// rows x n bytes from a tile (rows ts bytes apart, 32-byte aligned) to dst (rows ds bytes
// apart); n a multiple of 32. Stream: non-temporal stores (dst rows 32-byte aligned), for
// outputs too large to be read back from cache; the caller fences.
MXFP8_TARGET_AVX2 inline void copy_out(const uint8_t* t, int64_t ts, int rows, int64_t n,
                                       uint8_t* dst, int64_t ds, bool stream) {
  for (int r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; i += 32) {
      __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(t + r * ts + i));
      __asm__("" : "+x"(v));  // not a memcpy call: vector moves (a string copy starts slowly)
      auto* d = reinterpret_cast<__m256i*>(dst + r * ds + i);
      if (stream) _mm256_stream_si256(d, v);
      else _mm256_storeu_si256(d, v);
    }
}

}  // namespace mxfp8::cpu::avx2

#endif
