// The CPU extension module: hands XLA FFI handler capsules to Python for registration.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace mxfp8::cpu {
extern "C" XLA_FFI_Error* QuantizeHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* QuantizeSegmentsHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* RmsnormQuantizeHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* AllgatherRmsnormQuantizeHandler(XLA_FFI_CallFrame*);
}  // namespace mxfp8::cpu

template <typename T>
static nb::capsule capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_mxfp8_cpu, m) {
  m.doc() = "MXFP8 XLA FFI handlers for the CPU platform";
  m.def("registrations", []() {
    nb::dict d;
    d["mxfp8_quantize"] = capsule(mxfp8::cpu::QuantizeHandler);
    d["mxfp8_quantize_segments"] = capsule(mxfp8::cpu::QuantizeSegmentsHandler);
    d["mxfp8_rmsnorm_quantize"] = capsule(mxfp8::cpu::RmsnormQuantizeHandler);
    d["mxfp8_allgather_rmsnorm_quantize"] = capsule(mxfp8::cpu::AllgatherRmsnormQuantizeHandler);
    return d;
  });
}
