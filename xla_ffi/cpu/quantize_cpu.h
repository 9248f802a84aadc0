// The CPU quantize of rows of a matrix into the planes (planes.h) a call asks for: the entry of
// the plain and packed-segment kernels (quantize.cc, quantize_segments.cc). Each 32-row band with
// columnwise output gives both planes from one read: the AVX2 band loop where the instruction set
// has one, the generic one otherwise.
//
// The headers below it, bottom first: target.h (how one build serves several instruction sets),
// quantize_vec.h (element types, scalar loops, vector operations), quantize_avx2.h and
// quantize_avx512.h (wide fast paths), quantize_isa.h (the instruction-set tags),
// quantize_loops.h (the loops, for any tag), quantize_band_avx2.h (the AVX2 band driver).
#pragma once

#include <cstdint>

#include "cpu/quantize_band_avx2.h"
#include "cpu/quantize_isa.h"
#include "cpu/quantize_loops.h"
#include "mxfp8/numerics.h"
#include "mxfp8/planes.h"

namespace mxfp8::cpu {

// Outputs (bytes of codes) from which a call streams its codes: writes them with non-temporal
// stores where a band loop can, since outputs this large are not read back from cache, and their
// lines are then not read before they are written.
constexpr int64_t kStreamBytes = int64_t{4} << 20;

// Rows [r0, r1) of an [M, K] matrix into the non-null planes of p. For columnwise output r0 and r1
// must be multiples of 32. stream: non-temporal stores for the codes (kStreamBytes).
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_rows(const typename Input<T>::Elem* x, int64_t r0, int64_t r1,
                                  int64_t K, const Planes& p, ScaleRule rule, bool stream) {
  if constexpr (Isa::kBand && (T == InType::kBF16 || T == InType::kF32)) {
    if (p.col_q) {
      for (int64_t r = r0; r < r1; r += kBlock)
        Isa::template band<T>(x + r * K, K, p.row_q ? p.row_q + r * K : nullptr,
                              p.row_q ? p.row_s + r * (K / kBlock) : nullptr, p.col_q + r * K,
                              p.col_s + (r / kBlock) * K, rule, stream);
      return;
    }
  }
  if (!p.col_q) {
    if (p.row_q)
      quantize_rowwise<T, Isa>(x + r0 * K, r1 - r0, K, p.row_q + r0 * K,
                               p.row_s + r0 * (K / kBlock), rule);
    return;
  }
  for (int64_t r = r0; r < r1; r += kBlock)
    quantize_band<T, Isa>(x + r * K, K, p.row_q ? p.row_q + r * K : nullptr,
                          p.row_q ? p.row_s + r * (K / kBlock) : nullptr, p.col_q + r * K,
                          p.col_s + (r / kBlock) * K, rule);
}

// quantize_rows for a runtime input type, built for each instruction set and run for the one
// selected in isa.h (by default the best this CPU has).
void quantize_rows_simd(InType t, const void* x, int64_t r0, int64_t r1, int64_t K, const Planes& p,
                        ScaleRule rule, bool stream);

}  // namespace mxfp8::cpu
