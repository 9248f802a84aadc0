// The host-side interface of the GPU kernels: plain C++, no CUDA, HIP or XLA header. The .cu
// files hold kernels and these launchers only; the XLA FFI handlers that check the buffers and
// call them (handlers.cc) are compiled once by the host compiler for both GPU modules, which
// keeps the heavy FFI templates out of every nvcc/clang -x hip pass and architecture.
#pragma once

#include <cstdint>

#include "mxfp8/numerics.h"

namespace mxfp8::gpu {

enum class InType : int { kF32, kBF16, kF16 };

// Destination planes; a null pointer skips its plane.
struct Planes {
  uint8_t* row_q = nullptr;
  uint8_t* row_s = nullptr;
  uint8_t* col_q = nullptr;
  uint8_t* col_s = nullptr;
};

struct NormOut {
  uint16_t* normed = nullptr;  // [R, H] bf16 bits
  uint8_t* row_q = nullptr;    // [R, H]
  uint8_t* row_s = nullptr;    // [R, H/32]
  uint8_t* col_q = nullptr;    // [R, H] (columnwise only)
  uint8_t* col_s = nullptr;    // [R/32, H] (columnwise only)
};

struct NormParams {
  int64_t H = 0;
  float eps = 0.f;
  float weight_offset = 0.f;
  ScaleRule rule = ScaleRule::kRceil;
};

// Each enqueues its kernels on `stream` (a cudaStream_t or hipStream_t) and returns nullptr, or
// the runtime's message when a launch failed. Arguments are checked by the caller.

// [M, K] input; M a multiple of 32 when columnwise planes are requested.
const char* launch_quantize(void* stream, InType t, const uint8_t* x, int64_t M, int64_t K,
                            const Planes& p, ScaleRule rule);

// A packed segment of S elements; desc: P device-resident rows (offset, rows, row_len), int64
// when desc64 else int32.
const char* launch_quantize_segments(void* stream, InType t, const uint8_t* x, int64_t S,
                                     const void* desc, bool desc64, int64_t P, const Planes& p,
                                     ScaleRule rule);

// RMSNorm of [R, prm.H] bf16 rows, then MXFP8 of the result (columnwise: R a multiple of 32).
const char* launch_rmsnorm_quantize(void* stream, const uint16_t* x, const uint16_t* gamma,
                                    int64_t R, const NormParams& prm, const NormOut& o,
                                    bool columnwise, bool quantize_from_fp32);

}  // namespace mxfp8::gpu
