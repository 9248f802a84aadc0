// The destinations and parameters the kernels of every platform share: the MXFP8 planes a
// quantize writes, and what an RMSNorm + quantize call reads and writes. Plain C++ (no XLA,
// CUDA or HIP type), so that the CPU kernels, the GPU kernels and launchers, and the FFI
// handlers that fill them (ffi_util.h) all name the same structs.
#pragma once

#include <cstdint>

#include "mxfp8/numerics.h"

namespace mxfp8 {

// The four planes of one quantize; a null pointer skips its plane.
struct Planes {
  uint8_t* row_q = nullptr;  // E4M3 codes, the input's shape
  uint8_t* row_s = nullptr;  // E8M0 scales, one per 32 elements of a row
  uint8_t* col_q = nullptr;  // E4M3 codes, the input's shape
  uint8_t* col_s = nullptr;  // E8M0 scales, one per 32 elements of a column
};

// What every row of one RMSNorm + quantize call shares.
struct NormParams {
  int64_t H = 0;  // hidden size, a multiple of 32
  float eps = 0.f;
  float weight_offset = 0.f;        // added to gamma (f32) before it multiplies
  bool quantize_from_fp32 = false;  // quantize (x * inv) * g before its bf16 rounding
  bool columnwise = false;          // columnwise planes too (R a multiple of 32)
  ScaleRule rule = ScaleRule::kRceil;
};

// Where an RMSNorm + quantize call writes: pointers to row 0 of the whole [R, H] outputs.
struct NormOut {
  uint16_t* normed = nullptr;    // [R, H] bf16 bits
  uint8_t* row_q = nullptr;      // [R, H]
  uint8_t* row_s = nullptr;      // [R, H/32]
  uint8_t* col_q = nullptr;      // [R, H] (columnwise only)
  uint8_t* col_s = nullptr;      // [R/32, H] (columnwise only)
  uint16_t* residual = nullptr;  // [R, H] the rows read, bit for bit (gathered rows only)
};

}  // namespace mxfp8
