// The XLA FFI signatures of mxfp8_quantize, mxfp8_quantize_tiles, mxfp8_quantize_segments and
// mxfp8_rmsnorm_quantize, one definition each for the CPU handlers (cpu/*.cc) and the GPU ones
// (gpu/handlers.cc): only the execution context differs, XLA:CPU's thread pool or the GPU stream.
// Operands, results and attributes are described in cpu/quantize.cc, cpu/quantize_tiles.cc,
// cpu/quantize_segments.cc and cpu/rmsnorm_quantize.cc.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace mxfp8 {

// (`.template`: every call after the first depends on Context.)
template <typename Context>
auto quantize_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()  // x
      .template Ret<ffi::AnyBuffer>()  // row_q
      .template Ret<ffi::AnyBuffer>()  // row_s
      .template Ret<ffi::AnyBuffer>()  // col_q
      .template Ret<ffi::AnyBuffer>()  // col_s
      .template Attr<int32_t>("scale_rule")
      .template Attr<bool>("rowwise")
      .template Attr<bool>("columnwise");
}

template <typename Context>
auto quantize_tiles_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()  // x
      .template Ret<ffi::AnyBuffer>()  // q
      .template Ret<ffi::AnyBuffer>()  // s
      .template Attr<int32_t>("scale_rule");
}

template <typename Context>
auto quantize_segments_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // desc
      .template Ret<ffi::AnyBuffer>()  // row_q
      .template Ret<ffi::AnyBuffer>()  // row_s
      .template Ret<ffi::AnyBuffer>()  // col_q
      .template Ret<ffi::AnyBuffer>()  // col_s
      .template Attr<int32_t>("scale_rule")
      .template Attr<bool>("rowwise")
      .template Attr<bool>("columnwise");
}

template <typename Context>
auto rmsnorm_quantize_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::Buffer<ffi::BF16>>()  // x
      .template Arg<ffi::Buffer<ffi::BF16>>()  // gamma
      .template Ret<ffi::Buffer<ffi::BF16>>()  // normed
      .template Ret<ffi::AnyBuffer>()          // row_q
      .template Ret<ffi::AnyBuffer>()          // row_s
      .template Ret<ffi::AnyBuffer>()          // col_q
      .template Ret<ffi::AnyBuffer>()          // col_s
      .template Attr<float>("eps")
      .template Attr<float>("weight_offset")
      .template Attr<bool>("quantize_from_fp32")
      .template Attr<bool>("columnwise")
      .template Attr<int32_t>("scale_rule");
}

}  // namespace mxfp8
