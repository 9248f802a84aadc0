// CUDA -> HIP compatibility for the kernels in this folder: the same sources compile as HIP
// (`clang -x hip`) for AMD GPUs. Only what the kernels and launchers use is mapped (the
// all-gather's host protocol maps its own runtime calls: allgather.cu).
//
// Wavefronts are 64 lanes on gfx9 (MI300/MI350). The kernels never assume 64: every
// cross-lane operation names its width (32 or less), so a wavefront holds two independent
// 32-lane groups and the RMSNorm reduction order pinned in numerics.h is kept bit for bit.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>

// Runtime API.
using cudaStream_t = hipStream_t;
using cudaError_t = hipError_t;
#define cudaSuccess hipSuccess
#define cudaGetLastError hipGetLastError
#define cudaGetErrorString hipGetErrorString

// Exact arithmetic. numerics.h asks for IEEE-correct sqrt through __fsqrt_rn; older HIP headers
// define that as the native (approximate) square root, so it is redirected to the correctly
// rounded builtin. __clzll is redirected to the compiler builtin (no device library call).
__device__ __forceinline__ float mxfp8_hip_fsqrt_rn(float x) { return __builtin_sqrtf(x); }
__device__ __forceinline__ int mxfp8_hip_clzll(long long x) {
  return __builtin_clzll(static_cast<unsigned long long>(x));
}
#define __fsqrt_rn mxfp8_hip_fsqrt_rn
#define __clzll mxfp8_hip_clzll

namespace mxfp8::gpu {

// Lane exchange within groups of `width` lanes (width a power of two <= 32).
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask, int width) {
  return __shfl_xor(v, mask, width);
}

// True on every lane of the wavefront when pred is true on any of them.
__device__ __forceinline__ bool any_lane(bool pred) { return __any(pred); }

// __syncthreads without the device-library fence call of older HIP headers.
__device__ __forceinline__ void block_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

}  // namespace mxfp8::gpu
