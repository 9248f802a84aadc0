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

#include "cpu/quantize_loops.h"
#include "cpu/target.h"
#include "mxfp8/numerics.h"
#include "mxfp8/planes.h"

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

// f32(gamma) + f32(weight_offset), once per call (add_rn, as the canonical order says).
inline std::vector<float> gamma_plus_offset(const uint16_t* gamma, int64_t H, float offset) {
  std::vector<float> g(static_cast<size_t>(H));
  for (int64_t e = 0; e < H; ++e) g[e] = add_rn(f32_from_bits(bf16_to_f32_bits(gamma[e])), offset);
  return g;
}

// sum(x^2) of one bf16 row in the canonical order: partial j takes elements 256*i + 8*j + v in
// increasing i, then v; then the pairwise tree. A 64-element block holds 8 lanes' 8 values
// each; squaring 8 vectors of 8 and transposing them lets 8 lanes add their v-th values in one
// vector add, v = 0..7 in order, which keeps every partial's order exactly. A last chunk
// shorter than 256 elements goes lane by lane.
namespace norm_vec {
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

MXFP8_CPU_LOOP f32x8 squares8(const uint16_t* x) {
  u16x8 h;
  __builtin_memcpy(&h, x, sizeof h);
  const u32x8 b = __builtin_convertvector(h, u32x8) << 16;
  f32x8 f;
  __builtin_memcpy(&f, &b, sizeof f);
  return f * f;
}

// out[v][l] = in[l][v] for an 8x8 block.
MXFP8_CPU_LOOP void transpose8(const f32x8 r[8], f32x8 out[8]) {
  const i32x8 lo{0, 8, 1, 9, 4, 12, 5, 13}, hi{2, 10, 3, 11, 6, 14, 7, 15};
  const i32x8 lo2{0, 1, 8, 9, 4, 5, 12, 13}, hi2{2, 3, 10, 11, 6, 7, 14, 15};
  const i32x8 lo4{0, 1, 2, 3, 8, 9, 10, 11}, hi4{4, 5, 6, 7, 12, 13, 14, 15};
  f32x8 t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = __builtin_shuffle(r[2 * k], r[2 * k + 1], lo);
    t[2 * k + 1] = __builtin_shuffle(r[2 * k], r[2 * k + 1], hi);
  }
  for (int k = 0; k < 2; ++k) {  // quads (0,2),(1,3) and (4,6),(5,7)
    u[4 * k + 0] = __builtin_shuffle(t[4 * k + 0], t[4 * k + 2], lo2);
    u[4 * k + 1] = __builtin_shuffle(t[4 * k + 0], t[4 * k + 2], hi2);
    u[4 * k + 2] = __builtin_shuffle(t[4 * k + 1], t[4 * k + 3], lo2);
    u[4 * k + 3] = __builtin_shuffle(t[4 * k + 1], t[4 * k + 3], hi2);
  }
  for (int v = 0; v < 4; ++v) {
    out[v] = __builtin_shuffle(u[v], u[4 + v], lo4);
    out[v + 4] = __builtin_shuffle(u[v], u[4 + v], hi4);
  }
}
}  // namespace norm_vec

MXFP8_CPU_LOOP float row_sum_of_squares(const uint16_t* x, int64_t H) {
  using namespace norm_vec;
  constexpr int64_t kChunk = kNormLanes * kNormVec;  // 256
  f32x8 acc[4] = {};
  int64_t base = 0;
  for (; base + kChunk <= H; base += kChunk)
    for (int jb = 0; jb < 4; ++jb) {  // lanes 8*jb .. 8*jb+7: elements base + 64*jb ..
      f32x8 r[8], c[8];
      for (int l = 0; l < 8; ++l) r[l] = squares8(x + base + 64 * jb + 8 * l);
      transpose8(r, c);
      for (int v = 0; v < 8; ++v) acc[jb] = acc[jb] + c[v];
    }
  float part[kNormLanes];
  __builtin_memcpy(part, acc, sizeof part);
  if (base < H) {
    const int lanes = static_cast<int>((H - base) / kNormVec);
    for (int j = 0; j < lanes; ++j)
      for (int v = 0; v < kNormVec; ++v) {
        const float f = f32_from_bits(bf16_to_f32_bits(x[base + kNormVec * j + v]));
        part[j] = add_rn(part[j], mul_rn(f, f));
      }
  }
  return norm_tree(part);
}

// normed = bf16_rne((x * inv) * g) for one row, NaN canonical; fp32 (optional) receives the
// unrounded bits. Straight-line per element, so the compiler vectorises it (no FMA:
// -ffp-contract=off).
MXFP8_CPU_LOOP void normalize_row(const uint16_t* x, const float* g, float inv, int64_t H,
                                  uint16_t* normed, uint32_t* fp32) {
  for (int64_t e = 0; e < H; ++e) {
    const uint32_t y = norm_product_bits(f32_from_bits(bf16_to_f32_bits(x[e])), inv, g[e]);
    normed[e] = f32_bits_to_bf16_rne(y);
    if (fp32) fp32[e] = y;
  }
}

// One row: normed [H] bf16, then its rowwise MXFP8 q [H] and s [H/32] by the plain quantize
// loop (so quant is the standalone quantize of normed by construction; its second read of the
// row hits L1). With quantize_from_fp32, fp32 ([H] words, required) holds the unrounded values
// that are quantized instead.
template <class Isa>
MXFP8_CPU_LOOP void rmsnorm_quantize_row(const uint16_t* x, const float* g, const NormParams& p,
                                         uint16_t* normed, uint8_t* q, uint8_t* s, uint32_t* fp32) {
  const int64_t H = p.H;
  const float inv = rms_inverse(row_sum_of_squares(x, H), H, p.eps);
  normalize_row(x, g, inv, H, normed, p.quantize_from_fp32 ? fp32 : nullptr);
  if (p.quantize_from_fp32) quantize_rowwise<InType::kF32, Isa>(fp32, 1, H, q, s, p.rule);
  else quantize_rowwise<InType::kBF16, Isa>(normed, 1, H, q, s, p.rule);
}

// Words of scratch one call of rmsnorm_quantize_rows needs (0: none).
inline size_t rows_scratch_words(const NormParams& p) {
  if (!p.quantize_from_fp32) return 0;
  return static_cast<size_t>((p.columnwise ? kBlock : 1) * p.H);
}

// Rows [r0, r1) of the output; row r's input is rows[r] (so a gather can read its rows from
// several buffers). With columnwise output r0 and r1 are multiples of 32 and each 32-row band
// is quantized columnwise right after its rows. scratch holds rows_scratch_words(p) words.
template <class Isa>
MXFP8_CPU_LOOP void rmsnorm_quantize_rows(const uint16_t* const* rows, int64_t r0, int64_t r1,
                                          const float* g, const NormParams& p, const NormOut& o,
                                          uint32_t* scratch) {
  const int64_t H = p.H, S = H / kBlock;
  const bool fp32_band = p.columnwise && p.quantize_from_fp32;
  const int64_t step = p.columnwise ? kBlock : (r1 - r0);
  for (int64_t b0 = r0; b0 < r1; b0 += step) {
    const int64_t b1 = std::min(r1, b0 + step);
    for (int64_t r = b0; r < b1; ++r)
      rmsnorm_quantize_row<Isa>(rows[r], g, p, o.normed + r * H, o.row_q + r * H, o.row_s + r * S,
                                scratch + (fp32_band ? (r - b0) * H : 0));
    if (!p.columnwise) continue;
    uint8_t* cq = o.col_q + b0 * H;
    uint8_t* cs = o.col_s + (b0 / kBlock) * H;
    if (fp32_band) quantize_columnwise_band<InType::kF32, Isa>(scratch, H, cq, cs, p.rule);
    else quantize_columnwise_band<InType::kBF16, Isa>(o.normed + b0 * H, H, cq, cs, p.rule);
  }
}

// rmsnorm_quantize_rows compiled for each instruction set and run for the one isa.h selects
// (defined in rmsnorm_quantize.cc). The numerics do not depend on the choice: vector float ops
// round exactly like scalar ones, and nothing is contracted or reassociated.
void rmsnorm_quantize_rows_simd(const uint16_t* const* rows, int64_t r0, int64_t r1, const float* g,
                                const NormParams& p, const NormOut& o, uint32_t* scratch);

}  // namespace mxfp8::cpu
