// The pieces the CPU quantize loops are built from: the input element types, the scalar
// reference loops, the 32-element vector operations (GCC/Clang vector extensions: one AVX2
// register per 8 lanes in the AVX2 build, two SSE registers in the baseline), and one rowwise
// block through them. Nothing here depends on the instruction set a caller is compiled for.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

#include "cpu/target.h"
#include "mxfp8/numerics.h"

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

}  // namespace mxfp8::cpu
