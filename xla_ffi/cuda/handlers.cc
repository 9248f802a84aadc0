// The XLA FFI handlers of the GPU modules (_mxfp8_cuda, and _mxfp8_rocm from the same source):
// decode and check the buffers, then call the kernel launchers of launch.h. Host C++ only; the
// stream arrives as the platform's opaque stream pointer (cudaStream_t or hipStream_t).
//
// Operands, results and attributes are those of the CPU handlers (xla_ffi/README.md).
#include <cstddef>
#include <string>

#include "cuda/launch.h"
#include "xla/ffi/api/ffi.h"

namespace mxfp8::gpu {
namespace {

namespace ffi = xla::ffi;

bool input_type(ffi::DataType t, InType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = InType::kF32; return true;
    case ffi::DataType::BF16: *out = InType::kBF16; return true;
    case ffi::DataType::F16: *out = InType::kF16; return true;
    default: return false;
  }
}

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

ffi::Error status(const char* target, const char* launch_error) {
  if (launch_error == nullptr) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(target) + ": kernel launch failed: " + launch_error);
}

uint8_t* bytes(ffi::Result<ffi::AnyBuffer>& r) { return static_cast<uint8_t*>(r->untyped_data()); }

bool plane_sizes_ok(size_t n, bool rowwise, bool columnwise, ffi::Result<ffi::AnyBuffer>& row_q,
                    ffi::Result<ffi::AnyBuffer>& row_s, ffi::Result<ffi::AnyBuffer>& col_q,
                    ffi::Result<ffi::AnyBuffer>& col_s) {
  return !((rowwise && (row_q->size_bytes() != n || row_s->size_bytes() != n / kBlock)) ||
           (columnwise && (col_q->size_bytes() != n || col_s->size_bytes() != n / kBlock)));
}

Planes planes(bool rowwise, bool columnwise, ffi::Result<ffi::AnyBuffer>& row_q,
              ffi::Result<ffi::AnyBuffer>& row_s, ffi::Result<ffi::AnyBuffer>& col_q,
              ffi::Result<ffi::AnyBuffer>& col_s) {
  Planes p;
  if (rowwise) p.row_q = bytes(row_q), p.row_s = bytes(row_s);
  if (columnwise) p.col_q = bytes(col_q), p.col_s = bytes(col_s);
  return p;
}

ffi::Error Quantize(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> row_q,
                    ffi::Result<ffi::AnyBuffer> row_s, ffi::Result<ffi::AnyBuffer> col_q,
                    ffi::Result<ffi::AnyBuffer> col_s, int32_t scale_rule, bool rowwise,
                    bool columnwise) {
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
  if (n == 0 || !(rowwise || columnwise)) return ffi::Error::Success();
  return status("mxfp8_quantize",
                launch_quantize(stream, t, static_cast<const uint8_t*>(x.untyped_data()), M, K,
                                planes(rowwise, columnwise, row_q, row_s, col_q, col_s),
                                static_cast<ScaleRule>(scale_rule)));
}

ffi::Error QuantizeSegments(void* stream, ffi::AnyBuffer x, ffi::AnyBuffer desc,
                            ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
                            ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
                            int32_t scale_rule, bool rowwise, bool columnwise) {
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
  if (S == 0 || !(rowwise || columnwise)) return ffi::Error::Success();
  return status("mxfp8_quantize_segments",
                launch_quantize_segments(
                    stream, t, static_cast<const uint8_t*>(x.untyped_data()), S,
                    desc.untyped_data(), desc64, ddims[0],
                    planes(rowwise, columnwise, row_q, row_s, col_q, col_s),
                    static_cast<ScaleRule>(scale_rule)));
}

ffi::Error RmsnormQuantize(void* stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gamma,
                           ffi::Result<ffi::Buffer<ffi::BF16>> normed,
                           ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
                           ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
                           float eps, float weight_offset, bool quantize_from_fp32,
                           bool columnwise, int32_t scale_rule) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("mxfp8_rmsnorm_quantize: x must be [R, H]");
  const int64_t R = dims[0], H = dims[1];
  if (H % kBlock) return invalid("mxfp8_rmsnorm_quantize: H must be a multiple of 32");
  if (gamma.element_count() != static_cast<size_t>(H))
    return invalid("mxfp8_rmsnorm_quantize: gamma must be [H]");
  if (columnwise && R % kBlock)
    return invalid("mxfp8_rmsnorm_quantize: R must be a multiple of 32 for columnwise output");
  const size_t n = static_cast<size_t>(R * H);
  if (normed->element_count() != n || !plane_sizes_ok(n, true, columnwise, row_q, row_s, col_q, col_s))
    return invalid("mxfp8_rmsnorm_quantize: result sizes do not match x");
  if (n == 0) return ffi::Error::Success();

  NormParams prm;
  prm.H = H;
  prm.eps = eps;
  prm.weight_offset = weight_offset;
  prm.rule = static_cast<ScaleRule>(scale_rule);
  NormOut o;
  o.normed = reinterpret_cast<uint16_t*>(normed->typed_data());
  o.row_q = bytes(row_q);
  o.row_s = bytes(row_s);
  if (columnwise) o.col_q = bytes(col_q), o.col_s = bytes(col_s);
  return status("mxfp8_rmsnorm_quantize",
                launch_rmsnorm_quantize(stream, reinterpret_cast<const uint16_t*>(x.typed_data()),
                                        reinterpret_cast<const uint16_t*>(gamma.typed_data()), R,
                                        prm, o, columnwise, quantize_from_fp32));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeHandler, Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("scale_rule")
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("columnwise"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeSegmentsHandler, QuantizeSegments,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("scale_rule")
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("columnwise"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsnormQuantizeHandler, RmsnormQuantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset")
                                  .Attr<bool>("quantize_from_fp32")
                                  .Attr<bool>("columnwise")
                                  .Attr<int32_t>("scale_rule"));

}  // namespace mxfp8::gpu
