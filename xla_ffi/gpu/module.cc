// The GPU extension module (_mxfp8_cuda, or _mxfp8_rocm when the same handlers are built as
// HIP): hands XLA FFI handler capsules to Python for registration. Compiled by the host C++
// compiler; the handlers live in handlers.cc, the kernels in the .cu files.
#include <nanobind/nanobind.h>

#include "gpu/launch.h"
#include "xla/ffi/api/c_api.h"

#ifndef MXFP8_GPU_MODULE
#error "MXFP8_GPU_MODULE (the module name) must be defined by the build"
#endif

namespace nb = nanobind;

namespace mxfp8::gpu {
extern "C" XLA_FFI_Error* QuantizeHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* QuantizeTilesHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* QuantizeSegmentsHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* RmsnormQuantizeHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* AllgatherRmsnormQuantizeHandler(XLA_FFI_CallFrame*);
}  // namespace mxfp8::gpu

template <typename T>
static nb::capsule capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(MXFP8_GPU_MODULE, m) {
  m.doc() = "MXFP8 XLA FFI handlers for GPUs (CUDA or ROCm, per the module name)";
  // A driver or runtime too old for this build fails the import, with the reason.
  if (const char* why = mxfp8::gpu::gpu_runtime_problem()) throw nb::import_error(why);
  m.attr("architectures") = mxfp8::gpu::gpu_architectures();
  m.attr("runtime_version") = mxfp8::gpu::gpu_runtime_version();
  m.def("registrations", []() {
    nb::dict d;
    d["mxfp8_quantize"] = capsule(mxfp8::gpu::QuantizeHandler);
    d["mxfp8_quantize_tiles"] = capsule(mxfp8::gpu::QuantizeTilesHandler);
    d["mxfp8_quantize_segments"] = capsule(mxfp8::gpu::QuantizeSegmentsHandler);
    d["mxfp8_rmsnorm_quantize"] = capsule(mxfp8::gpu::RmsnormQuantizeHandler);
    // Experimental (xla_ffi/README.md): Python calls it only for strategy="p2p".
    d["mxfp8_allgather_rmsnorm_quantize"] = capsule(mxfp8::gpu::AllgatherRmsnormQuantizeHandler);
    return d;
  });
}
