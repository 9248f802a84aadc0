// CPU MXFP8 quantize loops over row bands, shared by the plain, packed-segment and fused
// RMSNorm kernels. A band is 32 rows: one row of columnwise blocks and 32 rows of rowwise
// blocks, so both planes come out of one read of the band (tile by tile, from a copy in L1).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/quantize_avx2.h"
#include "cpu/quantize_avx512.h"
#include "mxfp8/numerics.h"

// The band loops are force-inlined so that each caller compiles them for its own target (one
// entry point per instruction set: quantize_simd.cc, rmsnorm_quantize.cc).
#define MXFP8_CPU_LOOP inline __attribute__((always_inline))

namespace mxfp8::cpu {

template <InType T>
struct Input;
template <>
struct Input<InType::kF32> {
  using Elem = uint32_t;
  static uint32_t bits(Elem v) { return v; }
};
template <>
struct Input<InType::kBF16> {
  using Elem = uint16_t;
  static uint32_t bits(Elem v) { return bf16_to_f32_bits(v); }
};
template <>
struct Input<InType::kF16> {
  using Elem = uint16_t;
  static uint32_t bits(Elem v) { return f16_to_f32_bits(v); }
};

// Scalar reference loops: used for blocks that hold an fp32 subnormal, an Inf or a NaN, and for
// a columnwise tail narrower than 32 columns.
template <InType T>
MXFP8_CPU_LOOP void quantize_block_scalar(const typename Input<T>::Elem* x, uint8_t* q, uint8_t* s,
                                          ScaleRule rule) {
  uint32_t amax = 0;
  for (int i = 0; i < kBlock; ++i)
    amax = std::max(amax, abs_bits_or_zero_if_nan(Input<T>::bits(x[i])));
  *s = e8m0_scale(amax, rule);
  for (int i = 0; i < kBlock; ++i) q[i] = e4m3_scaled(Input<T>::bits(x[i]), *s);
}

// n columns of 32 rows: x rows xs elements apart, q rows qs bytes apart, s [n].
template <InType T>
MXFP8_CPU_LOOP void quantize_columns_scalar(const typename Input<T>::Elem* x, int64_t xs, int64_t n,
                                            uint8_t* q, int64_t qs, uint8_t* s, ScaleRule rule) {
  for (int64_t c = 0; c < n; ++c) {
    uint32_t amax = 0;
    for (int r = 0; r < kBlock; ++r)
      amax = std::max(amax, abs_bits_or_zero_if_nan(Input<T>::bits(x[r * xs + c])));
    s[c] = e8m0_scale(amax, rule);
    for (int r = 0; r < kBlock; ++r)
      q[r * qs + c] = e4m3_scaled(Input<T>::bits(x[r * xs + c]), s[c]);
  }
}

// The fast path works on 32 consecutive elements at a time held in four 8-lane vectors of fp32
// bits (GCC/Clang vector extensions: one AVX2 register each in the AVX2 build, two SSE registers
// in the baseline). Only integer operations and exactly rounded float operations on normal
// operands, as in e4m3_scaled_normal_input.
namespace vec {
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));

MXFP8_HD i32x8 splat(int32_t v) { return i32x8{} + v; }
MXFP8_HD i32x8 vmax(i32x8 a, i32x8 b) { return a > b ? a : b; }
MXFP8_HD i32x8 vmin(i32x8 a, i32x8 b) { return a < b ? a : b; }
MXFP8_HD int32_t hmax(i32x8 v) {
  v = vmax(v, __builtin_shuffle(v, i32x8{4, 5, 6, 7, 0, 1, 2, 3}));
  v = vmax(v, __builtin_shuffle(v, i32x8{2, 3, 0, 1, 6, 7, 4, 5}));
  v = vmax(v, __builtin_shuffle(v, i32x8{1, 0, 3, 2, 5, 4, 7, 6}));
  return v[0];
}
MXFP8_HD int32_t hmin(i32x8 v) {
  v = vmin(v, __builtin_shuffle(v, i32x8{4, 5, 6, 7, 0, 1, 2, 3}));
  v = vmin(v, __builtin_shuffle(v, i32x8{2, 3, 0, 1, 6, 7, 4, 5}));
  v = vmin(v, __builtin_shuffle(v, i32x8{1, 0, 3, 2, 5, 4, 7, 6}));
  return v[0];
}

// Element order inside the four vectors: for 16-bit inputs one 32-bit load carries elements 2i and
// 2i+1, so v[0] = even elements of the first 16, v[1] = odd ones, v[2], v[3] the same for the
// next 16 (no widening shuffles). For fp32, v[j] lane i is element 8j + i.
template <InType T>
MXFP8_HD void load32(const typename Input<T>::Elem* x, u32x8 v[4]) {
  if constexpr (T == InType::kBF16) {
    u32x8 a, b;
    __builtin_memcpy(&a, x, sizeof a);
    __builtin_memcpy(&b, x + 16, sizeof b);
    v[0] = a << 16;
    v[1] = a & 0xFFFF0000u;
    v[2] = b << 16;
    v[3] = b & 0xFFFF0000u;
  } else if constexpr (T == InType::kF32) {
    __builtin_memcpy(v, x, 4 * sizeof(u32x8));
  } else {
    uint32_t buf[kBlock];
    for (int i = 0; i < kBlock; ++i) buf[i] = Input<T>::bits(x[i]);
    __builtin_memcpy(v, buf, sizeof buf);
  }
}

// Inverse of load32's order: four vectors of codes -> 32 consecutive bytes. Only the low byte of
// each lane is stored, and bits 8..23 must be zero (cast leaves junk in the top byte only).
template <InType T>
MXFP8_HD void store32(const u32x8 c[4], uint8_t* q) {
  if constexpr (T == InType::kBF16) {
    const u32x8 lo = c[0] | (c[1] << 8), hi = c[2] | (c[3] << 8);
    const u16x16 out =
        __builtin_shuffle(reinterpret_cast<const u16x16&>(lo), reinterpret_cast<const u16x16&>(hi),
                          u16x16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30});
    __builtin_memcpy(q, &out, sizeof out);
  } else {
    // c[1..3] lose their top byte in the shifts; c[0] keeps it and is masked.
    const u32x8 w =
        (c[0] & 0xFFu) | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);  // lane i: 8j + i in byte j
    const u8x32 out =
        __builtin_shuffle(reinterpret_cast<const u8x32&>(w),
                          u8x32{0, 4, 8,  12, 16, 20, 24, 28, 1, 5, 9,  13, 17, 21, 25, 29,
                                2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31});
    __builtin_memcpy(q, &out, sizeof out);
  }
}

// Per-lane constants of the cast for k = 127 - scale byte (see cast below).
struct CastK {
  i32x8 kk, thr_r;
  MXFP8_HD CastK(i32x8 kk_, i32x8 thr_r_) : kk(kk_), thr_r(thr_r_) {}
  MXFP8_HD explicit CastK(i32x8 k) {
    const u32x8 ku = reinterpret_cast<const u32x8&>(k);
    kk = reinterpret_cast<i32x8>(ku << 23);
    thr_r = vmax(reinterpret_cast<i32x8>((1u - ku) << 23), splat(1));
  }
};

// e4m3_scaled_normal_input for a block free of fp32 subnormals, Infs and NaNs, whose scale byte
// came from the block's amax (so |x| <= amax). With a = |x| bits, yb = a + (k << 23) is the bits
// of |y| = |x| * 2^k when its biased exponent ey = (a >> 23) + k is >= 1, and as an int32 it never
// wraps (k >= -127, and ey <= 136 because the scale is at least floor(log2(amax)) - 8):
//   ey >= 1 and a != 0  <=>  a >= max((1 - k) << 23, 1)        (thr_r; else the code is 0)
//   ey >= 121 (E4M3 normal)  <=>  yb >= 121 << 23
// The normal code rebiases yb by 120 and keeps 3 mantissa bits (RNE); it is monotone in |y| and
// 0x7E at 448, so saturation is a min with 0x7E. The subnormal code round(|y| * 2^9) is the low
// byte of the bits of |y| * 512 + 2^23 (exact, in [2^23, 2^23 + 8]); the 0x4B of its top byte is
// left for store32 to drop.
MXFP8_HD u32x8 cast(u32x8 x, const CastK& c) {
  const i32x8 a = reinterpret_cast<i32x8>(x & 0x7FFFFFFFu);
  const i32x8 yb = a + c.kk;
  const u32x8 ybu = reinterpret_cast<u32x8>(yb);
  const u32x8 cn = (ybu + (0x7FFFFu - (120u << 23)) + ((ybu >> 20) & 1u)) >> 20;
  const i32x8 cns = vmin(reinterpret_cast<i32x8>(cn), splat(0x7E));
  const f32x8 t = reinterpret_cast<const f32x8&>(yb) * 512.0f + 8388608.0f;
  i32x8 code = yb >= splat(121 << 23) ? cns : reinterpret_cast<const i32x8&>(t);
  code = a >= c.thr_r ? code : i32x8{};
  return reinterpret_cast<u32x8>(code) | ((x >> 24) & 0x80u);
}

// Running block statistics: max |x| bits, and min of (|x| + 0x7FFFFFFF) as int32, which is below
// INT32_MIN + 0x7FFFFF exactly when the block holds a non-zero fp32 subnormal.
MXFP8_HD void accumulate(const u32x8 v, i32x8& mx, i32x8& mn) {
  const u32x8 a = v & 0x7FFFFFFFu;
  mx = vmax(mx, reinterpret_cast<i32x8>(a));
  mn = vmin(mn, reinterpret_cast<i32x8>(a + 0x7FFFFFFFu));
}
constexpr int32_t kSubnormalBelow = INT32_MIN + 0x7FFFFF;

// The same statistics for bf16 on the raw 16-bit values, 16 elements per vector: max of
// |h| = h & 0x7FFF, and min of |h| + 0x7FFF as int16, below INT16_MIN + 0x7F exactly when the
// block holds a non-zero bf16 (so fp32) subnormal. |h| << 16 is the fp32 |x| bits.
MXFP8_HD i16x16 vmax16(i16x16 a, i16x16 b) { return a > b ? a : b; }
MXFP8_HD i16x16 vmin16(i16x16 a, i16x16 b) { return a < b ? a : b; }
MXFP8_HD i16x16 load16(const uint16_t* x) {
  i16x16 v;
  __builtin_memcpy(&v, x, sizeof v);
  return v;
}
MXFP8_HD void accumulate16(const i16x16 h, i16x16& mx, i16x16& mn) {
  const i16x16 a = h & 0x7FFF;
  mx = vmax16(mx, a);
  mn = vmin16(mn, reinterpret_cast<i16x16>(reinterpret_cast<u16x16>(a) + 0x7FFFu));
}
constexpr int16_t kSubnormalBelow16 = INT16_MIN + 0x7F;
MXFP8_HD int16_t hmin16(i16x16 v) {
  v = vmin16(v, __builtin_shuffle(v, i16x16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmin16(v, __builtin_shuffle(v, i16x16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = vmin16(v, __builtin_shuffle(v, i16x16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = vmin16(v, __builtin_shuffle(v, i16x16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}
// Maxima of 16-bit |h| -> fp32 |x| bits in load32's order: lanes of the even elements, then of
// the odd ones.
MXFP8_HD i32x8 even32(i16x16 m) {
  return reinterpret_cast<i32x8>(reinterpret_cast<u32x8>(m) << 16);
}
MXFP8_HD i32x8 odd32(i16x16 m) {
  return reinterpret_cast<i32x8>(reinterpret_cast<u32x8>(m) & 0xFFFF0000u);
}
// The same split for the int16 minima, sign-extended (even, odd).
MXFP8_HD i32x8 even32s(i16x16 m) {
  return reinterpret_cast<i32x8>(reinterpret_cast<u32x8>(m) << 16) >> 16;
}
MXFP8_HD i32x8 odd32s(i16x16 m) { return reinterpret_cast<i32x8>(m) >> 16; }

// bf16 blocks whose non-zero elements all land on E4M3 normals (ey >= 121, checked per block by
// normal_only) are cast on the raw 16-bit values, 16 per vector. In bf16 bits the normal code is
// (yb - (120 << 7)) rounded to nearest even at bit 4, yb = |h| + (k << 7), which equals the fp32
// formula of cast (bits 0..15 of the fp32 value are zero). yb is clamped to [120 << 7, 448]:
// 448 (0x43E0) gives 0x7E and the code is monotone, so the upper clamp is the saturation; the
// lower one sends |h| = 0, where yb = k << 7 <= 120 << 7 (k <= 120 is checked too), to code 0.
// Its constants, built once per call and hidden from the optimiser (Cast16K::make) so that the
// loops read them from memory rather than rebuilding each one with a move and a broadcast.
struct Cast16K {
  i16x16 abs, lo, hi, one, bias, sign;
  MXFP8_HD static Cast16K make() {
    Cast16K c{i16x16{} + 0x7FFF,
              i16x16{} + (120 << 7),
              i16x16{} + 0x43E0,
              i16x16{} + 1,
              i16x16{} + static_cast<int16_t>(7 - (120 << 7)),
              i16x16{} + 0x80};
    __asm__("" : "+m"(c));
    return c;
  }
};
MXFP8_HD i16x16 cast16(i16x16 h, i16x16 kk, const Cast16K& c) {
  i16x16 yb = (h & c.abs) + kk;
  yb = vmin16(vmax16(yb, c.lo), c.hi);
  const u16x16 z = reinterpret_cast<u16x16>(yb);
  const u16x16 cn =
      (z + reinterpret_cast<u16x16>(c.bias) + ((z >> 4) & reinterpret_cast<u16x16>(c.one))) >> 4;
  return reinterpret_cast<i16x16>(
      cn | ((reinterpret_cast<const u16x16&>(h) >> 8) & reinterpret_cast<u16x16>(c.sign)));
}
// Two vectors of 16 codes (0..255) -> 32 consecutive bytes.
MXFP8_HD void store16x2(i16x16 c0, i16x16 c1, uint8_t* q) {
  const u8x32 out =
      __builtin_shuffle(reinterpret_cast<const u8x32&>(c0), reinterpret_cast<const u8x32&>(c1),
                        u8x32{0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                              32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62});
  __builtin_memcpy(q, &out, sizeof out);
}
// Lanes (-1) where a bf16 block with per-lane k = 127 - scale and min statistic mn (32-bit,
// from accumulate16: -32769 + the least non-zero |h|, or 32767 if there is none) may take
// cast16: every non-zero |h| >= (121 - k) << 7, and k <= 120.
MXFP8_HD i32x8 normal_only(i32x8 mn, i32x8 k) {
  return (mn >= ((121 - k) << 7) - 32769) & (k <= 120);
}

// Lane-wise maxima (Max) or minima of eight vectors in one: lane b of the result reduces
// m[s(b)], with s = {0, 4, 2, 6, 1, 5, 3, 7} (its own inverse), so callers put block b's vector
// at m[s(b)].
constexpr int kReduceSlot[8] = {0, 4, 2, 6, 1, 5, 3, 7};
template <bool Max>
MXFP8_HD i32x8 reduce8(const i32x8 m[8]) {
  auto op = [](i32x8 a, i32x8 b) { return Max ? vmax(a, b) : vmin(a, b); };
  i32x8 r[4], t[2];
  for (int p = 0; p < 4; ++p)
    r[p] = op(__builtin_shuffle(m[2 * p], m[2 * p + 1], i32x8{0, 1, 2, 3, 8, 9, 10, 11}),
              __builtin_shuffle(m[2 * p], m[2 * p + 1], i32x8{4, 5, 6, 7, 12, 13, 14, 15}));
  for (int p = 0; p < 2; ++p)
    t[p] = op(__builtin_shuffle(r[2 * p], r[2 * p + 1], i32x8{0, 1, 8, 9, 4, 5, 12, 13}),
              __builtin_shuffle(r[2 * p], r[2 * p + 1], i32x8{2, 3, 10, 11, 6, 7, 14, 15}));
  return op(__builtin_shuffle(t[0], t[1], i32x8{0, 8, 2, 10, 4, 12, 6, 14}),
            __builtin_shuffle(t[0], t[1], i32x8{1, 9, 3, 11, 5, 13, 7, 15}));
}

// The same for eight vectors of sixteen int16 lanes: lane b of the result is the maximum (Max)
// or minimum of the 16 lanes of m[s(b)], sign-extended to 32 bits. The tree halves 128-bit
// lanes, then 64-bit and 32-bit pieces, and leaves the two int16 halves of each 32-bit lane for
// last, which puts block order in the same slots as reduce8.
template <bool Max>
MXFP8_HD i32x8 reduce8x16(const i16x16 m[8]) {
  auto op = [](i16x16 a, i16x16 b) { return Max ? vmax16(a, b) : vmin16(a, b); };
  i16x16 r[4], t[2];
  for (int p = 0; p < 4; ++p)
    r[p] =
        op(__builtin_shuffle(m[2 * p], m[2 * p + 1],
                             i16x16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
           __builtin_shuffle(m[2 * p], m[2 * p + 1],
                             i16x16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}));
  for (int p = 0; p < 2; ++p)
    t[p] =
        op(__builtin_shuffle(r[2 * p], r[2 * p + 1],
                             i16x16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
           __builtin_shuffle(r[2 * p], r[2 * p + 1],
                             i16x16{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}));
  const i16x16 u =
      op(__builtin_shuffle(t[0], t[1],
                           i16x16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
         __builtin_shuffle(t[0], t[1],
                           i16x16{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}));
  const i32x8 w = reinterpret_cast<i32x8>(u);
  return Max ? vmax((w << 16) >> 16, w >> 16) : vmin((w << 16) >> 16, w >> 16);
}

// Scale bytes of eight finite amax values (e8m0_scale_finite lane by lane). rceil: for amax with
// biased exponent E >= 16 the product amax * fp32(1/448) is a normal float whose exponent is
// E - 9 below mantissa 0x600000 and E - 8 from it on (0x600000 lands exactly on a power of two),
// so byte = E - 8 + (mantissa > 0x600000); smaller amax takes the general routine.
MXFP8_HD i32x8 scales(i32x8 amax, ScaleRule rule) {
  const u32x8 m = reinterpret_cast<u32x8>(amax);
  const i32x8 e = reinterpret_cast<i32x8>(m >> 23);
  if (rule == ScaleRule::kFloor) return vmax(e - 8, splat(0));
  i32x8 sc = (e - 8) - ((m & 0x7FFFFFu) > 0x600000u);  // a true comparison is -1
  if (hmin(e) < 16)
    for (int l = 0; l < 8; ++l)
      if (e[l] < 16) sc[l] = e8m0_rceil(m[l]);
  return sc;
}
}  // namespace vec

// e8m0_scale for a finite amax: vec::scales for one value.
MXFP8_HD uint8_t e8m0_scale_finite(uint32_t amax, ScaleRule rule) {
  if (rule == ScaleRule::kFloor) return e8m0_floor(amax);
  const uint32_t e = amax >> 23;
  if (e < 16) return e8m0_rceil(amax);
  return static_cast<uint8_t>(e - 8 + ((amax & 0x7FFFFFu) > 0x600000u ? 1u : 0u));
}

// One rowwise block on its own: the fast path, or the scalar loop when it holds an fp32
// subnormal, an Inf or a NaN.
template <InType T>
MXFP8_CPU_LOOP void quantize_block(const typename Input<T>::Elem* x, uint8_t* q, uint8_t* s,
                                   ScaleRule rule) {
  using namespace vec;
  u32x8 v[4];
  load32<T>(x, v);
  i32x8 mx = splat(0), mn = splat(INT32_MAX);
  for (int j = 0; j < 4; ++j) accumulate(v[j], mx, mn);
  const int32_t amax = hmax(mx);
  if (amax >= 0x7F800000 || hmin(mn) < kSubnormalBelow) {
    quantize_block_scalar<T>(x, q, s, rule);
    return;
  }
  const uint8_t scale = e8m0_scale_finite(static_cast<uint32_t>(amax), rule);
  *s = scale;
  const CastK ck(splat(127 - static_cast<int32_t>(scale)));
  u32x8 c[4];
  for (int j = 0; j < 4; ++j) c[j] = cast(v[j], ck);
  store32<T>(c, q);
}

// fp32 input takes the 16-bit paths too, staged as "sticky bf16": the top 16 bits of each
// element, with bit 0 set when any of the low 16 bits is (h = (x >> 16) | (x & 0xFFFF != 0)).
// Every decision and code of the 16-bit paths is then the fp32 one:
//   - h is monotone in |x| and keeps sign, exponent and the top 7 mantissa bits, so a block's
//     max |h| is h of its max |x|, max |h| >= 0x7F80 exactly for Inf / NaN, and a non-zero |h|
//     below 0x80 exactly for a non-zero fp32 subnormal;
//   - the floor scale reads only the exponent, and the rceil one for biased exponents >= 16
//     only whether the mantissa exceeds 0x600000, which h's top 7 mantissa bits (the sticky bit
//     counting as "more") tell; smaller non-zero maxima are left to the fp32 path (tiny_ok);
//   - normal_only compares |x| with (121 - k) << 23, whose low 16 bits are zero: the same
//     comparison on |h|, as the threshold is even;
//   - cast16 rounds to nearest even at bit 4 of the 16-bit value (bit 20 of the fp32 one); the
//     bits below are the 4 low bits of h and the low 16 of x, and with the latter folded into
//     bit 0 the remainder stays above, at or below half exactly when it was.
// Blocks that fail a check are quantized from the fp32 input itself.
MXFP8_HD uint16_t sticky_bf16(uint32_t x) {
  return static_cast<uint16_t>((x >> 16) | ((x & 0xFFFFu) != 0 ? 1u : 0u));
}
namespace vec {
MXFP8_HD u32x8 sticky_bf16(u32x8 x) {
  const u32x8 lo = x & 0xFFFFu;
  return (x >> 16) | (lo < 1u ? lo : u32x8{} + 1u);  // min(lo, 1)
}
// Lanes (-1) of rceil blocks whose scale the 16-bit paths may compute from sticky bf16 maxima
// (fp32 |x| bits, amax <= 0x7F7FFFFF): zero blocks and biased exponents >= 16 (see scales).
MXFP8_HD i32x8 tiny_ok(i32x8 amax) { return (amax == splat(0)) | ((amax >> 23) >= splat(16)); }
}  // namespace vec

// Stages n fp32 elements (bits) at x as sticky bf16 at h.
MXFP8_CPU_LOOP void stage_f32_generic(const uint32_t* x, int64_t n, uint16_t* h) {
  using namespace vec;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    u32x8 a, b;
    __builtin_memcpy(&a, x + i, sizeof a);
    __builtin_memcpy(&b, x + i + 8, sizeof b);
    const u32x8 ha = sticky_bf16(a), hb = sticky_bf16(b);
    const u16x16 out =
        __builtin_shuffle(reinterpret_cast<const u16x16&>(ha), reinterpret_cast<const u16x16&>(hb),
                          u16x16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30});
    __builtin_memcpy(h + i, &out, sizeof out);
  }
  for (; i < n; ++i) h[i] = sticky_bf16(x[i]);
}

// Instruction sets of the band loops, as template tags: each entry point instantiates the loops
// with the tag of the target it is compiled for. A tag gives the out-of-line per-block function
// (for the rare groups that hold special values and bf16 blocks that cannot take cast16: kept
// out of the group loop so that its constants are not set up for every group; compiled for the
// same instructions as the loop that calls it) and says whether bf16 has the 512-bit paths of
// quantize_avx512.h, and stages fp32 tiles as sticky bf16 (stage_f32). The numerics are the
// same under every tag.
struct IsaBaseline {
  static constexpr bool kWideBf16 = false;
  static constexpr bool kBand = false;
  template <InType T>
  __attribute__((noinline)) static void block(const typename Input<T>::Elem* x, uint8_t* q,
                                              uint8_t* s, ScaleRule rule) {
    quantize_block<T>(x, q, s, rule);
  }
  MXFP8_CPU_LOOP static void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
    stage_f32_generic(x, n, h);
  }
};

#if MXFP8_X86_BUILDS
struct IsaAvx2 {
  static constexpr bool kWideBf16 = false;
  // bf16 and fp32 bands with columnwise output go through avx2_band (below; its 32x32 chunks
  // are in quantize_avx2.h)
  static constexpr bool kBand = true;
  template <InType Src>
  static void band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q, uint8_t* row_s,
                   uint8_t* col_q, uint8_t* col_s, ScaleRule rule, bool stream);
  template <InType T>
  __attribute__((noinline, target("avx2"))) static void block(const typename Input<T>::Elem* x,
                                                              uint8_t* q, uint8_t* s,
                                                              ScaleRule rule) {
    quantize_block<T>(x, q, s, rule);
  }
  // vpackusdw packs per 128-bit lane (a0-3 b0-3 a4-7 b4-7); vpermq puts the 64-bit pieces back
  // in element order. Values are at most 0xFFFF: no saturation. (Not force-inlined: a target
  // function cannot be forced into the loops before they are inlined into theirs.)
  __attribute__((target("avx2"))) static void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
    const __m256i low = _mm256_set1_epi32(0xFFFF), one = _mm256_set1_epi32(1);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8));
      const __m256i ha = _mm256_or_si256(_mm256_srli_epi32(a, 16),
                                         _mm256_min_epu32(_mm256_and_si256(a, low), one));
      const __m256i hb = _mm256_or_si256(_mm256_srli_epi32(b, 16),
                                         _mm256_min_epu32(_mm256_and_si256(b, low), one));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i),
                          _mm256_permute4x64_epi64(_mm256_packus_epi32(ha, hb), 0xD8));
    }
    for (; i < n; ++i) h[i] = sticky_bf16(x[i]);
  }
};

struct IsaAvx512 {
  static constexpr bool kWideBf16 = true;
  // The both-plane band kernel has no 512-bit form yet: AVX-512 CPUs run the AVX2 one, which
  // reads and writes memory the way that measured fastest (the 512-bit paths below serve the
  // rowwise-only loops and the fused RMSNorm kernel's columnwise bands).
  static constexpr bool kBand = true;
  template <InType Src>
  static void band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q, uint8_t* row_s,
                   uint8_t* col_q, uint8_t* col_s, ScaleRule rule, bool stream) {
    IsaAvx2::band<Src>(x, K, row_q, row_s, col_q, col_s, rule, stream);
  }
  template <InType T>
  __attribute__((noinline)) MXFP8_TARGET_AVX512 static void block(const typename Input<T>::Elem* x,
                                                                  uint8_t* q, uint8_t* s,
                                                                  ScaleRule rule) {
    quantize_block<T>(x, q, s, rule);
  }
  MXFP8_TARGET_AVX512 static bool bf16_row_group8(const uint16_t* x, uint8_t* q, uint8_t* s,
                                                  ScaleRule rule) {
    return avx512::bf16_row_group8(x, q, s, rule);
  }
  MXFP8_TARGET_AVX512 static bool bf16_columns32(const uint16_t* x, int64_t xs, uint8_t* q,
                                                 int64_t qs, uint8_t* s, ScaleRule rule) {
    return avx512::bf16_columns32(x, xs, q, qs, s, rule);
  }
  MXFP8_TARGET_AVX512 static void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
    avx512::stage_f32(x, n, h);
  }
};
#endif

// The elements a band loop's fallbacks read: the input itself (Src == T), or the fp32 input that
// a 16-bit tile was staged from (T == kBF16, Src == kF32: sticky bf16, stage_f32).
template <InType T, InType Src>
constexpr bool kStagedF32 = T == InType::kBF16 && Src == InType::kF32;

// Up to eight consecutive rowwise blocks (n of them) of one row. Their maxima are reduced
// together (one lane per block), the scales computed lane-wise, and the blocks cast in a second
// sweep that rereads them from L1. A group holding an fp32 subnormal, an Inf or a NaN goes
// block by block. With Src = kF32, x is staged sticky bf16 and src the same elements in fp32:
// blocks the 16-bit cast cannot take are quantized from src.
template <InType T, class Isa, InType Src = T>
MXFP8_CPU_LOOP void quantize_row_group(const typename Input<T>::Elem* x, int n, uint8_t* q,
                                       uint8_t* s, ScaleRule rule, const vec::Cast16K& c16,
                                       const typename Input<Src>::Elem* src = nullptr) {
  static_assert(Src == T || kStagedF32<T, Src>);
  using namespace vec;
  if constexpr (T == InType::kBF16 && Isa::kWideBf16)
    if (n == 8 && Isa::bf16_row_group8(x, q, s, rule)) return;
  i32x8 m[8], mnb;  // mnb: per-block minimum statistic (bf16 only)
  bool subnormal;
  i32x8 amax;
  if constexpr (T == InType::kBF16) {
    i16x16 mx16[8], mn16[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      i16x16 mx = i16x16{}, mn = i16x16{} + INT16_MAX;
      if (b < n) {
        accumulate16(load16(x + b * kBlock), mx, mn);
        accumulate16(load16(x + b * kBlock + 16), mx, mn);
      }
      mx16[kReduceSlot[b]] = mx;
      mn16[kReduceSlot[b]] = mn;
    }
    // |h| << 16 is the fp32 |x| bits (|h| <= 0x7FFF, so the sign extension leaves it alone)
    amax = reduce8x16<true>(mx16) << 16;
    mnb = reduce8x16<false>(mn16);
    subnormal = hmin(mnb) < kSubnormalBelow16;
  } else {
    i32x8 mn = splat(INT32_MAX);
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      i32x8 mx = splat(0);
      if (b < n) {
        u32x8 v[4];
        load32<T>(x + b * kBlock, v);
        for (int j = 0; j < 4; ++j) accumulate(v[j], mx, mn);
      }
      m[kReduceSlot[b]] = mx;
    }
    subnormal = hmin(mn) < kSubnormalBelow;
    amax = reduce8<true>(m);
  }
  if (hmax(amax) >= 0x7F800000 || subnormal) {
    for (int b = 0; b < n; ++b) {
      if constexpr (Src == T) Isa::template block<T>(x + b * kBlock, q + b * kBlock, s + b, rule);
      else Isa::template block<Src>(src + b * kBlock, q + b * kBlock, s + b, rule);
    }
    return;
  }
  const i32x8 sc = scales(amax, rule);
  if constexpr (T == InType::kBF16) {
    const i32x8 kv = 127 - sc;
    i32x8 f = normal_only(mnb, kv);
    if constexpr (Src != T)
      if (rule == ScaleRule::kRceil) f &= tiny_ok(amax);
    if (n == 8 && hmax(f) < 0) {  // every lane -1
      // The common case: eight blocks, all taking cast16. The scales go out as one 8-byte
      // store, and each block's k << 7 (|k| <= 127, so the low 16 bits of its int32 lane) is
      // broadcast from that lane.
      const u8x32 sb =
          __builtin_shuffle(reinterpret_cast<const u8x32&>(sc), u8x32{0, 4, 8, 12, 16, 20, 24, 28});
      __builtin_memcpy(s, &sb, 8);
      const i16x16 k2 = reinterpret_cast<i16x16>(kv << 7);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const i16x16 kk16 = __builtin_shuffle(k2, i16x16{} + static_cast<int16_t>(2 * b));
        store16x2(cast16(load16(x + b * kBlock), kk16, c16),
                  cast16(load16(x + b * kBlock + 16), kk16, c16), q + b * kBlock);
      }
      return;
    }
    int32_t k[8], fast[8];
    __builtin_memcpy(k, &kv, sizeof k);
    __builtin_memcpy(fast, &f, sizeof fast);
    for (int b = 0; b < n; ++b) {
      if (!fast[b]) {
        if constexpr (Src == T) Isa::template block<T>(x + b * kBlock, q + b * kBlock, s + b, rule);
        else Isa::template block<Src>(src + b * kBlock, q + b * kBlock, s + b, rule);
        continue;
      }
      s[b] = static_cast<uint8_t>(sc[b]);
      const i16x16 kk16 = i16x16{} + static_cast<int16_t>(k[b] << 7);
      store16x2(cast16(load16(x + b * kBlock), kk16, c16),
                cast16(load16(x + b * kBlock + 16), kk16, c16), q + b * kBlock);
    }
  } else {
    const CastK ck(127 - sc);
    int32_t kk[8], thr_r[8];
    __builtin_memcpy(kk, &ck.kk, sizeof kk);
    __builtin_memcpy(thr_r, &ck.thr_r, sizeof thr_r);
    for (int b = 0; b < n; ++b) {
      s[b] = static_cast<uint8_t>(sc[b]);
      const CastK cb(splat(kk[b]), splat(thr_r[b]));
      u32x8 v[4], c[4];
      load32<T>(x + b * kBlock, v);
      for (int j = 0; j < 4; ++j) c[j] = cast(v[j], cb);
      store32<T>(c, q + b * kBlock);
    }
  }
}

// Rowwise blocks of `rows` rows of length K: q [rows, K], s [rows, K/32]. fp32 rows are staged
// as sticky bf16 eight blocks at a time.
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_rowwise(const typename Input<T>::Elem* x, int64_t rows, int64_t K,
                                     uint8_t* q, uint8_t* s, ScaleRule rule) {
  const int64_t nb = K / kBlock;
  const vec::Cast16K c16 = vec::Cast16K::make();
  alignas(64) uint16_t h[8 * kBlock];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; b += 8) {
      const int n = nb - b < 8 ? static_cast<int>(nb - b) : 8;
      const auto* xg = x + r * K + b * kBlock;
      uint8_t* qg = q + r * K + b * kBlock;
      if constexpr (T == InType::kF32) {
        Isa::stage_f32(xg, n * kBlock, h);
        quantize_row_group<InType::kBF16, Isa, InType::kF32>(h, n, qg, s + r * nb + b, rule, c16,
                                                             xg);
      } else {
        quantize_row_group<T, Isa>(xg, n, qg, s + r * nb + b, rule, c16);
      }
    }
}

// The codes of 32 columns of a 32-row bf16 tile (x rows xs elements apart, q rows qs bytes
// apart) through cast16, with the columns' scale bytes sc in load32's lane order. A template on
// Isa like every loop here, so that each ISA's build keeps its own copy.
template <class Isa>
MXFP8_CPU_LOOP void cast_columns32(const uint16_t* x, int64_t xs, const vec::u32x8 sc[4],
                                   uint8_t* q, int64_t qs, const vec::Cast16K& c16) {
  using namespace vec;
  // k << 7 per column, back in column order: even columns in the low halves.
  i16x16 kk16[2];
  for (int h = 0; h < 2; ++h)
    kk16[h] = reinterpret_cast<i16x16>((((127u - sc[2 * h]) << 7) & 0xFFFFu) |
                                       ((127u - sc[2 * h + 1]) << 23));
  for (int r = 0; r < kBlock; ++r)
    store16x2(cast16(load16(x + r * xs), kk16[0], c16),
              cast16(load16(x + r * xs + 16), kk16[1], c16), q + r * qs);
}

// 32 columns of a 32-row tile in the general way: x rows xs elements apart, q rows qs bytes
// apart, s [32]. Each lane of the four vectors is one column.
template <InType T, class Isa>
MXFP8_CPU_LOOP void columns32_general(const typename Input<T>::Elem* x, int64_t xs, uint8_t* q,
                                      int64_t qs, uint8_t* s, ScaleRule rule,
                                      const vec::Cast16K& c16) {
  using namespace vec;
  i32x8 mx[4], mn[4];
  bool subnormal;
  if constexpr (T == InType::kBF16) {
    i16x16 mx16[2] = {}, mn16[2] = {i16x16{} + INT16_MAX, i16x16{} + INT16_MAX};
    for (int r = 0; r < kBlock; ++r)
      for (int h = 0; h < 2; ++h) accumulate16(load16(x + r * xs + 16 * h), mx16[h], mn16[h]);
    for (int h = 0; h < 2; ++h) {
      mx[2 * h] = even32(mx16[h]), mx[2 * h + 1] = odd32(mx16[h]);
      mn[2 * h] = even32s(mn16[h]), mn[2 * h + 1] = odd32s(mn16[h]);
    }
    subnormal = hmin16(vmin16(mn16[0], mn16[1])) < kSubnormalBelow16;
  } else {
    for (int j = 0; j < 4; ++j) mx[j] = splat(0), mn[j] = splat(INT32_MAX);
    for (int r = 0; r < kBlock; ++r) {
      u32x8 v[4];
      load32<T>(x + r * xs, v);
      for (int j = 0; j < 4; ++j) accumulate(v[j], mx[j], mn[j]);
    }
    subnormal = hmin(vmin(vmin(mn[0], mn[1]), vmin(mn[2], mn[3]))) < kSubnormalBelow;
  }
  const i32x8 mxa = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
  if (hmax(mxa) >= 0x7F800000 || subnormal) {
    quantize_columns_scalar<T>(x, xs, kBlock, q, qs, s, rule);
    return;
  }
  u32x8 sc[4];
  for (int j = 0; j < 4; ++j) sc[j] = reinterpret_cast<u32x8>(scales(mx[j], rule));
  store32<T>(sc, s);
  if constexpr (T == InType::kBF16) {
    i32x8 ok = normal_only(mn[0], 127 - reinterpret_cast<i32x8>(sc[0]));
    for (int j = 1; j < 4; ++j) ok &= normal_only(mn[j], 127 - reinterpret_cast<i32x8>(sc[j]));
    if (hmax(ok) < 0) {  // every lane -1
      cast_columns32<Isa>(x, xs, sc, q, qs, c16);
      return;
    }
  }
  const CastK ck[4] = {
      CastK(127 - reinterpret_cast<i32x8>(sc[0])), CastK(127 - reinterpret_cast<i32x8>(sc[1])),
      CastK(127 - reinterpret_cast<i32x8>(sc[2])), CastK(127 - reinterpret_cast<i32x8>(sc[3]))};
  for (int r = 0; r < kBlock; ++r) {
    u32x8 v[4], c[4];
    load32<T>(x + r * xs, v);
    for (int j = 0; j < 4; ++j) c[j] = cast(v[j], ck[j]);
    store32<T>(c, q + r * qs);
  }
}

// Columns that the 16-bit cast cannot take, out of 32, up to which columns32_16bit still casts
// all 32 and then redoes those with the scalar loop (cheaper than the general path for a few).
constexpr int kMaxFixupColumns = 4;

// 32 columns of a 16-bit tile (bf16, or fp32 staged as sticky bf16 with src / ss the fp32
// elements) through cast16; false, with nothing written, when the tile holds a special value or
// a subnormal, or more than kMaxFixupColumns columns need the general path.
template <class Isa, InType Src>
MXFP8_CPU_LOOP bool columns32_16bit(const uint16_t* x, int64_t xs, uint8_t* q, int64_t qs,
                                    uint8_t* s, ScaleRule rule, const vec::Cast16K& c16,
                                    const typename Input<Src>::Elem* src, int64_t ss) {
  using namespace vec;
  i16x16 mx16[2] = {}, mn16[2] = {i16x16{} + INT16_MAX, i16x16{} + INT16_MAX};
  for (int r = 0; r < kBlock; ++r)
    for (int h = 0; h < 2; ++h) accumulate16(load16(x + r * xs + 16 * h), mx16[h], mn16[h]);
  i32x8 mx[4], mn[4];
  for (int h = 0; h < 2; ++h) {
    mx[2 * h] = even32(mx16[h]), mx[2 * h + 1] = odd32(mx16[h]);
    mn[2 * h] = even32s(mn16[h]), mn[2 * h + 1] = odd32s(mn16[h]);
  }
  const bool subnormal = hmin16(vmin16(mn16[0], mn16[1])) < kSubnormalBelow16;
  if (hmax(vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]))) >= 0x7F800000 || subnormal) return false;
  // Lane j of vector v: column (v / 2) * 16 + 2 * j + v % 2 (load32's order for 16-bit input).
  u32x8 sc[4];
  i32x8 ok[4];
  for (int j = 0; j < 4; ++j) {
    const i32x8 sj = scales(mx[j], rule);
    ok[j] = normal_only(mn[j], 127 - sj);
    if constexpr (Src == InType::kF32)
      if (rule == ScaleRule::kRceil) ok[j] &= tiny_ok(mx[j]);
    // columns redone below take k = 0 here, so that the cast's arithmetic stays in range
    sc[j] = reinterpret_cast<u32x8>((sj & ok[j]) | (splat(127) & ~ok[j]));
  }
  alignas(32) uint8_t redo[kBlock];
  int nredo = 0;
  if (hmax(ok[0] & ok[1] & ok[2] & ok[3]) >= 0) {  // some lane is 0
    u32x8 flag[4];
    for (int j = 0; j < 4; ++j) flag[j] = reinterpret_cast<u32x8>(ok[j] + 1);  // 1: redo
    store32<InType::kBF16>(flag, redo);
    for (int c = 0; c < kBlock; ++c) nredo += redo[c];
    if (nredo > kMaxFixupColumns) return false;
  }
  store32<InType::kBF16>(sc, s);
  cast_columns32<Isa>(x, xs, sc, q, qs, c16);
  if (nredo)
    for (int c = 0; c < kBlock; ++c)
      if (redo[c]) quantize_columns_scalar<Src>(src + c, ss, 1, q + c, qs, s + c, rule);
  return true;
}

// Columnwise blocks of a 32-row tile of n columns: x rows xs elements apart, q rows qs bytes
// apart, s [n] (a piece of one row of the [M/32, K] scale plane). Columns go 32 at a time. With
// Src = kF32, x is staged sticky bf16 and src (rows ss elements apart) the fp32 elements, which
// the general and scalar paths read.
template <InType T, class Isa, InType Src = T>
MXFP8_CPU_LOOP void quantize_columnwise_tile(const typename Input<T>::Elem* x, int64_t xs,
                                             int64_t n, uint8_t* q, int64_t qs, uint8_t* s,
                                             ScaleRule rule,
                                             const typename Input<Src>::Elem* src = nullptr,
                                             int64_t ss = 0) {
  static_assert(Src == T || kStagedF32<T, Src>);
  if constexpr (Src == T) src = x, ss = xs;
  const vec::Cast16K c16 = vec::Cast16K::make();
  int64_t c0 = 0;
  for (; c0 + kBlock <= n; c0 += kBlock) {
    if constexpr (T == InType::kBF16) {
      if constexpr (Isa::kWideBf16)
        if (Isa::bf16_columns32(x + c0, xs, q + c0, qs, s + c0, rule)) continue;
      if (columns32_16bit<Isa, Src>(x + c0, xs, q + c0, qs, s + c0, rule, c16, src + c0, ss))
        continue;
    }
    columns32_general<Src, Isa>(src + c0, ss, q + c0, qs, s + c0, rule, c16);
  }
  if (c0 < n) quantize_columns_scalar<Src>(src + c0, ss, n - c0, q + c0, qs, s + c0, rule);
}

// Planes of one quantize call; a null data pointer means the plane is not requested.
struct Planes {
  uint8_t* row_q = nullptr;
  uint8_t* row_s = nullptr;
  uint8_t* col_q = nullptr;
  uint8_t* col_s = nullptr;
  // The codes are written with non-temporal stores where a band loop can: for outputs too large
  // to be read back from cache, whose lines are then not read before they are written.
  bool stream = false;
};

// Outputs (bytes of codes) from which a call streams its codes.
constexpr int64_t kStreamBytes = int64_t{4} << 20;

// Columns per tile of the band loop below: 32 rows of 256 columns are 16 KiB of 16-bit input
// (fp32 is staged as 16-bit), and the tile's columnwise codes 8 KiB, all held in L1.
constexpr int64_t kTileCols = 256;

// One 32-row band starting at x (row stride K): rowwise blocks into row_q [32, K] / row_s
// [32, K/32] when row_q is set, columnwise blocks into col_q [32, K] / col_s [K], tile by tile.
// Each tile is first copied into a small contiguous buffer (fp32: staged as sticky bf16) and both
// planes are computed from there; the columnwise codes are collected in a second one and written
// out row by row. Working on the band in place instead (32 rows K elements apart, read twice,
// written 32 bytes at a time K bytes apart) puts every row of a column chunk in the same few cache
// sets whenever K is a multiple of a large power of two, and the two output streams then evict each
// other's lines before they are complete.
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_band(const typename Input<T>::Elem* x, int64_t K, uint8_t* row_q,
                                  uint8_t* row_s, uint8_t* col_q, uint8_t* col_s, ScaleRule rule) {
  constexpr bool kStaged = T == InType::kF32;
  constexpr InType TT = kStaged ? InType::kBF16 : T;  // the tile's element type
  using Tile = typename Input<TT>::Elem;
  using Elem = typename Input<T>::Elem;
  alignas(64) Tile in[kBlock * kTileCols];
  alignas(64) uint8_t out[kBlock * kTileCols];
  const int64_t nb = K / kBlock;
  const vec::Cast16K c16 = vec::Cast16K::make();
  for (int64_t c0 = 0; c0 < K; c0 += kTileCols) {
    const int64_t w = std::min(kTileCols, K - c0);
    // The band reads 32 rows K elements apart, more streams than the hardware prefetchers
    // follow: the next tile is fetched while this one is worked on.
    if (c0 + kTileCols < K) {
      const int64_t wn = std::min(kTileCols, K - c0 - kTileCols) * sizeof(Elem);
      for (int r = 0; r < kBlock; ++r) {
        const char* row = reinterpret_cast<const char*>(x + r * K + c0 + kTileCols);
        for (int64_t o = 0; o < wn; o += 64) __builtin_prefetch(row + o);
      }
    }
    if constexpr (kStaged) {
      if (w == kTileCols)
        for (int r = 0; r < kBlock; ++r)
          Isa::stage_f32(x + r * K + c0, kTileCols, in + r * kTileCols);
      else
        for (int r = 0; r < kBlock; ++r) Isa::stage_f32(x + r * K + c0, w, in + r * kTileCols);
    } else if (w == kTileCols) {  // a constant size: vector moves (not a string copy)
      for (int r = 0; r < kBlock; ++r)
        for (int64_t i = 0; i < kTileCols; i += 32 / sizeof(Tile)) {
          vec::u8x32 v;
          __builtin_memcpy(&v, x + r * K + c0 + i, sizeof v);
          __builtin_memcpy(in + r * kTileCols + i, &v, sizeof v);
        }
    } else {
      for (int r = 0; r < kBlock; ++r)
        std::memcpy(in + r * kTileCols, x + r * K + c0, static_cast<size_t>(w) * sizeof(Tile));
    }
    if (row_q) {  // K (so w) is a multiple of 32 here
      const int64_t wb = w / kBlock;
      for (int r = 0; r < kBlock; ++r)
        for (int64_t b = 0; b < wb; b += 8)
          quantize_row_group<TT, Isa, T>(
              in + r * kTileCols + b * kBlock, wb - b < 8 ? static_cast<int>(wb - b) : 8,
              row_q + r * K + c0 + b * kBlock, row_s + r * nb + c0 / kBlock + b, rule, c16,
              x + r * K + c0 + b * kBlock);
    }
    quantize_columnwise_tile<TT, Isa, T>(in, kTileCols, w, out, kTileCols, col_s + c0, rule, x + c0,
                                         K);
    if (w == kTileCols)
      for (int r = 0; r < kBlock; ++r)
        std::memcpy(col_q + r * K + c0, out + r * kTileCols, kTileCols);
    else
      for (int r = 0; r < kBlock; ++r)
        std::memcpy(col_q + r * K + c0, out + r * kTileCols, static_cast<size_t>(w));
  }
}

// Columnwise blocks of one 32-row band starting at x (row stride K): q [32, K] (same layout as
// the input), s [K] (this band's row of the [M/32, K] scale plane).
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_columnwise_band(const typename Input<T>::Elem* x, int64_t K,
                                             uint8_t* q, uint8_t* s, ScaleRule rule) {
  quantize_band<T, Isa>(x, K, nullptr, nullptr, q, s, rule);
}

#if MXFP8_X86_BUILDS
// A 64-byte aligned buffer of at least n 16-bit words, one per thread, kept between calls.
inline uint16_t* band_scratch(int64_t n) {
  struct Buf {
    uint16_t* p = nullptr;
    int64_t n = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf b;
  if (b.n < n) {
    std::free(b.p);
    b.p = static_cast<uint16_t*>(std::aligned_alloc(64, (n * 2 + 63) / 64 * 64));
    b.n = b.p ? n : 0;
  }
  return b.p;
}

// Columns of a chunk, out of 32, up to which avx2_band redoes them one by one (gathered into a
// block); more go through columns32_general together.
constexpr int kMaxGatheredColumns = 8;
// Columns of the output tiles of avx2_band: the codes of 32 rows x 512 columns (16 KiB per plane)
// are collected before they go out, so that each row of a plane is written 512 bytes at a time
// (measured against 256 and 1024 on an AVX2 machine: 3-6% faster than either).
constexpr int64_t kOutCols = 512;
// Columns of a band avx2_band stages at once: 32 rows of them are 1 MiB of 16-bit values.
constexpr int64_t kSlabCols = 16384;

// The AVX2 band loop. A 32-row band of a row-major matrix is one contiguous run of memory, and
// it is read as such: row after row, slab by slab (kSlabCols columns), into a scratch copy in
// lane order (fp32 as sticky bf16) whose rows are an odd number of cache lines apart, so that
// the 32 rows of a chunk fall in different cache sets. (Reading it tile by tile instead, 32 short
// pieces of rows far apart, leaves the hardware prefetchers nothing to follow.) Each 32x32 chunk
// then gives its blocks of both planes through avx2::chunk32; the blocks chunk32 leaves are
// redone from the source with the general code; the codes of a tile of kOutCols columns are
// collected and go out row by row (streamed when asked and the rows are 32-byte aligned).
template <InType Src, bool Row, bool Floor>
MXFP8_TARGET_AVX2 void avx2_band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q,
                                 uint8_t* row_s, uint8_t* col_q, uint8_t* col_s, bool stream) {
  constexpr ScaleRule rule = Floor ? ScaleRule::kFloor : ScaleRule::kRceil;
  constexpr int64_t kChunks = kOutCols / kBlock;
  alignas(64) uint8_t cq[kBlock * kOutCols];
  alignas(64) uint8_t rq[Row ? kBlock * kOutCols : 64];
  alignas(64) uint8_t rs[Row ? kBlock * kChunks : 64];  // [chunk][row]
  const int64_t nb = K / kBlock;
  stream = stream && K % 32 == 0 &&
           ((reinterpret_cast<uintptr_t>(col_q) | reinterpret_cast<uintptr_t>(row_q)) & 31) == 0;
  const vec::Cast16K c16 = vec::Cast16K::make();
  // scratch row stride: the widest slab's whole chunks, plus one line if that is even in lines
  const int64_t wmax = std::min(kSlabCols, K) / kBlock * kBlock;
  const int64_t ls = (wmax / 32) % 2 ? wmax : wmax + 32;
  uint16_t* const in = band_scratch(kBlock * ls);
  if (!in) {  // no memory for the scratch copy: the general band loop
    quantize_band<Src, IsaAvx2>(x, K, row_q, row_s, col_q, col_s, rule);
    return;
  }
  for (int64_t s0 = 0; s0 < K; s0 += kSlabCols) {
    const int64_t sw = std::min(kSlabCols, K - s0), swf = sw / kBlock * kBlock;
    for (int r = 0; r < kBlock; ++r) avx2::stage_row(x + r * K + s0, swf, in + r * ls);
    for (int64_t c0 = s0; c0 < s0 + sw; c0 += kOutCols) {
      const int64_t w = std::min(kOutCols, s0 + sw - c0), wf = w / kBlock * kBlock;
      for (int64_t j = 0; j < wf / kBlock; ++j) {
        const int64_t cj = j * kBlock;
        uint8_t* cs = col_s + c0 + cj;
        const avx2::Redo redo = avx2::chunk32<Row, true, Floor>(
            in + (c0 - s0) + cj, ls, rq + cj, kOutCols, rs + cj, cq + cj, kOutCols, cs);
        if (redo.rows)
          for (int r = 0; r < kBlock; ++r)
            if (redo.rows >> r & 1)
              IsaAvx2::block<Src>(x + r * K + c0 + cj, rq + r * kOutCols + cj, rs + cj + r, rule);
        if (__builtin_popcount(redo.cols) > kMaxGatheredColumns) {
          columns32_general<Src, IsaAvx2>(x + c0 + cj, K, cq + cj, kOutCols, cs, rule, c16);
        } else if (redo.cols) {  // each column gathered into a block of its own
          for (int c = 0; c < kBlock; ++c) {
            if (!(redo.cols >> c & 1)) continue;
            typename Input<Src>::Elem col[kBlock];
            alignas(32) uint8_t q[kBlock];
            for (int r = 0; r < kBlock; ++r) col[r] = x[r * K + c0 + cj + c];
            IsaAvx2::block<Src>(col, q, cs + c, rule);
            for (int r = 0; r < kBlock; ++r) cq[r * kOutCols + cj + c] = q[r];
          }
        }
      }
      avx2::copy_out(cq, kOutCols, kBlock, wf, col_q + c0, K, stream);
      if (wf < w)  // a columnwise tail narrower than 32 columns (K % 32 != 0: no rowwise plane)
        quantize_columns_scalar<Src>(x + c0 + wf, K, w - wf, col_q + c0 + wf, K, col_s + c0 + wf,
                                     rule);
      if constexpr (Row) {
        avx2::copy_out(rq, kOutCols, kBlock, wf, row_q + c0, K, stream);
        for (int r = 0; r < kBlock; ++r)
          for (int64_t j = 0; j < wf / kBlock; ++j)
            row_s[r * nb + c0 / kBlock + j] = rs[j * kBlock + r];
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed lines are visible before the call returns
}

template <InType Src>
void IsaAvx2::band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q, uint8_t* row_s,
                   uint8_t* col_q, uint8_t* col_s, ScaleRule rule, bool stream) {
  if (row_q)
    rule == ScaleRule::kFloor
        ? avx2_band<Src, true, true>(x, K, row_q, row_s, col_q, col_s, stream)
        : avx2_band<Src, true, false>(x, K, row_q, row_s, col_q, col_s, stream);
  else
    rule == ScaleRule::kFloor
        ? avx2_band<Src, false, true>(x, K, row_q, row_s, col_q, col_s, stream)
        : avx2_band<Src, false, false>(x, K, row_q, row_s, col_q, col_s, stream);
}
#endif

// Rows [r0, r1) of an [M, K] matrix. For columnwise output r0 and r1 must be multiples of 32:
// each 32-row band gives both planes from one read (quantize_band).
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_rows(const typename Input<T>::Elem* x, int64_t r0, int64_t r1,
                                  int64_t K, const Planes& p, ScaleRule rule) {
  if constexpr (Isa::kBand && (T == InType::kBF16 || T == InType::kF32)) {
    if (p.col_q) {
      for (int64_t r = r0; r < r1; r += kBlock)
        Isa::template band<T>(x + r * K, K, p.row_q ? p.row_q + r * K : nullptr,
                              p.row_q ? p.row_s + r * (K / kBlock) : nullptr, p.col_q + r * K,
                              p.col_s + (r / kBlock) * K, rule, p.stream);
      return;
    }
  }
  if (!p.col_q) {
    if (p.row_q)
      quantize_rowwise<T, Isa>(x + r0 * K, r1 - r0, K, p.row_q + r0 * K,
                               p.row_s + r0 * (K / kBlock), rule);
    return;
  }
  for (int64_t r = r0; r < r1; r += kBlock)
    quantize_band<T, Isa>(x + r * K, K, p.row_q ? p.row_q + r * K : nullptr,
                          p.row_q ? p.row_s + r * (K / kBlock) : nullptr, p.col_q + r * K,
                          p.col_s + (r / kBlock) * K, rule);
}

// quantize_rows for a runtime input type, built for each instruction set and run for the one
// selected in isa.h (by default the best this CPU has).
void quantize_rows_simd(InType t, const void* x, int64_t r0, int64_t r1, int64_t K, const Planes& p,
                        ScaleRule rule);

}  // namespace mxfp8::cpu
