// XLA FFI helpers shared by the CPU handlers (cpu/*.cc) and the GPU ones (gpu/handlers.cc):
// the input element type, argument errors, the bytes and sizes of the MXFP8 result planes, and
// the kernels' destinations and parameters (planes.h) filled from the results and attributes.
// Host code of the handlers only: the kernels never see an XLA header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mxfp8/numerics.h"
#include "mxfp8/planes.h"
#include "xla/ffi/api/ffi.h"

namespace mxfp8 {

namespace ffi = xla::ffi;

// The InType of an operand's element type; false unless it is f32, bf16 or f16.
inline bool input_type(ffi::DataType t, InType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = InType::kF32; return true;
    case ffi::DataType::BF16: *out = InType::kBF16; return true;
    case ffi::DataType::F16: *out = InType::kF16; return true;
    default: return false;
  }
}

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

// A plane's bytes: E4M3 codes and E8M0 scales are one byte per element, whatever element type
// the caller declared the result with.
inline uint8_t* bytes(ffi::Result<ffi::AnyBuffer>& r) {
  return static_cast<uint8_t*>(r->untyped_data());
}

// Whether the requested planes of n input elements have their sizes: n bytes of codes and
// n / 32 bytes of scales each (rowwise and columnwise alike). Unrequested planes are not looked
// at (callers pass them as zero-size results).
inline bool plane_sizes_ok(size_t n, bool rowwise, bool columnwise,
                           ffi::Result<ffi::AnyBuffer>& row_q, ffi::Result<ffi::AnyBuffer>& row_s,
                           ffi::Result<ffi::AnyBuffer>& col_q, ffi::Result<ffi::AnyBuffer>& col_s) {
  return !((rowwise && (row_q->size_bytes() != n || row_s->size_bytes() != n / kBlock)) ||
           (columnwise && (col_q->size_bytes() != n || col_s->size_bytes() != n / kBlock)));
}

// The kernels' destination planes: the requested planes' bytes, null pointers for the others.
inline Planes requested_planes(bool rowwise, bool columnwise, ffi::Result<ffi::AnyBuffer>& row_q,
                               ffi::Result<ffi::AnyBuffer>& row_s,
                               ffi::Result<ffi::AnyBuffer>& col_q,
                               ffi::Result<ffi::AnyBuffer>& col_s) {
  Planes p;
  if (rowwise) p.row_q = bytes(row_q), p.row_s = bytes(row_s);
  if (columnwise) p.col_q = bytes(col_q), p.col_s = bytes(col_s);
  return p;
}

// An RMSNorm + quantize call's parameters from the handler's attributes (the local op and the
// gather have the same ones).
inline NormParams norm_params(int64_t H, float eps, float weight_offset, bool quantize_from_fp32,
                              bool columnwise, int32_t scale_rule) {
  NormParams p;
  p.H = H;
  p.eps = eps;
  p.weight_offset = weight_offset;
  p.quantize_from_fp32 = quantize_from_fp32;
  p.columnwise = columnwise;
  p.rule = static_cast<ScaleRule>(scale_rule);
  return p;
}

// The RMSNorm kernels' outputs: normed and the rowwise planes always, the columnwise planes when
// requested (null pointers otherwise). The residual (the gather's only) is left to the caller.
inline NormOut norm_outputs(ffi::Result<ffi::Buffer<ffi::BF16>>& normed,
                            ffi::Result<ffi::AnyBuffer>& row_q, ffi::Result<ffi::AnyBuffer>& row_s,
                            ffi::Result<ffi::AnyBuffer>& col_q, ffi::Result<ffi::AnyBuffer>& col_s,
                            bool columnwise) {
  NormOut o;
  o.normed = reinterpret_cast<uint16_t*>(normed->typed_data());
  o.row_q = bytes(row_q);
  o.row_s = bytes(row_s);
  if (columnwise) o.col_q = bytes(col_q), o.col_s = bytes(col_s);
  return o;
}

}  // namespace mxfp8
