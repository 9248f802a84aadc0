// XLA:CPU runs custom calls with flush-to-zero and denormals-are-zero set. Kernels whose math
// is in floating point (RMSNorm) switch to IEEE behaviour for their own duration with this
// guard, so that subnormal squares and products are kept, as on GPUs.
#pragma once

#include <cstdint>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace mxfp8::cpu {

class ScopedIeeeFp {
 public:
  ScopedIeeeFp() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // clear FTZ and DAZ
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr &= ~(uint64_t{1} << 24);  // clear FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~ScopedIeeeFp() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedIeeeFp(const ScopedIeeeFp&) = delete;
  ScopedIeeeFp& operator=(const ScopedIeeeFp&) = delete;

 private:
  uint64_t saved_ = 0;
};

}  // namespace mxfp8::cpu
