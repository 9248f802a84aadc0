// What the module was built for, and whether this machine's GPU runtime can run it: checked
// when the module is imported (module.cc), so that a driver or ROCm runtime too old for the
// build is one clear ImportError instead of a "kernel launch failed" at the first call.
#include <cstdio>

#include "gpu/gpu.cuh"
#include "gpu/launch.h"

#ifndef MXFP8_GPU_ARCHS
#define MXFP8_GPU_ARCHS ""
#endif

namespace mxfp8::gpu {

const char* gpu_architectures() { return MXFP8_GPU_ARCHS; }

#if defined(__HIPCC__)

// HIP_VERSION is major * 10^7 + minor * 10^5 + patch; the module links libamdhip64.so.<major>.
int gpu_runtime_version() { return HIP_VERSION_MAJOR * 100 + HIP_VERSION_MINOR; }

const char* gpu_runtime_problem() {
  static char msg[384];
  int v = 0;
  if (hipRuntimeGetVersion(&v) != hipSuccess) {
    (void)hipGetLastError();
    return nullptr;  // no usable runtime: nothing will run on ROCm devices anyway
  }
  const int major = v / 10000000, minor = (v / 100000) % 100;
  if (major == HIP_VERSION_MAJOR && minor >= HIP_VERSION_MINOR) return nullptr;
  std::snprintf(msg, sizeof msg,
                "mxfp8_jax: _mxfp8_rocm was built for ROCm %d.%d (HIP runtime %d.x, minor %d or "
                "newer), but this machine's HIP runtime is %d.%d; rebuild the extension against "
                "this ROCm, or use backend='jax'",
                HIP_VERSION_MAJOR, HIP_VERSION_MINOR, HIP_VERSION_MAJOR, HIP_VERSION_MINOR, major,
                minor);
  return msg;
}

#else

// CUDART_VERSION is major * 1000 + minor * 10. The static runtime needs a driver that supports
// its major version (minor version compatibility): CUDA 13.x needs the R580 driver branch or
// newer, CUDA 12.x R525 or newer.
int gpu_runtime_version() { return CUDART_VERSION; }

const char* gpu_runtime_problem() {
  static char msg[448];
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  // 0: no driver installed (a machine without NVIDIA GPU): nothing will run on CUDA devices.
  const int needed = CUDART_VERSION / 1000 * 1000;
  if (v == 0 || v >= needed) return nullptr;
  const int major = CUDART_VERSION / 1000;
  std::snprintf(msg, sizeof msg,
                "mxfp8_jax: _mxfp8_cuda is linked with the CUDA %d.%d runtime, which needs an "
                "NVIDIA driver that supports CUDA %d.0 (%s or newer); this machine's driver "
                "supports CUDA %d.%d at most. Update the driver, or rebuild the extension with a "
                "CUDA toolkit this driver supports, or use backend='jax'",
                major, (CUDART_VERSION % 1000) / 10, major,
                major == 13 ? "driver branch R580" : (major == 12 ? "R525" : "a matching driver"),
                v / 1000, (v % 1000) / 10);
  return msg;
}

#endif

}  // namespace mxfp8::gpu
