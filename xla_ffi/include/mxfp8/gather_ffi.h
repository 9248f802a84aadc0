// The XLA FFI side of mxfp8_allgather_rmsnorm_quantize, one definition for the CPU handler
// (cpu/allgather.cc) and the GPU one (gpu/handlers.cc): its signature, in which only the
// execution context differs (XLA:CPU's thread pool or the GPU stream), its argument check and
// the errors of a failed meeting. Operands, results and attributes are described in
// cpu/allgather.cc.
#pragma once

#include <cstdint>
#include <string>

#include "mxfp8/ffi_util.h"
#include "mxfp8/gather_args.h"
#include "mxfp8/rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace mxfp8 {

// The target's name, which starts its messages and names its meetings.
constexpr const char* kGatherTarget = "mxfp8_allgather_rmsnorm_quantize";

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

// One device's arguments checked (plan_gather, mxfp8/gather_args.h): fills *plan, or returns the
// rule they break as INVALID_ARGUMENT. where_host is the host copy of `where`'s values (the GPU
// handler copies them from the device).
inline ffi::Error check_gather_args(
    const ffi::Buffer<ffi::BF16>& x, const ffi::Buffer<ffi::BF16>& gamma,
    const ffi::Buffer<ffi::S32>& where, const int32_t* where_host, int64_t group_size,
    const ffi::Span<const int64_t>& row_counts, bool columnwise,
    ffi::Result<ffi::Buffer<ffi::BF16>>& normed, ffi::Result<ffi::AnyBuffer>& row_q,
    ffi::Result<ffi::AnyBuffer>& row_s, ffi::Result<ffi::AnyBuffer>& col_q,
    ffi::Result<ffi::AnyBuffer>& col_s, ffi::Result<ffi::Buffer<ffi::BF16>>& residual,
    GatherPlan* plan) {
  const GatherArgs args =
      read_gather_args(x, gamma, where, where_host, group_size, row_counts, columnwise, normed,
                       row_q, row_s, col_q, col_s, residual);
  if (std::string why = plan_gather(args, plan); !why.empty())
    return invalid(std::string(kGatherTarget) + ": " + why);
  return ffi::Error::Success();
}

// The error of a rank whose meeting with its peers failed: DEADLINE_EXCEEDED when some never
// came, INVALID_ARGUMENT when the group's calls disagree.
inline ffi::Error meeting_error(rendezvous::Failure failure, const std::string& why) {
  return ffi::Error(failure == rendezvous::Failure::kTimeout ? ffi::ErrorCode::kDeadlineExceeded
                                                             : ffi::ErrorCode::kInvalidArgument,
                    why);
}

}  // namespace mxfp8
