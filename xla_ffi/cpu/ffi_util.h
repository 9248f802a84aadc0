// Small helpers shared by the CPU handlers: dtype dispatch and argument checks.
#pragma once

#include <cstdint>
#include <string>

#include "cpu/quantize_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace mxfp8::cpu {

namespace ffi = xla::ffi;

inline bool input_type(ffi::DataType t, InType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = InType::kF32; return true;
    case ffi::DataType::BF16: *out = InType::kBF16; return true;
    case ffi::DataType::F16: *out = InType::kF16; return true;
    default: return false;
  }
}

// Calls fn.template operator()<T>() for the runtime input type.
template <typename Fn>
void dispatch(InType t, Fn&& fn) {
  switch (t) {
    case InType::kF32: fn.template operator()<InType::kF32>(); break;
    case InType::kBF16: fn.template operator()<InType::kBF16>(); break;
    case InType::kF16: fn.template operator()<InType::kF16>(); break;
  }
}

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

inline uint8_t* bytes(ffi::Result<ffi::AnyBuffer>& r) {
  return static_cast<uint8_t*>(r->untyped_data());
}

}  // namespace mxfp8::cpu
