// The XLA FFI signature of mxfp8_allgather_rmsnorm_quantize, one definition for the CPU handler
// (cpu/allgather.cc) and the GPU one (gpu/handlers.cc): only the execution context differs,
// XLA:CPU's thread pool or the GPU stream. Operands, results and attributes are described in
// cpu/allgather.cc.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace mxfp8 {

// (`.template`: every call after the first depends on Context.)
template <typename Context>
auto gather_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Ctx<ffi::RunId>()
      .template Arg<ffi::Buffer<ffi::BF16>>()  // x
      .template Arg<ffi::Buffer<ffi::BF16>>()  // gamma
      .template Arg<ffi::Buffer<ffi::S32>>()   // where
      .template Ret<ffi::Buffer<ffi::BF16>>()  // normed
      .template Ret<ffi::AnyBuffer>()          // row_q
      .template Ret<ffi::AnyBuffer>()          // row_s
      .template Ret<ffi::AnyBuffer>()          // col_q
      .template Ret<ffi::AnyBuffer>()          // col_s
      .template Ret<ffi::Buffer<ffi::BF16>>()  // residual
      .template Attr<int64_t>("op_id")
      .template Attr<int64_t>("group_size")
      .template Attr<ffi::Span<const int64_t>>("row_counts")
      .template Attr<float>("eps")
      .template Attr<float>("weight_offset")
      .template Attr<bool>("quantize_from_fp32")
      .template Attr<bool>("columnwise")
      .template Attr<int32_t>("scale_rule")
      .template Attr<int64_t>("timeout_ms");
}

}  // namespace mxfp8
