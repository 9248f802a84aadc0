// The argument checks of mxfp8_quantize, mxfp8_quantize_tiles, mxfp8_quantize_segments and
// mxfp8_rmsnorm_quantize, one function per target that the CPU handler (cpu/*.cc) and the GPU one
// (gpu/handlers.cc) both call: the same rules, in the same order, with the same messages, and the
// sizes they decode. What a handler does with an empty call is its own (each returns early where
// its kernels need it). Host code of the handlers only: the kernels never see an XLA header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mxfp8/ffi_util.h"
#include "mxfp8/numerics.h"
#include "xla/ffi/api/ffi.h"

namespace mxfp8 {

// mxfp8_quantize: x [..., K] read as [M, K].
struct QuantizeArgs {
  InType t = InType::kF32;
  int64_t M = 0, K = 0;
  size_t n = 0;  // M * K elements
};

inline ffi::Error check_quantize_args(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& row_q,
                                      ffi::Result<ffi::AnyBuffer>& row_s,
                                      ffi::Result<ffi::AnyBuffer>& col_q,
                                      ffi::Result<ffi::AnyBuffer>& col_s, bool rowwise,
                                      bool columnwise, QuantizeArgs* a) {
  InType t;
  if (!input_type(x.element_type(), &t))
    return invalid("mxfp8_quantize: input must be f32, bf16 or f16");
  const auto dims = x.dimensions();
  if (dims.size() < 2) return invalid("mxfp8_quantize: input must have rank >= 2");
  const int64_t K = dims.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / (K ? K : 1);
  if (K % kBlock) return invalid("mxfp8_quantize: K must be a multiple of 32");
  if (columnwise && M % kBlock) return invalid("mxfp8_quantize: M must be a multiple of 32");
  const size_t n = static_cast<size_t>(M * K);
  if (!plane_sizes_ok(n, rowwise, columnwise, row_q, row_s, col_q, col_s))
    return invalid("mxfp8_quantize: result sizes do not match the input");
  *a = {t, M, K, n};
  return ffi::Error::Success();
}

// mxfp8_quantize_tiles: x [..., K] read as [M, K], one scale per 32x32 tile.
struct QuantizeTilesArgs {
  InType t = InType::kF32;
  int64_t M = 0, K = 0;
  size_t n = 0;  // M * K elements
};

inline ffi::Error check_quantize_tiles_args(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& q,
                                            ffi::Result<ffi::AnyBuffer>& s, QuantizeTilesArgs* a) {
  InType t;
  if (!input_type(x.element_type(), &t))
    return invalid("mxfp8_quantize_tiles: input must be f32, bf16 or f16");
  const auto dims = x.dimensions();
  if (dims.size() < 2) return invalid("mxfp8_quantize_tiles: input must have rank >= 2");
  const int64_t K = dims.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / (K ? K : 1);
  if (K % kBlock || M % kBlock)
    return invalid("mxfp8_quantize_tiles: M and K must be multiples of 32");
  const size_t n = static_cast<size_t>(M * K);
  if (q->size_bytes() != n || s->size_bytes() != n / (kBlock * kBlock))
    return invalid("mxfp8_quantize_tiles: result sizes do not match the input");
  *a = {t, M, K, n};
  return ffi::Error::Success();
}

// mxfp8_quantize_segments: a flat segment x [S] and its descriptor table desc [P, 3], whose
// rows the caller reads (the CPU handler checks them; the GPU kernels skip bad ones).
struct QuantizeSegmentsArgs {
  InType t = InType::kF32;
  int64_t S = 0;        // elements of the segment
  int64_t P = 0;        // rows of desc
  bool desc64 = false;  // desc is int64 (else int32)
};

inline ffi::Error check_quantize_segments_args(const ffi::AnyBuffer& x, const ffi::AnyBuffer& desc,
                                               ffi::Result<ffi::AnyBuffer>& row_q,
                                               ffi::Result<ffi::AnyBuffer>& row_s,
                                               ffi::Result<ffi::AnyBuffer>& col_q,
                                               ffi::Result<ffi::AnyBuffer>& col_s, bool rowwise,
                                               bool columnwise, QuantizeSegmentsArgs* a) {
  InType t;
  if (!input_type(x.element_type(), &t))
    return invalid("mxfp8_quantize_segments: input must be f32, bf16 or f16");
  if (x.dimensions().size() != 1) return invalid("mxfp8_quantize_segments: x must be 1-D");
  const int64_t S = static_cast<int64_t>(x.element_count());
  if (S % kBlock)
    return invalid("mxfp8_quantize_segments: segment length must be a multiple of 32");
  const auto ddims = desc.dimensions();
  if (ddims.size() != 2 || ddims[1] != 3)
    return invalid("mxfp8_quantize_segments: desc must have shape [P, 3]");
  const bool desc64 = desc.element_type() == ffi::DataType::S64;
  if (!desc64 && desc.element_type() != ffi::DataType::S32)
    return invalid("mxfp8_quantize_segments: desc must be int64 or int32");
  if (!plane_sizes_ok(static_cast<size_t>(S), rowwise, columnwise, row_q, row_s, col_q, col_s))
    return invalid("mxfp8_quantize_segments: result sizes do not match the segment");
  *a = {t, S, ddims[0], desc64};
  return ffi::Error::Success();
}

// mxfp8_rmsnorm_quantize: x [R, H] and gamma [H], bf16 both (the binding types them).
struct RmsnormQuantizeArgs {
  int64_t R = 0, H = 0;
  size_t n = 0;  // R * H elements
};

inline ffi::Error check_rmsnorm_quantize_args(
    const ffi::Buffer<ffi::BF16>& x, const ffi::Buffer<ffi::BF16>& gamma,
    ffi::Result<ffi::Buffer<ffi::BF16>>& normed, ffi::Result<ffi::AnyBuffer>& row_q,
    ffi::Result<ffi::AnyBuffer>& row_s, ffi::Result<ffi::AnyBuffer>& col_q,
    ffi::Result<ffi::AnyBuffer>& col_s, bool columnwise, RmsnormQuantizeArgs* a) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("mxfp8_rmsnorm_quantize: x must be [R, H]");
  const int64_t R = dims[0], H = dims[1];
  if (H % kBlock) return invalid("mxfp8_rmsnorm_quantize: H must be a multiple of 32");
  if (gamma.element_count() != static_cast<size_t>(H))
    return invalid("mxfp8_rmsnorm_quantize: gamma must be [H]");
  if (columnwise && R % kBlock)
    return invalid("mxfp8_rmsnorm_quantize: R must be a multiple of 32 for columnwise output");
  const size_t n = static_cast<size_t>(R * H);
  if (normed->element_count() != n ||
      !plane_sizes_ok(n, true, columnwise, row_q, row_s, col_q, col_s))
    return invalid("mxfp8_rmsnorm_quantize: result sizes do not match x");
  *a = {R, H, n};
  return ffi::Error::Success();
}

}  // namespace mxfp8
