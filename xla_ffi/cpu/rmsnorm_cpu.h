// CPU RMSNorm + MXFP8 quantize over rows, shared by the local kernel (rmsnorm_quantize.cc) and
// the in-process all-gather kernel (allgather.cc).
//
// One pass per row: the sum of squares in the canonical order of numerics.h, then, block of 32
// by block of 32, the normed bf16 values, their amax, the E8M0 scale and the E4M3 codes (the
// second sweep over the row hits cache). Columnwise planes need 32 rows, so they are made per
// 32-row band, after its rows.
//
// The float math (squares, the 1/sqrt, the products) must keep subnormals: callers run it under
// ScopedIeeeFp (fp_env.h) in every thread that executes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/quantize_cpu.h"
#include "mxfp8/numerics.h"

namespace mxfp8::cpu {

inline float f32_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// What every row of one call shares.
struct NormParams {
  int64_t H = 0;                 // hidden size, a multiple of 32
  float eps = 0.f;
  bool quantize_from_fp32 = false;  // quantize (x*inv)*g before its bf16 rounding
  bool columnwise = false;
  ScaleRule rule = ScaleRule::kRceil;
};

// Where one row band's results go (pointers to row 0 of the whole output planes).
struct NormOutputs {
  uint16_t* normed = nullptr;  // [R, H] bf16 bits
  uint8_t* row_q = nullptr;    // [R, H]
  uint8_t* row_s = nullptr;    // [R, H/32]
  uint8_t* col_q = nullptr;    // [R, H] when columnwise
  uint8_t* col_s = nullptr;    // [R/32, H] when columnwise
};

// f32(gamma) + f32(weight_offset), once per call (add_rn, as the canonical order says).
inline std::vector<float> gamma_plus_offset(const uint16_t* gamma, int64_t H, float offset) {
  std::vector<float> g(static_cast<size_t>(H));
  for (int64_t e = 0; e < H; ++e) g[e] = add_rn(f32_from_bits(bf16_to_f32_bits(gamma[e])), offset);
  return g;
}

// sum(x^2) of one bf16 row in the canonical order: partial j takes elements 256*i + 8*j + v in
// increasing i, then v; then the pairwise tree. (Looping j innermost keeps that per-partial order
// and gives 32 independent accumulators.)
inline float row_sum_of_squares(const uint16_t* x, int64_t H) {
  float part[kNormLanes] = {};
  for (int64_t base = 0; base < H; base += kNormLanes * kNormVec) {
    const int lanes = static_cast<int>(std::min<int64_t>(kNormLanes, (H - base) / kNormVec));
    for (int v = 0; v < kNormVec; ++v)
      for (int j = 0; j < lanes; ++j) {
        const float f = f32_from_bits(bf16_to_f32_bits(x[base + kNormVec * j + v]));
        part[j] = add_rn(part[j], mul_rn(f, f));
      }
  }
  return norm_tree(part);
}

// One row: normed [H] bf16, rowwise q [H] and s [H/32]; fp32 (optional, [H] bits) receives the
// unrounded (x*inv)*g for a columnwise plane quantized from fp32.
inline void rmsnorm_quantize_row(const uint16_t* x, const float* g, const NormParams& p,
                                 uint16_t* normed, uint8_t* q, uint8_t* s, uint32_t* fp32) {
  const int64_t H = p.H;
  const float inv = rms_inverse(row_sum_of_squares(x, H), H, p.eps);
  uint32_t src[kBlock];
  for (int64_t b = 0; b < H / kBlock; ++b) {
    uint32_t amax = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int64_t e = b * kBlock + i;
      const float xf = f32_from_bits(bf16_to_f32_bits(x[e]));
      const uint32_t y = f32_to_bits(mul_rn(mul_rn(xf, inv), g[e]));
      const uint16_t n = f32_bits_to_bf16_rne(y);
      normed[e] = n;
      if (fp32) fp32[e] = y;
      src[i] = p.quantize_from_fp32 ? y : bf16_to_f32_bits(n);
      amax = std::max(amax, abs_bits_or_zero_if_nan(src[i]));
    }
    const uint8_t scale = e8m0_scale(amax, p.rule);
    s[b] = scale;
    for (int i = 0; i < kBlock; ++i) q[b * kBlock + i] = e4m3_scaled(src[i], scale);
  }
}

// Rows [r0, r1) of the output; row r's input is row_input(r) (so a gather can read its rows
// from several buffers). With columnwise output r0 and r1 are multiples of 32, each 32-row band
// is quantized columnwise right after its rows, and scratch holds 32*H words when quantizing
// from fp32 (otherwise it may be null).
template <typename RowInput>
void rmsnorm_quantize_rows(const RowInput& row_input, int64_t r0, int64_t r1, const float* g,
                           const NormParams& p, const NormOutputs& o, uint32_t* scratch) {
  const int64_t H = p.H, S = H / kBlock;
  const bool fp32_band = p.columnwise && p.quantize_from_fp32;
  const int64_t step = p.columnwise ? kBlock : (r1 - r0);
  for (int64_t b0 = r0; b0 < r1; b0 += step) {
    const int64_t b1 = std::min(r1, b0 + step);
    for (int64_t r = b0; r < b1; ++r)
      rmsnorm_quantize_row(row_input(r), g, p, o.normed + r * H, o.row_q + r * H,
                           o.row_s + r * S, fp32_band ? scratch + (r - b0) * H : nullptr);
    if (!p.columnwise) continue;
    uint8_t* cq = o.col_q + b0 * H;
    uint8_t* cs = o.col_s + (b0 / kBlock) * H;
    if (fp32_band)
      quantize_columnwise_band<InType::kF32>(scratch, H, cq, cs, p.rule);
    else
      quantize_columnwise_band<InType::kBF16>(o.normed + b0 * H, H, cq, cs, p.rule);
  }
}

}  // namespace mxfp8::cpu
