// MXFP8 numerics: the one rule set shared by the CPU, CUDA and HIP kernels.
//
// Everything here works on the IEEE bit patterns with integer arithmetic. That is deliberate:
// XLA:CPU runs custom calls with flush-to-zero/denormals-are-zero set, GPU compilers may be
// asked for FTZ, and 2^-127 (scale byte 0) is an fp32 subnormal. Integer code gives the same
// bytes whatever the floating-point environment, on every platform.
//
// Rules (the numerics of docs/design.md):
//   amax   = max |x| over a 32-element block, NaN elements ignored, starting from 0
//   rceil  : v = fp32_mul_rn(amax, fp32(1/448)); byte = exp(v) rounded up on its fp32 bits
//   floor  : byte = clamp(floor(log2(amax)) - 8 + 127, 0, 254), amax 0 -> 0
//   q      = e4m3_rne_satfinite(fp32(x) * 2^(127 - byte))
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MXFP8_HD __host__ __device__ __forceinline__
#else
#define MXFP8_HD inline __attribute__((always_inline))
#endif

namespace mxfp8 {

constexpr int kBlock = 32;            // elements per scale block
constexpr uint32_t kE4M3MaxBits = 0x43E00000u;  // 448.0f
constexpr uint32_t kInvE4M3MaxBits = 0x3B124925u;  // fp32(1/448), round to nearest
constexpr uint8_t kE4M3MaxCode = 0x7E;  // 448
constexpr uint8_t kE4M3NaNCode = 0x7F;
// The one NaN of every computed fp32 value (docs/design.md §2): positive, quiet bit only.
constexpr uint32_t kCanonicalNaNBits = 0x7FC00000u;

enum class ScaleRule : int32_t { kRceil = 0, kFloor = 1 };

// Element type of a quantize input: the FFI handlers of every platform decode it from the
// operand, and the kernels are instantiated per type.
enum class InType : int { kF32, kBF16, kF16 };

// Exactly rounded fp32 multiply and add that no compiler may contract into an FMA.
MXFP8_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MXFP8_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// ---------------------------------------------------------------------------------------------
// Input formats -> fp32 bits (exact; subnormal halves become fp32 normals, done in integers).

MXFP8_HD uint32_t bf16_to_f32_bits(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

MXFP8_HD uint32_t f16_to_f32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return sign | 0x7F800000u | (man << 13);  // Inf / NaN
  if (exp != 0) return sign | ((exp + 112u) << 23) | (man << 13);
  if (man == 0) return sign;
  // Subnormal half: value = man * 2^-24; normalise the 10-bit mantissa.
  int e = 113;  // biased fp32 exponent of 2^-14
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3FFu) << 13);
}

// ---------------------------------------------------------------------------------------------
// amax as bits: |x| bits compare like the magnitudes they encode; NaN (> 0x7F800000) ignored.

MXFP8_HD uint32_t abs_bits_or_zero_if_nan(uint32_t x) {
  const uint32_t a = x & 0x7FFFFFFFu;
  return a > 0x7F800000u ? 0u : a;
}

// Position of the highest set bit of a non-zero value (floor(log2(v))).
MXFP8_HD int highest_bit(uint64_t v) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return 63 - __clzll(static_cast<long long>(v));
#else
  return 63 - __builtin_clzll(v);
#endif
}

// Round-to-nearest-even of v / 2^shift for shift >= 1.
MXFP8_HD uint64_t shift_right_rne(uint64_t v, int shift) {
  if (shift >= 64) return 0;
  const uint64_t q = v >> shift;
  const uint64_t rem = v & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
}

// fp32_mul_rn(a, b) for non-negative finite a, b, with a correctly rounded (RNE) subnormal
// result and no flushing: the exact 48-bit product rounded by integer arithmetic.
MXFP8_HD uint32_t f32_mul_rn_bits(uint32_t a, uint32_t b) {
  const uint32_t ea = a >> 23, eb = b >> 23;
  uint64_t sa = a & 0x7FFFFFu, sb = b & 0x7FFFFFu;
  if ((ea == 0 && sa == 0) || (eb == 0 && sb == 0)) return 0;
  if (ea) sa |= 0x800000u;
  if (eb) sb |= 0x800000u;
  // value = sa * 2^(max(ea,1) - 150) * sb * 2^(max(eb,1) - 150)
  const uint64_t p = sa * sb;
  const int e = (ea ? static_cast<int>(ea) : 1) + (eb ? static_cast<int>(eb) : 1) - 300;
  // value = p * 2^e; find the biased exponent of the leading bit.
  const int lead = highest_bit(p);        // value in [2^(lead+e), 2^(lead+e+1))
  int biased = lead + e + 127;
  if (biased >= 255) return 0x7F800000u;  // overflow -> Inf (not reached for our constants)
  // Keep 24 significant bits (normal) or as many as the subnormal grid allows.
  int keep_shift = lead - 23;             // normal: drop (lead - 23) bits
  if (biased < 1) keep_shift += 1 - biased;  // subnormal: quantum 2^-149
  uint64_t sig = keep_shift > 0 ? shift_right_rne(p, keep_shift) : (p << -keep_shift);
  if (biased < 1) {
    // Subnormal grid: sig is the integer multiple of 2^-149 (it may round up to 2^-126).
    return static_cast<uint32_t>(sig);
  }
  if (sig >> 24) {  // rounding carried into a new binade
    sig >>= 1;
    ++biased;
    if (biased >= 255) return 0x7F800000u;
  }
  return (static_cast<uint32_t>(biased) << 23) | (static_cast<uint32_t>(sig) & 0x7FFFFFu);
}

// ---------------------------------------------------------------------------------------------
// Scale rules: amax (as non-negative fp32 bits, NaN-free) -> E8M0 byte.

MXFP8_HD uint8_t e8m0_rceil(uint32_t amax_bits) {
  if (amax_bits >= 0x7F800000u) return 0xFE;  // +Inf
  const uint32_t v = f32_mul_rn_bits(amax_bits, kInvE4M3MaxBits);
  const uint32_t exp = v >> 23, man = v & 0x7FFFFFu;
  const bool round_up = man != 0 && exp != 0xFE && !(exp == 0 && man <= 0x400000u);
  return static_cast<uint8_t>(exp + (round_up ? 1u : 0u));
}

MXFP8_HD uint8_t e8m0_floor(uint32_t amax_bits) {
  const uint32_t exp = amax_bits >> 23;  // floor(log2(amax)) + 127 for normal amax
  if (exp == 0) return 0;                // zero or subnormal: clamps to 0
  if (exp >= 0xFF) return 254;           // +Inf
  const int byte = static_cast<int>(exp) - 8;
  return static_cast<uint8_t>(byte < 0 ? 0 : (byte > 254 ? 254 : byte));
}

MXFP8_HD uint8_t e8m0_scale(uint32_t amax_bits, ScaleRule rule) {
  return rule == ScaleRule::kFloor ? e8m0_floor(amax_bits) : e8m0_rceil(amax_bits);
}

// ---------------------------------------------------------------------------------------------
// Cast: e4m3_rne_satfinite(x * 2^(127 - byte)) from the bits of x, exactly, in integers.

MXFP8_HD uint8_t e4m3_scaled(uint32_t x, uint8_t scale_byte) {
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | kE4M3NaNCode;   // NaN stays NaN
  if (a == 0x7F800000u) return sign | kE4M3MaxCode;  // Inf saturates
  const int k = 127 - static_cast<int>(scale_byte);
  // |x| = sig * 2^(exp2 - 150) with sig normalised to 24 bits, then scaled: y = sig * 2^(ey - 150).
  uint32_t sig = a & 0x7FFFFFu;
  int ey = static_cast<int>(a >> 23);
  if (ey == 0) {
    if (sig == 0) return sign;  // +-0
    const int lead = highest_bit(sig);  // normalise a subnormal input
    sig <<= (23 - lead);
    ey = 1 - (23 - lead);
  } else {
    sig |= 0x800000u;
  }
  ey += k;
  // ey is now the biased fp32 exponent of |y|, sig its 24-bit significand.
  if (ey > 135 || (ey == 135 && sig >= 0xE00000u)) return sign | kE4M3MaxCode;  // >= 448
  if (ey >= 121) {
    // E4M3 normal range [2^-6, 448): keep 3 mantissa bits, round to nearest even.
    const uint32_t bits = (static_cast<uint32_t>(ey - 120) << 23) | (sig & 0x7FFFFFu);
    const uint32_t rounded = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
    return sign | static_cast<uint8_t>(rounded);
  }
  // E4M3 subnormal range: the code is round(|y| * 2^9), 0..8 (8 is the smallest normal).
  const int shift = 141 - ey;  // >= 21
  return sign | static_cast<uint8_t>(shift_right_rne(sig, shift));
}

// The same cast without branches, for SIMD loops (CPU auto-vectorisation) and GPU lanes.
// Valid when x is NOT a non-zero fp32 subnormal (callers check `is_f32_subnormal` per block and use
// e4m3_scaled for such blocks). It uses one float multiply-add pair whose operands are normal
// floats by construction (|y| in [2^-126, 2^-6)), so FTZ/DAZ cannot change its result:
//   E4M3 subnormal codes are round(|y| * 2^9), taken with the 2^23 magic-number rounding.
MXFP8_HD bool is_f32_subnormal(uint32_t x) {
  const uint32_t a = x & 0x7FFFFFFFu;
  return a != 0 && a < 0x800000u;
}

// All-ones when cond holds, else zero: selects without control flow, so loops vectorise.
MXFP8_HD uint32_t mask_if(bool cond) { return 0u - static_cast<uint32_t>(cond); }

MXFP8_HD uint8_t e4m3_scaled_normal_input(uint32_t x, int32_t k) {
  const uint32_t a = x & 0x7FFFFFFFu;
  const uint32_t sign = (x >> 24) & 0x80u;
  const int32_t ey = static_cast<int32_t>(a >> 23) + k;     // biased exponent of |y|
  const uint32_t yb = a + (static_cast<uint32_t>(k) << 23);  // bits of |y| when 1 <= ey <= 254
  const uint32_t nb = yb - (120u << 23);                     // E4M3 normal: rebias, keep 3 bits
  const uint32_t code_n = (nb + 0x7FFFFu + ((nb >> 20) & 1u)) >> 20;
  float y;
  __builtin_memcpy(&y, &yb, sizeof y);
  const float r = add_rn(add_rn(mul_rn(y, 512.0f), 8388608.0f), -8388608.0f);
  const uint32_t code_s = static_cast<uint32_t>(static_cast<int32_t>(r));
  const uint32_t in_normal = mask_if(ey >= 121), in_range = mask_if(ey >= 1) & ~mask_if(a == 0);
  uint32_t code = ((code_n & in_normal) | (code_s & ~in_normal)) & in_range;
  const uint32_t sat = (in_range & mask_if(yb >= kE4M3MaxBits)) | mask_if(a == 0x7F800000u);
  code = (code & ~sat) | (kE4M3MaxCode & sat);
  const uint32_t nan = mask_if(a > 0x7F800000u);
  code = (code & ~nan) | (kE4M3NaNCode & nan);
  return static_cast<uint8_t>(sign | code);
}

// Value of an E8M0 byte as fp32 bits: 2^(byte-127); byte 0 is the subnormal 2^-127, 0xFF NaN.
MXFP8_HD uint32_t e8m0_to_f32_bits(uint8_t byte) {
  if (byte == 0xFF) return 0x7FC00000u;
  if (byte == 0) return 0x00400000u;
  return static_cast<uint32_t>(byte) << 23;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (the fused op of docs/design.md), in one canonical evaluation order so that every
// kernel (CPU, CUDA, HIP) produces the same bits:
//   sumsq  = 32 fp32 partial sums; partial j accumulates, in increasing i and then v, x^2 of the
//            elements 256*i + 8*j + v (v = 0..7) that exist; then a pairwise tree
//            p[j] += p[j + s] for s = 16, 8, 4, 2, 1 (j < s); sumsq = p[0]
//            (a warp whose lane j loads 8 contiguous bf16 per step, reduced with xor-shuffles)
//   inv    = 1 / sqrt(sumsq / H + eps)            (each op correctly rounded)
//   normed = bf16_rne(canonical_nan((x * inv) * (gamma + weight_offset)))
// No fused multiply-add anywhere: mul_rn/add_rn are never contracted. Hardware writes its own
// NaN for an invalid operation (CUDA 0x7FFFFFFF, x86 0xFFC00000 or the input NaN, AMD
// 0x7FC00000), so the product goes through canonical_nan before anything rounds or quantizes it.

constexpr int kNormLanes = 32;
constexpr int kNormVec = 8;

// Index of the partial sum that element e of a row accumulates into.
MXFP8_HD int norm_lane(int64_t e) { return static_cast<int>((e % 256) / kNormVec); }

// The pairwise tree over the 32 partials (p is modified); returns the total.
MXFP8_HD float norm_tree(float* p) {
  for (int s = kNormLanes / 2; s >= 1; s /= 2)
    for (int j = 0; j < s; ++j) p[j] = add_rn(p[j], p[j + s]);
  return p[0];
}

MXFP8_HD float rms_inverse(float sumsq, int64_t H, float eps) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sumsq, static_cast<float>(H)), eps)));
#else
  return 1.0f / std::sqrt(sumsq / static_cast<float>(H) + eps);
#endif
}

// Any NaN -> kCanonicalNaNBits; other values unchanged. Branch-free, so loops vectorise.
MXFP8_HD uint32_t canonical_nan(uint32_t b) {
  const uint32_t nan = mask_if((b & 0x7FFFFFFFu) > 0x7F800000u);
  return (b & ~nan) | (kCanonicalNaNBits & nan);
}

// The normed value's fp32 bits: (x * inv) * g, each product correctly rounded, NaN canonical.
MXFP8_HD uint32_t norm_product_bits(float x, float inv, float g) {
  const float y = mul_rn(mul_rn(x, inv), g);
  uint32_t b;
  __builtin_memcpy(&b, &y, sizeof b);
  return canonical_nan(b);
}

// fp32 bits -> bf16 bits, round to nearest even (NaN kept quiet).
MXFP8_HD uint16_t f32_bits_to_bf16_rne(uint32_t b) {
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

}  // namespace mxfp8
