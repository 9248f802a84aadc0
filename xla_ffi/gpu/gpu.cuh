// The GPU platform layer shared by the CUDA and HIP builds of the kernels in this folder:
// runtime API names, lane exchange and votes with explicit widths, thread indices, and the
// launch-status helper of the launchers declared in launch.h.
//
// Built as CUDA by nvcc (_mxfp8_cuda) and as HIP by clang -x hip (_mxfp8_rocm, through
// hip_compat.h). Kernels use 32-lane groups at most, so they behave the same on 32-lane warps
// and 64-lane wavefronts.
#pragma once

#if defined(__HIPCC__)
#include "gpu/hip_compat.h"
#else
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <string>

#include "gpu/launch.h"
#include "mxfp8/numerics.h"

namespace mxfp8::gpu {

#if !defined(__HIPCC__)
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask, int width) {
  return __shfl_xor_sync(0xFFFFFFFFu, v, mask, width);
}
__device__ __forceinline__ bool any_lane(bool pred) { return __any_sync(0xFFFFFFFFu, pred); }
__device__ __forceinline__ void block_sync() { __syncthreads(); }
#endif

// Flat thread index of a 1-D launch (64-bit: grids cover more than 2^31 threads' work).
// On HIP the workitem builtins avoid the device-library calls behind threadIdx/blockIdx.
__device__ __forceinline__ int64_t global_thread(int block_threads) {
#if defined(__HIPCC__)
  return static_cast<int64_t>(__builtin_amdgcn_workgroup_id_x()) * block_threads +
         __builtin_amdgcn_workitem_id_x();
#else
  return static_cast<int64_t>(blockIdx.x) * block_threads + threadIdx.x;
#endif
}

__device__ __forceinline__ int thread_in_block() {
#if defined(__HIPCC__)
  return static_cast<int>(__builtin_amdgcn_workitem_id_x());
#else
  return static_cast<int>(threadIdx.x);
#endif
}

__device__ __forceinline__ int64_t block_index() {
#if defined(__HIPCC__)
  return __builtin_amdgcn_workgroup_id_x();
#else
  return blockIdx.x;
#endif
}

__device__ __forceinline__ float f32(uint32_t bits) { return __uint_as_float(bits); }
__device__ __forceinline__ uint32_t bits(float f) { return __float_as_uint(f); }

// ---------------------------------------------------------------------------------------------
// Host side.

// The launch status is the runtime's per-thread "last error", which every failed runtime call
// also sets and only a read clears. XLA's thread may carry one from a harmless earlier call
// (hipErrorNotReady from a query, peer access already enabled; from ROCm 7 HIP keeps them
// pending), so each launcher clears it before its first launch and reads it after the last.
inline void clear_pending_error() { (void)cudaGetLastError(); }

// nullptr when the kernels just enqueued launched, else the runtime's message.
inline const char* launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int kBlockThreads = 128;

// Most blocks a 1-D grid of kBlockThreads may have: CUDA's gridDim.x limit (2^31 - 1); HIP counts
// the grid in work-items, at most 2^32 - 1 of them. <<<>>> takes unsigned int, so a larger
// int64 count would be truncated silently: launchers check it first.
#if defined(__HIPCC__)
constexpr int64_t kMaxGridBlocks = ((int64_t{1} << 32) - 1) / kBlockThreads;
#else
constexpr int64_t kMaxGridBlocks = (int64_t{1} << 31) - 1;
#endif

inline bool grid_fits(int64_t blocks) { return blocks <= kMaxGridBlocks; }

constexpr const char* kGridTooLarge =
    "the input needs more thread blocks than one 1-D grid launch allows; split it into "
    "smaller calls";

}  // namespace mxfp8::gpu
