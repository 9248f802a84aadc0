// The quantize band loops compiled once per instruction set (baseline x86-64, AVX2, AVX-512) and
// run for the one isa.h selects. Numerics are identical: the loops use only integer operations
// and exactly rounded float operations on normal operands.
#include "cpu/isa.h"
#include "cpu/quantize_cpu.h"

namespace mxfp8::cpu {

namespace {

template <class Isa>
MXFP8_CPU_LOOP void rows_typed(InType t, const void* x, int64_t r0, int64_t r1, int64_t K,
                               const Planes& p, ScaleRule rule, bool stream) {
  switch (t) {
    case InType::kF32:
      quantize_rows<InType::kF32, Isa>(static_cast<const uint32_t*>(x), r0, r1, K, p, rule, stream);
      break;
    case InType::kBF16:
      quantize_rows<InType::kBF16, Isa>(static_cast<const uint16_t*>(x), r0, r1, K, p, rule,
                                        stream);
      break;
    case InType::kF16:
      quantize_rows<InType::kF16, Isa>(static_cast<const uint16_t*>(x), r0, r1, K, p, rule, stream);
      break;
  }
}

void rows_baseline(InType t, const void* x, int64_t r0, int64_t r1, int64_t K, const Planes& p,
                   ScaleRule rule, bool stream) {
  rows_typed<IsaBaseline>(t, x, r0, r1, K, p, rule, stream);
}

#if MXFP8_X86_BUILDS
MXFP8_TARGET_AVX2 void rows_avx2(InType t, const void* x, int64_t r0, int64_t r1, int64_t K,
                                 const Planes& p, ScaleRule rule, bool stream) {
  rows_typed<IsaAvx2>(t, x, r0, r1, K, p, rule, stream);
}

MXFP8_TARGET_AVX512 void rows_avx512(InType t, const void* x, int64_t r0, int64_t r1, int64_t K,
                                     const Planes& p, ScaleRule rule, bool stream) {
  rows_typed<IsaAvx512>(t, x, r0, r1, K, p, rule, stream);
}
#endif

}  // namespace

void quantize_rows_simd(InType t, const void* x, int64_t r0, int64_t r1, int64_t K, const Planes& p,
                        ScaleRule rule, bool stream) {
  switch (active_isa()) {
#if MXFP8_X86_BUILDS
    case CpuIsa::kAvx512: return rows_avx512(t, x, r0, r1, K, p, rule, stream);
    case CpuIsa::kAvx2: return rows_avx2(t, x, r0, r1, K, p, rule, stream);
#endif
    default: return rows_baseline(t, x, r0, r1, K, p, rule, stream);
  }
}

}  // namespace mxfp8::cpu
