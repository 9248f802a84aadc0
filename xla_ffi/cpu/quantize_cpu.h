// CPU MXFP8 quantize loops over row bands, shared by the plain, packed-segment and fused
// RMSNorm kernels. A band is 32 rows: one row of columnwise blocks and 32 rows of rowwise
// blocks, so both planes come out of one read of the band (the second sweep hits cache).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "mxfp8/numerics.h"

// The band loops are force-inlined so that each caller compiles them for its own target (the
// AVX2 clone of quantize_rows_simd below, or the baseline).
#define MXFP8_CPU_LOOP inline __attribute__((always_inline))

namespace mxfp8::cpu {

enum class InType : int { kF32, kBF16, kF16 };

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

// Rowwise blocks of `rows` rows of length K: q [rows, K], s [rows, K/32].
template <InType T>
MXFP8_CPU_LOOP void quantize_rowwise(const typename Input<T>::Elem* x, int64_t rows, int64_t K, uint8_t* q,
                      uint8_t* s, ScaleRule rule) {
  uint32_t buf[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const auto* xr = x + r * K;
    for (int64_t b = 0; b < K / kBlock; ++b) {
      uint32_t amax = 0, subnormal = 0;
      for (int i = 0; i < kBlock; ++i) {
        buf[i] = Input<T>::bits(xr[b * kBlock + i]);
        amax = std::max(amax, abs_bits_or_zero_if_nan(buf[i]));
        subnormal |= mask_if(is_f32_subnormal(buf[i]));
      }
      const uint8_t scale = e8m0_scale(amax, rule);
      s[r * (K / kBlock) + b] = scale;
      uint8_t* qb = q + r * K + b * kBlock;
      if (subnormal) {
        for (int i = 0; i < kBlock; ++i) qb[i] = e4m3_scaled(buf[i], scale);
      } else {
        const int32_t k = 127 - static_cast<int32_t>(scale);
        for (int i = 0; i < kBlock; ++i) qb[i] = e4m3_scaled_normal_input(buf[i], k);
      }
    }
  }
}

// Columnwise blocks of one 32-row band starting at x (row stride K): q [32, K] (same layout as
// the input), s [K] (this band's row of the [M/32, K] scale plane).
template <InType T>
MXFP8_CPU_LOOP void quantize_columnwise_band(const typename Input<T>::Elem* x, int64_t K, uint8_t* q,
                              uint8_t* s, ScaleRule rule) {
  constexpr int64_t kChunk = 64;
  uint32_t amax[kChunk];
  uint8_t scale[kChunk];
  int32_t k[kChunk];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    const int64_t n = std::min(kChunk, K - c0);
    std::fill(amax, amax + n, 0u);
    uint32_t subnormal = 0;
    for (int r = 0; r < kBlock; ++r) {
      const auto* xr = x + r * K + c0;
      for (int64_t c = 0; c < n; ++c) {
        const uint32_t bits = Input<T>::bits(xr[c]);
        amax[c] = std::max(amax[c], abs_bits_or_zero_if_nan(bits));
        subnormal |= mask_if(is_f32_subnormal(bits));
      }
    }
    for (int64_t c = 0; c < n; ++c) {
      scale[c] = s[c0 + c] = e8m0_scale(amax[c], rule);
      k[c] = 127 - static_cast<int32_t>(scale[c]);
    }
    for (int r = 0; r < kBlock; ++r) {
      const auto* xr = x + r * K + c0;
      uint8_t* qr = q + r * K + c0;
      if (subnormal) {
        for (int64_t c = 0; c < n; ++c) qr[c] = e4m3_scaled(Input<T>::bits(xr[c]), scale[c]);
      } else {
        for (int64_t c = 0; c < n; ++c) qr[c] = e4m3_scaled_normal_input(Input<T>::bits(xr[c]), k[c]);
      }
    }
  }
}

// Planes of one quantize call; a null data pointer means the plane is not requested.
struct Planes {
  uint8_t* row_q = nullptr;
  uint8_t* row_s = nullptr;
  uint8_t* col_q = nullptr;
  uint8_t* col_s = nullptr;
};

// Rows [r0, r1) of an [M, K] matrix. For columnwise output r0 and r1 must be multiples of 32.
template <InType T>
MXFP8_CPU_LOOP void quantize_rows(const typename Input<T>::Elem* x, int64_t r0, int64_t r1, int64_t K,
                   const Planes& p, ScaleRule rule) {
  if (p.row_q) quantize_rowwise<T>(x + r0 * K, r1 - r0, K, p.row_q + r0 * K,
                                   p.row_s + r0 * (K / kBlock), rule);
  if (p.col_q)
    for (int64_t r = r0; r < r1; r += kBlock)
      quantize_columnwise_band<T>(x + r * K, K, p.col_q + r * K, p.col_s + (r / kBlock) * K, rule);
}

// quantize_rows for a runtime input type, built for AVX2 and for the baseline ISA and chosen
// once at load time by the CPU's features (quantize_simd.cc).
void quantize_rows_simd(InType t, const void* x, int64_t r0, int64_t r1, int64_t K,
                        const Planes& p, ScaleRule rule);

}  // namespace mxfp8::cpu
