// How the CPU kernels are compiled for several instruction sets in one build. On x86-64 with
// GCC or Clang every kernel entry point is compiled for the baseline and, through target
// attributes, for AVX2 and AVX-512 (F, BW, VL); isa.h selects one at run time. The loops are
// force-inlined into those entry points, so that each gets code for its own instruction set.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MXFP8_X86_BUILDS 1
#include <immintrin.h>
#define MXFP8_TARGET_AVX2 __attribute__((target("avx2")))
#define MXFP8_TARGET_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512vl")))
#else
#define MXFP8_X86_BUILDS 0
#endif

// A loop compiled into each caller, for the caller's target.
#define MXFP8_CPU_LOOP inline __attribute__((always_inline))
