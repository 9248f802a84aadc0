// HIP-CPU shim of the CUDA path (see hipcpu.h): the GPU sources compiled as nvcc's device pass
// for sm_90 sees them, with each CUDA name they use mapped onto HIP-CPU.
//
// - __CUDA_ARCH__ is 900, so numerics.h takes its device arithmetic and tile.cuh its sm_89+
//   fast form; HIP-CPU's __HIPCC__ and __HIP__ are taken back, so that no HIP branch is taken.
// - The warp is NVIDIA's 32 lanes: HIP-CPU's is 64, so __any_sync votes over this lane's half
//   of HIP-CPU's ballot; __shfl_xor_sync's exchanges name their width (32 or less) and stay
//   inside it.
// - The fast form's two instructions are emulated from their documented semantics:
//   cvt.rn.satfinite.e4m3x2.f32 by the nearest E4M3 value, found by search (round to nearest
//   even, saturate to +-448, NaN to a NaN code), and __vmaxu2 per 16-bit half. The emulation
//   is tested against numerics.h's exact cast; the instructions themselves run only on a GPU.
#pragma once

#include "hipcpu/hipcpu.h"

#undef __HIPCC__
#undef __HIP__
#define __CUDA_ARCH__ 900

using cudaStream_t = hipStream_t;
using cudaError_t = hipError_t;
#define cudaSuccess hipSuccess
inline cudaError_t cudaGetLastError() { return hipGetLastError(); }
inline const char* cudaGetErrorString(cudaError_t e) { return hipGetErrorString(e); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width) {
  (void)mask;
  return __shfl_xor(v, lane_mask, width);
}

inline bool __any_sync(unsigned mask, bool pred) {
  const uint64_t lanes = __ballot(pred);  // HIP-CPU's 64 lanes: two NVIDIA warps
  const uint32_t warp = (static_cast<uint32_t>(threadIdx.x) & 32u) ? lanes >> 32 : lanes;
  return (warp & mask) != 0;
}

namespace mxfp8::hipcpu {

// Value of the non-negative E4M3 code c (0..0x7E): m * 2^-9 below 2^-6, else (8 + m) * 2^(e-10).
inline double e4m3_value(int c) {
  const int e = c >> 3, m = c & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// cvt.rn.satfinite to E4M3 of one fp32 value.
inline uint32_t e4m3_rn_satfinite(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint32_t sign = std::signbit(f) ? 0x80u : 0u;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return sign | 0x7Eu;  // saturate to finite (Inf included)
  int lo = 0, hi = 0x7E;                // the largest code whose value is <= a
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (e4m3_value(mid) <= a) lo = mid;
    else hi = mid - 1;
  }
  // The nearer of lo and lo + 1, the even code on a tie (2a and the sum are exact doubles).
  const double twice = 2.0 * a, sum = e4m3_value(lo) + e4m3_value(lo + 1);
  if (twice > sum || (twice == sum && (lo & 1))) ++lo;
  return sign | static_cast<uint32_t>(lo);
}

inline uint32_t cvt_e4m3x2_rn_satfinite(float lo, float hi) {
  return e4m3_rn_satfinite(lo) | e4m3_rn_satfinite(hi) << 8;
}

inline uint32_t vmaxu2(uint32_t a, uint32_t b) {
  const uint32_t lo = (a & 0xFFFFu) > (b & 0xFFFFu) ? a & 0xFFFFu : b & 0xFFFFu;
  const uint32_t hi = (a >> 16) > (b >> 16) ? a >> 16 : b >> 16;
  return hi << 16 | lo;
}

}  // namespace mxfp8::hipcpu
