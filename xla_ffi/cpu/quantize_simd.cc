// The quantize band loops compiled twice: for AVX2 (8 lanes of 32-bit integer work) and for the
// baseline x86-64 ISA; the loader picks one by the CPU's features. Numerics are identical: the
// loops use only integer operations and exactly rounded float operations on normal operands.
#include "cpu/quantize_cpu.h"

namespace mxfp8::cpu {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MXFP8_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MXFP8_SIMD_CLONES
#endif

MXFP8_SIMD_CLONES void quantize_rows_simd(InType t, const void* x, int64_t r0, int64_t r1,
                                          int64_t K, const Planes& p, ScaleRule rule) {
  switch (t) {
    case InType::kF32:
      quantize_rows<InType::kF32>(static_cast<const uint32_t*>(x), r0, r1, K, p, rule);
      break;
    case InType::kBF16:
      quantize_rows<InType::kBF16>(static_cast<const uint16_t*>(x), r0, r1, K, p, rule);
      break;
    case InType::kF16:
      quantize_rows<InType::kF16>(static_cast<const uint16_t*>(x), r0, r1, K, p, rule);
      break;
  }
}

}  // namespace mxfp8::cpu
