// The CPU extension module: hands XLA FFI handler capsules to Python for registration.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cpu/isa.h"

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace mxfp8::cpu {
extern "C" XLA_FFI_Error* QuantizeHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* QuantizeTilesHandler(XLA_FFI_CallFrame*);
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
    d["mxfp8_quantize_tiles"] = capsule(mxfp8::cpu::QuantizeTilesHandler);
    d["mxfp8_quantize_segments"] = capsule(mxfp8::cpu::QuantizeSegmentsHandler);
    d["mxfp8_rmsnorm_quantize"] = capsule(mxfp8::cpu::RmsnormQuantizeHandler);
    d["mxfp8_allgather_rmsnorm_quantize"] = capsule(mxfp8::cpu::AllgatherRmsnormQuantizeHandler);
    return d;
  });
  // The jaxlib whose XLA FFI headers the handlers were compiled against, and their FFI API
  // version: a jaxlib with an older API refuses the handlers.
  m.attr("ffi_jaxlib") = MXFP8_FFI_JAXLIB;
  m.attr("ffi_api") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  // The instruction set the kernels run (isa.h): the best of this CPU by default.
  m.def("isa", []() { return std::string(mxfp8::cpu::isa_name(mxfp8::cpu::active_isa())); });
  m.def("isas", []() {
    nb::list l;
    for (int i = 0; i <= static_cast<int>(mxfp8::cpu::best_isa()); ++i)
      l.append(mxfp8::cpu::isa_name(static_cast<mxfp8::cpu::CpuIsa>(i)));
    return l;
  });
  m.def("set_isa", [](const std::string& name) {
    mxfp8::cpu::CpuIsa isa;
    if (!mxfp8::cpu::isa_from_name(name.c_str(), &isa)) {
      const std::string msg = "isa must be one of 'baseline', 'avx2', 'avx512'; got '" + name + "'";
      throw nb::value_error(msg.c_str());
    }
    if (!mxfp8::cpu::set_active_isa(isa)) {
      const std::string msg = "isa='" + name + "': this CPU supports up to '" +
                              mxfp8::cpu::isa_name(mxfp8::cpu::best_isa()) + "'";
      throw nb::value_error(msg.c_str());
    }
  });
}
