// The GPU kernels' device code built by the host compiler on HIP-CPU, for the tests only
// (tests/test_hipcpu.py). HIP-CPU is ROCm's header-only HIP runtime for CPUs: a kernel's blocks
// run on a thread pool, each block's threads as fibers that switch at every barrier and lane
// exchange. It is found at test time and is no part of the package.
//
// This header is what both vendor paths need on top of it; cuda.h and rocm.h include it first
// and then map their path's names. The build force-includes one of them before the sources
// (-include hipcpu/cuda.h or hipcpu/rocm.h), and the sources see MXFP8_HIPCPU in three places:
// gpu.cuh's choice of runtime header and its launch form, and the two instructions of
// tile.cuh's fast form.
#pragma once

#include <hip/hip_runtime.h>

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#define MXFP8_HIPCPU 1

// HIP-CPU's function keywords, adjusted: its __device__ and __global__ ask GCC for SIMD clones of
// every function (which only slows the build), and its __forceinline__ is empty without NDEBUG
// (numerics.h's functions would then be defined, not inline, in every translation unit).
// __noinline__ is a keyword of the GPU compilers; it is defined here, after the standard headers,
// some of which spell the attribute __noinline__ themselves.
#undef __device__
#define __device__
#undef __global__
#define __global__
#undef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))

// The device arithmetic both GPU compilers provide: correctly rounded fp32 operations (here the
// host's IEEE ones: the build has no fast-math and no contraction), bit casts, unsigned max.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
// HIP-CPU's __clzll takes int64_t or uint64_t, which a long long argument cannot choose between.
inline int __clzll(long long x) { return __builtin_clzll(static_cast<unsigned long long>(x)); }

namespace mxfp8::hipcpu {

// IEEE arithmetic on the calling thread: round to nearest even, subnormals neither flushed nor
// read as zero. The GPU kernels are compiled without flush-to-zero; a CPU thread may have it
// set (XLA:CPU's do), so every kernel sets this itself.
inline void ieee_fp_env() {
  std::fesetround(FE_TONEAREST);
#if defined(__x86_64__) || defined(__i386__)
  constexpr unsigned kFlushToZero = 0x8000u, kDenormalsAreZero = 0x0040u;
  _mm_setcsr(_mm_getcsr() & ~(kFlushToZero | kDenormalsAreZero));
#endif
}

// gpu.cuh's launch_kernel: kernel on `blocks` blocks of `threads` threads, enqueued on `stream`,
// each thread first setting the IEEE environment.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t blocks, int threads, hipStream_t stream,
            const Args&... args) {
  const auto entry = [kernel](Params... xs) {
    ieee_fp_env();
    kernel(xs...);
  };
  hipLaunchKernelGGL(entry, dim3(static_cast<uint32_t>(blocks)), dim3(threads), 0, stream,
                     static_cast<Params>(args)...);
}

}  // namespace mxfp8::hipcpu
