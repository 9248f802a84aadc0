// HIP-CPU shim of the ROCm path (see hipcpu.h): the GPU sources compiled as HIP clang's device
// pass sees them. HIP-CPU defines __HIPCC__, so gpu.cuh includes gpu/hip_compat.h as on ROCm and
// every HIP branch is taken; __HIP_DEVICE_COMPILE__ gives numerics.h's device arithmetic.
//
// The amdgcn builtins the HIP branches call are HIP-CPU's thread and block indices and its block
// barrier (a fence is a fence of the host): what this path tests is the #if branches and the code
// around these builtins, not the builtins. The wavefront is HIP-CPU's, 64 lanes, as on gfx9.
#pragma once

#include "hipcpu/hipcpu.h"

#define __HIP_DEVICE_COMPILE__ 1

#define __builtin_amdgcn_workitem_id_x() static_cast<uint32_t>(threadIdx.x)
#define __builtin_amdgcn_workgroup_id_x() static_cast<uint32_t>(blockIdx.x)
#define __builtin_amdgcn_s_barrier() __syncthreads()
#define __builtin_amdgcn_fence(order, scope) __atomic_thread_fence(order)
