// mxfp8_rmsnorm_quantize (CPU): RMSNorm of each row, then MXFP8 of the result, in one pass.
//
// Operands: x [R, H] bf16, gamma [H] bf16.
// Results:  normed [R, H] bf16, row_q [R, H] e4m3, row_s [R, H/32] u8,
//           col_q [R, H] e4m3, col_s [R/32, H] u8 (zero-size uint8[0] unless columnwise).
//           e4m3 is float8_e4m3fn, as the Python wrapper declares the codes.
// Attributes: eps f32, weight_offset f32, quantize_from_fp32 bool, columnwise bool,
//             scale_rule i32 (0 rceil, 1 floor).
// normed = bf16_rne((x * inv) * (gamma + weight_offset)) in the order pinned in numerics.h;
// the quantized planes are those of normed (or of the unrounded fp32 value).
#include <vector>

#include "cpu/fp_env.h"
#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/rmsnorm_cpu.h"
#include "mxfp8/ffi_util.h"
#include "mxfp8/quantize_args.h"
#include "mxfp8/quantize_ffi.h"

namespace mxfp8::cpu {

namespace {

void rows_baseline(const uint16_t* const* rows, int64_t r0, int64_t r1, const float* g,
                   const NormParams& p, const NormOut& o, uint32_t* scratch) {
  rmsnorm_quantize_rows<IsaBaseline>(rows, r0, r1, g, p, o, scratch);
}

#if MXFP8_X86_BUILDS
MXFP8_TARGET_AVX2 void rows_avx2(const uint16_t* const* rows, int64_t r0, int64_t r1,
                                 const float* g, const NormParams& p, const NormOut& o,
                                 uint32_t* scratch) {
  rmsnorm_quantize_rows<IsaAvx2>(rows, r0, r1, g, p, o, scratch);
}

MXFP8_TARGET_AVX512 void rows_avx512(const uint16_t* const* rows, int64_t r0, int64_t r1,
                                     const float* g, const NormParams& p, const NormOut& o,
                                     uint32_t* scratch) {
  rmsnorm_quantize_rows<IsaAvx512>(rows, r0, r1, g, p, o, scratch);
}
#endif

}  // namespace

void rmsnorm_quantize_rows_simd(const uint16_t* const* rows, int64_t r0, int64_t r1, const float* g,
                                const NormParams& p, const NormOut& o, uint32_t* scratch) {
  switch (active_isa()) {
#if MXFP8_X86_BUILDS
    case CpuIsa::kAvx512: return rows_avx512(rows, r0, r1, g, p, o, scratch);
    case CpuIsa::kAvx2: return rows_avx2(rows, r0, r1, g, p, o, scratch);
#endif
    default: return rows_baseline(rows, r0, r1, g, p, o, scratch);
  }
}

static ffi::Error RmsnormQuantize(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                                  ffi::Buffer<ffi::BF16> gamma,
                                  ffi::Result<ffi::Buffer<ffi::BF16>> normed,
                                  ffi::Result<ffi::AnyBuffer> row_q,
                                  ffi::Result<ffi::AnyBuffer> row_s,
                                  ffi::Result<ffi::AnyBuffer> col_q,
                                  ffi::Result<ffi::AnyBuffer> col_s, float eps, float weight_offset,
                                  bool quantize_from_fp32, bool columnwise, int32_t scale_rule) {
  RmsnormQuantizeArgs a;
  ffi::Error e =
      check_rmsnorm_quantize_args(x, gamma, normed, row_q, row_s, col_q, col_s, columnwise, &a);
  if (e.failure()) return e;
  const int64_t R = a.R, H = a.H;
  if (R == 0) return ffi::Error::Success();

  const NormParams p =
      norm_params(H, eps, weight_offset, quantize_from_fp32, columnwise, scale_rule);
  const NormOut o = norm_outputs(normed, row_q, row_s, col_q, col_s, columnwise);

  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  std::vector<float> g;
  {
    ScopedIeeeFp ieee;  // gamma + offset may be subnormal
    g = gamma_plus_offset(reinterpret_cast<const uint16_t*>(gamma.typed_data()), H,
                          p.weight_offset);
  }
  // Items of about 64 KiB of input (whole 32-row bands for columnwise planes).
  const int64_t rows_per_item =
      columnwise ? kBlock : std::max<int64_t>(1, (int64_t{1} << 16) / (2 * H));
  const int64_t items = (R + rows_per_item - 1) / rows_per_item;
  std::vector<const uint16_t*> rows(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) rows[r] = xp + r * H;
  parallel_for(pool, items, 1, [&](int64_t i) {
    ScopedIeeeFp ieee;
    std::vector<uint32_t> scratch(rows_scratch_words(p));
    const int64_t r0 = i * rows_per_item, r1 = std::min(R, r0 + rows_per_item);
    rmsnorm_quantize_rows_simd(rows.data(), r0, r1, g.data(), p, o, scratch.data());
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsnormQuantizeHandler, RmsnormQuantize,
                              rmsnorm_quantize_binding<ffi::ThreadPool>());

}  // namespace mxfp8::cpu
