// The GPU platform layer shared by the CUDA and HIP builds of the kernels in this folder:
// runtime API names, lane exchange and votes with explicit widths, thread indices, the launch
// form, and the launch-status helper of the launchers declared in launch.h.
//
// Built as CUDA by nvcc (_mxfp8_cuda) and as HIP by clang -x hip (_mxfp8_rocm, through
// hip_compat.h). The tests also build it with the host compiler on HIP-CPU, a HIP runtime that
// runs kernels on CPUs, through a shim per vendor path (xla_ffi/hipcpu/, which defines
// MXFP8_HIPCPU). The sources know of it in three places: the runtime header chosen below, the
// launch form, and the fast form's two instructions (tile.cuh).
#pragma once

#if defined(__HIPCC__)
#include "gpu/hip_compat.h"
#elif !defined(MXFP8_HIPCPU)
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <string>

#include "gpu/launch.h"
#include "mxfp8/numerics.h"

namespace mxfp8::gpu {

// Lanes of the hardware warp, which any_lane votes over: 32 on NVIDIA GPUs, 64 in an AMD gfx9
// wavefront (MI300 and MI350 run wave64 only). Nothing else depends on it: the kernels work in
// 32-lane groups whose exchanges name their width (32 or less), so a wavefront holds two
// independent groups, and the one vote (tile.cuh's fast form, CUDA only) only chooses between
// two forms that write the same bytes.
#if defined(__HIPCC__)
constexpr int kWarpLanes = 64;
#else
constexpr int kWarpLanes = 32;
#endif

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
static_assert(kBlockThreads % kWarpLanes == 0, "a thread block holds whole warps");

// Most blocks a 1-D grid of kBlockThreads may have: CUDA's gridDim.x limit (2^31 - 1); HIP counts
// the grid in work-items, at most 2^32 - 1 of them. A launch takes unsigned int, so a larger
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

// The one launch form of the launchers: kernel<<<blocks, kBlockThreads, 0, stream>>>(args...)
// (blocks checked by grid_fits). Under HIP-CPU, which has no <<<>>>, the shim's launch runs it.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), int64_t blocks, cudaStream_t stream,
                   const Args&... args) {
#if !defined(MXFP8_HIPCPU)
  kernel<<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(args...);
#else
  hipcpu::launch(kernel, blocks, kBlockThreads, stream, args...);
#endif
}

}  // namespace mxfp8::gpu
