// mxfp8_rmsnorm_quantize (CUDA / ROCm): RMSNorm of each row, then MXFP8 of the result.
// The FFI handler (handlers.cc) takes the operands, results and attributes of the CPU one
// (cpu/rmsnorm_quantize.cc):
//
// Operands: x [R, H] bf16, gamma [H] bf16.
// Results:  normed [R, H] bf16, row_q [R, H] e4m3, row_s [R, H/32] u8,
//           col_q [R, H] e4m3, col_s [R/32, H] u8 (zero-size uint8[0] unless columnwise).
//           e4m3 is float8_e4m3fn, as the Python wrapper declares the codes.
// Attributes: eps f32, weight_offset f32, quantize_from_fp32 bool, columnwise bool,
//             scale_rule i32 (0 rceil, 1 floor).
// normed = bf16_rne((x * inv) * (gamma + weight_offset)) in the order pinned in numerics.h;
// the quantized planes are those of normed (or of the unrounded fp32 value).
//
// The kernels (rmsnorm_kernels.cuh) read rows through a table of ranks: here one rank, x. The
// launcher of the in-process all-gather (allgather.cu holds its host protocol) is here too, so
// that both ops use one compiled set of kernels.
#include "gpu/rmsnorm_kernels.cuh"

namespace mxfp8::gpu {

const char* launch_rmsnorm_quantize(void* stream, const uint16_t* x, const uint16_t* gamma,
                                    int64_t R, const NormParams& prm, const NormOut& o) {
  GatherRows one;
  one.ranks = 1;
  one.base[0] = x;
  one.start[1] = R;
  NormOut local = o;
  local.residual = nullptr;  // the local op has no residual output
  return enqueue_rmsnorm_quantize(stream, RowTable{one, prm.H}, gamma, R, prm, local);
}

// The group's R rows, read from the ranks' inputs, and o.residual = those rows.
const char* launch_allgather_rmsnorm_quantize(void* stream, const GatherRows& rows,
                                              const uint16_t* gamma, int64_t R,
                                              const NormParams& prm, const NormOut& o) {
  return enqueue_rmsnorm_quantize(stream, RowTable{rows, prm.H}, gamma, R, prm, o);
}

}  // namespace mxfp8::gpu
