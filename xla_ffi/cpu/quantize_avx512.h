// The bf16 fast paths with 512-bit registers (AVX-512 F/BW/VL): one register holds a whole
// 32-element block, the 16-bit arithmetic of vec::cast16 runs on it as is, and vpmovwb packs
// the codes. Used by the band loops of the IsaAvx512 tag (quantize_isa.h) for the two shapes
// that carry almost all the work: a group of eight consecutive rowwise blocks, and 32 columns
// of a 32-row tile.
//
// Each function decides first, from the blocks' statistics, whether every block may take the
// 16-bit cast, and returns false without writing anything when one may not; the caller's general
// path then handles them. The conditions are those of vec::normal_only, on 16-bit lanes:
//   - no Inf or NaN (max |h| < 0x7F80) and no bf16 subnormal (least non-zero |h| >= 0x80);
//   - scale byte sc from max |h| (rceil: sc = E - 8 + (mantissa > 0x60) for E >= 16, which is
//     vec::scales on bf16 bits; smaller non-zero maxima go to the general path);
//   - every non-zero |h| >= (sc - 6) << 7 and sc >= 7 (so k = 127 - sc <= 120).
// An all-zero block is taken too: its scale byte is 0 under both rules, and with k << 7 set to
// 120 << 7 the cast's lower clamp gives code 0 (plus the sign) for every element, the bytes
// e4m3_scaled gives for zeros.
#pragma once

#include <cstdint>

#include "cpu/target.h"
#include "mxfp8/numerics.h"

#if MXFP8_X86_BUILDS

namespace mxfp8::cpu::avx512 {

// Statistics of one register of 32 bf16 values: |h|, and |h| - 1 as uint16 (0xFFFF for a zero,
// so an unsigned minimum is the least non-zero |h| minus one).
struct Stats {
  __m512i abs, nz;
};

MXFP8_TARGET_AVX512 inline Stats stats(__m512i h) {
  const __m512i a = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
  return {a, _mm512_sub_epi16(a, _mm512_set1_epi16(1))};
}

// Unsigned 16-bit maxima (Max) or minima of each of eight registers: word i of the result
// reduces m[i / 2 + 4 * (i % 2)] (callers place their eight blocks accordingly, see slot()).
// 256-bit halves, then 128-bit quarters, then 64-bit pieces are folded together, and the four
// words of each 64-bit piece last.
constexpr int slot(int block) { return block / 2 + 4 * (block % 2); }

template <bool Max>
MXFP8_TARGET_AVX512 inline __m512i fold(__m512i a, __m512i b) {
  return Max ? _mm512_max_epu16(a, b) : _mm512_min_epu16(a, b);
}

template <bool Max>
MXFP8_TARGET_AVX512 inline __m128i reduce8(const __m512i m[8]) {
  __m512i r[4], t[2];
  for (int p = 0; p < 4; ++p)  // 128-bit lanes 0,1: m[2p]; 2,3: m[2p+1]
    r[p] = fold<Max>(_mm512_shuffle_i64x2(m[2 * p], m[2 * p + 1], 0x44),
                     _mm512_shuffle_i64x2(m[2 * p], m[2 * p + 1], 0xEE));
  for (int p = 0; p < 2; ++p)  // 128-bit lane j: m[4p + j]
    t[p] = fold<Max>(_mm512_shuffle_i64x2(r[2 * p], r[2 * p + 1], 0x88),
                     _mm512_shuffle_i64x2(r[2 * p], r[2 * p + 1], 0xDD));
  // 64-bit piece 2j + h: m[j + 4h]
  __m512i u = fold<Max>(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
  u = fold<Max>(u, _mm512_srli_epi64(u, 32));
  u = fold<Max>(u, _mm512_srli_epi64(u, 16));
  return _mm512_cvtepi64_epi16(u);  // the low word of each 64-bit piece
}

// Scale bytes sc and k << 7 (k = 127 - sc) of 32 blocks, one per 16-bit lane, from their max
// |h| and least non-zero |h| - 1; false when a block needs the general path. Callers with fewer
// blocks fill the other lanes as zero blocks, which always pass.
MXFP8_TARGET_AVX512 inline bool scales32(__m512i amax, __m512i least_nz_m1, ScaleRule rule,
                                         __m512i* sc, __m512i* kk) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i e = _mm512_srli_epi16(amax, 7);
  __mmask32 bad = _mm512_cmpge_epu16_mask(amax, _mm512_set1_epi16(0x7F80)) |  // Inf / NaN
                  _mm512_cmplt_epu16_mask(least_nz_m1, _mm512_set1_epi16(0x7F));  // subnormal
  const __mmask32 is_zero = _mm512_cmpeq_epi16_mask(amax, zero);
  __m512i s = _mm512_sub_epi16(e, _mm512_set1_epi16(8));
  if (rule == ScaleRule::kFloor) {
    s = _mm512_max_epi16(s, zero);
  } else {
    const __mmask32 up = _mm512_cmpgt_epu16_mask(_mm512_and_si512(amax, _mm512_set1_epi16(0x7F)),
                                                 _mm512_set1_epi16(0x60));
    s = _mm512_mask_add_epi16(s, up, s, _mm512_set1_epi16(1));
    bad |= _mm512_cmplt_epu16_mask(e, _mm512_set1_epi16(16)) & ~is_zero;
    s = _mm512_maskz_mov_epi16(~is_zero, s);
  }
  // Non-zero blocks: sc >= 7 and least non-zero |h| >= (sc - 6) << 7.
  const __m512i thr = _mm512_sub_epi16(
      _mm512_slli_epi16(_mm512_sub_epi16(s, _mm512_set1_epi16(6)), 7), _mm512_set1_epi16(1));
  bad |= ~is_zero & (_mm512_cmplt_epi16_mask(s, _mm512_set1_epi16(7)) |
                     _mm512_cmplt_epu16_mask(least_nz_m1, thr));
  if (bad) return false;
  *sc = s;
  // k << 7 = (127 - sc) << 7; zero blocks take 120 << 7
  *kk = _mm512_mask_blend_epi16(is_zero,
                                _mm512_slli_epi16(_mm512_sub_epi16(_mm512_set1_epi16(127), s), 7),
                                _mm512_set1_epi16(120 << 7));
  return true;
}

// vec::cast16 on 32 lanes: the codes in the low bytes of the 16-bit lanes.
MXFP8_TARGET_AVX512 inline __m512i cast32(__m512i h, __m512i a, __m512i kk) {
  __m512i yb = _mm512_add_epi16(a, kk);
  yb = _mm512_min_epi16(_mm512_max_epi16(yb, _mm512_set1_epi16(120 << 7)),
                        _mm512_set1_epi16(0x43E0));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(yb, 4), _mm512_set1_epi16(1));
  const __m512i cn = _mm512_srli_epi16(
      _mm512_add_epi16(
          _mm512_add_epi16(yb, _mm512_set1_epi16(static_cast<int16_t>(7 - (120 << 7)))), odd),
      4);
  // cn | (h >> 8 & 0x80): ternary-logic table A | (B & C)
  return _mm512_ternarylogic_epi32(cn, _mm512_srli_epi16(h, 8), _mm512_set1_epi16(0x80), 0xF8);
}

// 32 codes -> 32 bytes at q. The narrowing stays in a register: compilers like to fold it into
// the store (vpmovwb to memory), which is many times slower on some cores (AMD Zen 4/5).
MXFP8_TARGET_AVX512 inline void store32(__m512i code, uint8_t* q) {
  __m256i b = _mm512_cvtepi16_epi8(code);
  __asm__("" : "+v"(b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
}

// Two sets of 32 codes -> 64 consecutive bytes at q (c0's first): one pack, one permute.
MXFP8_TARGET_AVX512 inline void store64(__m512i c0, __m512i c1, uint8_t* q) {
  // packus interleaves 8-byte pieces of c0 and c1 per 128-bit lane: c0.0 c1.0 c0.1 c1.1 ...
  const __m512i packed = _mm512_packus_epi16(c0, c1);  // codes are 0..255: no saturation
  _mm512_storeu_si512(q,
                      _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed));
}

// Eight consecutive rowwise bf16 blocks at x: codes q [256], scales s [8].
MXFP8_TARGET_AVX512 inline bool bf16_row_group8(const uint16_t* x, uint8_t* q, uint8_t* s,
                                                ScaleRule rule) {
  __m512i h[8], a[8], mx[8], nz[8];
  for (int b = 0; b < 8; ++b) {
    h[b] = _mm512_loadu_si512(x + b * kBlock);
    const Stats st = stats(h[b]);
    a[b] = st.abs;
    mx[slot(b)] = st.abs;
    nz[slot(b)] = st.nz;
  }
  const __m512i amax = _mm512_castsi128_si512(reduce8<true>(mx));
  const __m512i lnz = _mm512_mask_mov_epi16(_mm512_set1_epi16(-1), 0xFF,
                                            _mm512_castsi128_si512(reduce8<false>(nz)));
  __m512i sc, kk;
  if (!scales32(_mm512_maskz_mov_epi16(0xFF, amax), lnz, rule, &sc, &kk)) return false;
  _mm_storel_epi64(reinterpret_cast<__m128i*>(s), _mm_cvtepi16_epi8(_mm512_castsi512_si128(sc)));
  for (int b = 0; b < 8; b += 2) {
    const __m512i k0 = _mm512_permutexvar_epi16(_mm512_set1_epi16(static_cast<int16_t>(b)), kk);
    const __m512i k1 = _mm512_permutexvar_epi16(_mm512_set1_epi16(static_cast<int16_t>(b + 1)), kk);
    store64(cast32(h[b], a[b], k0), cast32(h[b + 1], a[b + 1], k1), q + b * kBlock);
  }
  return true;
}

// Columnwise blocks of 32 columns of a 32-row tile: x rows xs elements apart, codes q (rows qs
// bytes apart), scales s [32].
MXFP8_TARGET_AVX512 inline bool bf16_columns32(const uint16_t* x, int64_t xs, uint8_t* q,
                                               int64_t qs, uint8_t* s, ScaleRule rule) {
  // Two independent chains of statistics (even and odd rows).
  __m512i mx0 = _mm512_setzero_si512(), mx1 = mx0;
  __m512i nz0 = _mm512_set1_epi16(-1), nz1 = nz0;
  for (int r = 0; r < kBlock; r += 2) {
    const Stats s0 = stats(_mm512_loadu_si512(x + r * xs));
    const Stats s1 = stats(_mm512_loadu_si512(x + (r + 1) * xs));
    mx0 = _mm512_max_epu16(mx0, s0.abs), nz0 = _mm512_min_epu16(nz0, s0.nz);
    mx1 = _mm512_max_epu16(mx1, s1.abs), nz1 = _mm512_min_epu16(nz1, s1.nz);
  }
  __m512i sc, kk;
  if (!scales32(_mm512_max_epu16(mx0, mx1), _mm512_min_epu16(nz0, nz1), rule, &sc, &kk))
    return false;
  store32(sc, s);
  for (int r = 0; r < kBlock; ++r) {
    const __m512i h = _mm512_loadu_si512(x + r * xs);
    const __m512i a = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
    store32(cast32(h, a, kk), q + r * qs);
  }
  return true;
}

// fp32 elements (bits) at x as sticky bf16 at h (see quantize_vec.h: (x >> 16) | (x & 0xFFFF !=
// 0)), 32 per step: vpackusdw packs per 128-bit lane (a0-3 b0-3 a4-7 b4-7 ...), and vpermq puts
// the 64-bit pieces back in element order, as in store64. Values are at most 0xFFFF: no
// saturation.
MXFP8_TARGET_AVX512 inline void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
  const __m512i low = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i a = _mm512_loadu_si512(x + i), b = _mm512_loadu_si512(x + i + 16);
    const __m512i ha =
        _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_min_epu32(_mm512_and_si512(a, low), one));
    const __m512i hb =
        _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_min_epu32(_mm512_and_si512(b, low), one));
    _mm512_storeu_si512(h + i, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                                        _mm512_packus_epi32(ha, hb)));
  }
  for (; i < n; ++i) h[i] = static_cast<uint16_t>((x[i] >> 16) | ((x[i] & 0xFFFFu) != 0 ? 1u : 0u));
}

}  // namespace mxfp8::cpu::avx512

#endif
