// Device building blocks of the GPU RMSNorm + MXFP8 kernels, in the canonical evaluation order
// pinned in numerics.h: 32 lanes per row, lane j holds the 8 contiguous bf16 at 256*i + 8*j of
// step i, partial sums in increasing i then element, an xor-exchange tree over 16, 8, 4, 2, 1,
// and mul_rn/add_rn (never fused) everywhere.
//
// On a 64-lane wavefront the exchanges name width 32, so each half of the wavefront is an
// independent row: the order is the same as on a 32-lane warp.
#pragma once

#include "gpu/tile.cuh"

namespace mxfp8::gpu {

constexpr int kNormStep = kNormLanes * kNormVec;  // elements of a row per step (256)
static_assert(kWarpLanes % kNormLanes == 0, "a warp (or wavefront) holds whole rows' lanes");

// Adds x^2 of the 8 bf16 of v to the lane's partial sum, in element order.
__device__ __forceinline__ float add_squares(float p, const uint4& v) {
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) {
    const float f = f32(Elems<InType::kBF16>::at(v, k));
    p = add_rn(p, mul_rn(f, f));
  }
  return p;
}

// The pairwise tree over the 32 lanes' partials; every lane gets p[0] of numerics.h's tree
// (the exchange is symmetric and fp addition commutes, so lane j holds tree[j mod s] after
// the step of width s).
__device__ __forceinline__ float lane_tree(float p) {
#pragma unroll
  for (int s = kNormLanes / 2; s >= 1; s /= 2) p = add_rn(p, shfl_xor(p, s, kNormLanes));
  return p;
}

// Sum of squares of one row read from memory (rolled loop), in the canonical order.
__device__ __forceinline__ float row_sum_of_squares(const uint16_t* row, int64_t H, int lane,
                                                    bool active) {
  float p = 0.f;
  const int64_t steps = (H + kNormStep - 1) / kNormStep;
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t e = i * kNormStep + lane * kNormVec;
    if (active && e < H) p = add_squares(p, *reinterpret_cast<const uint4*>(row + e));
  }
  return lane_tree(p);
}

// Bits of (x * inv) * (gamma + weight_offset), each product and the sum correctly rounded, a
// NaN made canonical (the GPUs' own NaNs differ: numerics.h).
__device__ __forceinline__ uint32_t norm_bits(uint32_t x_bits, float inv, float g) {
  return norm_product_bits(f32(x_bits), inv, g);
}

// gamma + weight_offset from gamma's fp32 bits.
__device__ __forceinline__ float gamma_value(uint32_t gamma_bits, float weight_offset) {
  return add_rn(f32(gamma_bits), weight_offset);
}

// The normed values of N contiguous elements (x and gamma as fp32 bits): bf16 bits of the
// rounded results into `normed` (packed pairs), and the values the quantizer reads into src
// (fp32 bits): the fp32 product itself, or the bf16 result widened.
template <bool kFromFp32, int N>
__device__ __forceinline__ void normalize(const uint32_t (&x)[N], const uint32_t (&g)[N], float inv,
                                          float weight_offset, uint32_t (&normed)[N / 2],
                                          uint32_t (&src)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const uint32_t y = norm_bits(x[k], inv, gamma_value(g[k], weight_offset));
    const uint32_t n = f32_bits_to_bf16_rne(y);
    if (k % 2 == 0) normed[k / 2] = n;
    else normed[k / 2] |= n << 16;
    src[k] = kFromFp32 ? y : n << 16;
  }
}

}  // namespace mxfp8::gpu
