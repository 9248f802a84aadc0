// CUDA -> HIP compatibility for the kernels in this folder: the same sources compile as HIP
// (`clang -x hip`) for AMD GPUs. Only what those sources use is mapped.
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
#define cudaMemsetAsync hipMemsetAsync
// ... and what the all-gather's host protocol needs (allgather.cu).
using cudaEvent_t = hipEvent_t;
using cudaPointerAttributes = hipPointerAttribute_t;
#define cudaErrorPeerAccessAlreadyEnabled hipErrorPeerAccessAlreadyEnabled
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaPointerGetAttributes hipPointerGetAttributes
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaDeviceCanAccessPeer hipDeviceCanAccessPeer
#define cudaDeviceEnablePeerAccess hipDeviceEnablePeerAccess
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventRecord hipEventRecord
#define cudaEventDestroy hipEventDestroy
#define cudaStreamWaitEvent hipStreamWaitEvent
using cudaMemPool_t = hipMemPool_t;
using cudaMemAccessDesc = hipMemAccessDesc;
#define cudaMemLocationTypeDevice hipMemLocationTypeDevice
#define cudaMemAccessFlagsProtReadWrite hipMemAccessFlagsProtReadWrite
#define cudaMemPoolSetAccess hipMemPoolSetAccess

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
