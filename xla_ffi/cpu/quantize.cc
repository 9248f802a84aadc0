// mxfp8_quantize (CPU): rowwise and/or columnwise planes of an [M, K] input in one pass.
//
// Operands: x [..., K] (f32 / bf16 / f16; leading axes are rows).
// Results:  row_q [M, K] e4m3, row_s [M, K/32] u8, col_q [M, K] e4m3, col_s [M/32, K] u8
//           (E4M3 codes as float8_e4m3fn, E8M0 scales as uint8: the types the Python wrapper
//           declares; the handler checks sizes in bytes only).
// An unrequested plane is passed as a zero-size result and left alone.
#include "cpu/parallel.h"
#include "cpu/quantize_cpu.h"
#include "mxfp8/ffi_util.h"
#include "mxfp8/quantize_args.h"
#include "mxfp8/quantize_ffi.h"

namespace mxfp8::cpu {

static ffi::Error Quantize(ffi::ThreadPool pool, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
                           ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
                           int32_t scale_rule, bool rowwise, bool columnwise) {
  QuantizeArgs a;
  ffi::Error e = check_quantize_args(x, row_q, row_s, col_q, col_s, rowwise, columnwise, &a);
  if (e.failure()) return e;
  const InType t = a.t;
  const int64_t M = a.M, K = a.K;
  const Planes p = requested_planes(rowwise, columnwise, row_q, row_s, col_q, col_s);
  const bool stream = (int64_t{rowwise} + int64_t{columnwise}) * M * K >= kStreamBytes;
  const ScaleRule rule = static_cast<ScaleRule>(scale_rule);
  const int64_t bands = (M + kBlock - 1) / kBlock;
  // About 64 KiB of input per item keeps scheduling overhead small.
  const int64_t min_bands = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kBlock * K * 2));
  const void* xp = x.untyped_data();
  parallel_for(pool, bands, min_bands, [&](int64_t b) {
    quantize_rows_simd(t, xp, b * kBlock, std::min<int64_t>(M, (b + 1) * kBlock), K, p, rule,
                       stream);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeHandler, Quantize, quantize_binding<ffi::ThreadPool>());

}  // namespace mxfp8::cpu
