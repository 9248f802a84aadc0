# ROCm handlers: the same sources as the CUDA ones (gpu/*.cu, through gpu/hip_compat.h) compiled
# as HIP, the _mxfp8_rocm module, registered for jax platform "ROCM"; code for gfx942 (MI300) and
# gfx950 (MI350). A code object runs on its own gfx target only: other AMD GPUs get one warning
# and the pure-JAX reference (_ffi.py). The module links libamdhip64 of the ROCm it is built
# with and refuses, at import, a HIP runtime of another major version or an older minor one
# (gpu/runtime.cu).
#
# MXFP8_ROCM: AUTO builds it when a HIP-capable clang (one that knows gfx942 and gfx950), the
# HIP headers and libamdhip64 are found, ON requires them, OFF skips it. The compiler is
# MXFP8_HIP_CLANG if set, else ROCm's own clang ($ROCM_PATH or /opt/rocm), else a system
# clang++-22..19 or clang++. The kernels need no ROCm device library (-nogpulib): they use
# compiler builtins only.
string(TOUPPER "${MXFP8_ROCM}" _mxfp8_rocm_mode)
if(_mxfp8_rocm_mode STREQUAL "OFF")
  message(STATUS "mxfp8: ROCm handlers disabled (MXFP8_ROCM=OFF)")
  return()
endif()

set(MXFP8_HIP_ARCHS "gfx942;gfx950" CACHE STRING "AMD GPU architectures of the _mxfp8_rocm kernels")

function(_mxfp8_rocm_skip why)
  if(_mxfp8_rocm_mode STREQUAL "ON")
    message(FATAL_ERROR "MXFP8_ROCM=ON but ${why}")
  endif()
  message(STATUS "mxfp8: ${why}; the ROCm handlers (_mxfp8_rocm) are not built")
endfunction()

set(_rocm_roots "$ENV{ROCM_PATH}" /opt/rocm)
if(NOT MXFP8_HIP_CLANG)
  find_program(MXFP8_HIP_CLANG NAMES clang++
               PATHS ${_rocm_roots} PATH_SUFFIXES llvm/bin NO_DEFAULT_PATH)
endif()
if(NOT MXFP8_HIP_CLANG)
  find_program(MXFP8_HIP_CLANG NAMES clang++-22 clang++-21 clang++-20 clang++-19 clang++)
endif()
find_path(MXFP8_HIP_INCLUDE_DIR hip/hip_runtime.h PATHS ${_rocm_roots} PATH_SUFFIXES include)
find_library(MXFP8_AMDHIP64 amdhip64 PATHS ${_rocm_roots} PATH_SUFFIXES lib lib64)
if(NOT MXFP8_HIP_CLANG OR NOT MXFP8_HIP_INCLUDE_DIR OR NOT MXFP8_AMDHIP64)
  _mxfp8_rocm_skip("no HIP toolchain (clang: ${MXFP8_HIP_CLANG}, hip/hip_runtime.h: ${MXFP8_HIP_INCLUDE_DIR}, libamdhip64: ${MXFP8_AMDHIP64})")
  return()
endif()

set(_hip_arch_flags)
foreach(_arch IN LISTS MXFP8_HIP_ARCHS)
  list(APPEND _hip_arch_flags --offload-arch=${_arch})
endforeach()
# Does this clang know the architectures? (The driver rejects unknown ones before parsing.)
if(NOT DEFINED CACHE{MXFP8_HIP_CLANG_OK})
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/mxfp8_hip_probe.hip "__global__ void probe() {}\n")
  execute_process(
    COMMAND ${MXFP8_HIP_CLANG} -x hip ${_hip_arch_flags} -nogpulib --cuda-device-only
            -fsyntax-only ${CMAKE_CURRENT_BINARY_DIR}/mxfp8_hip_probe.hip
    RESULT_VARIABLE _probe_rc OUTPUT_QUIET ERROR_VARIABLE _probe_err)
  if(_probe_rc EQUAL 0)
    set(MXFP8_HIP_CLANG_OK TRUE CACHE INTERNAL "")
  else()
    set(MXFP8_HIP_CLANG_OK FALSE CACHE INTERNAL "")
    message(STATUS "mxfp8: ${MXFP8_HIP_CLANG} -x hip ${_hip_arch_flags}: ${_probe_err}")
  endif()
endif()
if(NOT MXFP8_HIP_CLANG_OK)
  _mxfp8_rocm_skip("${MXFP8_HIP_CLANG} cannot compile HIP for ${MXFP8_HIP_ARCHS}")
  return()
endif()
message(STATUS "mxfp8: ROCm handlers for ${MXFP8_HIP_ARCHS} with ${MXFP8_HIP_CLANG}")

# IEEE arithmetic (no contraction), wave64, code object v5; the loop vectorizer is off because
# it crashes clang 22's AMDGPU instruction selection on these kernels (and gains nothing here).
set(_hip_flags -x hip -std=c++17 -O3 ${_hip_arch_flags} -nogpulib -mcode-object-version=5
    -D__AMDGCN_WAVEFRONT_SIZE=64 -ffp-contract=off -fno-vectorize -fPIC -fvisibility=hidden
    -I${CMAKE_CURRENT_SOURCE_DIR}/include -I${CMAKE_CURRENT_SOURCE_DIR}
    -idirafter ${MXFP8_HIP_INCLUDE_DIR})
set(_hip_objects)
string(REPLACE ";" "," _mxfp8_hip_archs_csv "${MXFP8_HIP_ARCHS}")
foreach(_src quantize quantize_tiles quantize_segments rmsnorm_quantize allgather runtime)
  set(_obj ${CMAKE_CURRENT_BINARY_DIR}/hip/${_src}.o)
  set(_defs)
  if(_src STREQUAL "runtime")  # the module reports what it was built for
    set(_defs "-DMXFP8_GPU_ARCHS=\"${_mxfp8_hip_archs_csv}\"")
  endif()
  add_custom_command(
    OUTPUT ${_obj}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/hip
    COMMAND ${MXFP8_HIP_CLANG} ${_hip_flags} ${_defs} -MD -MF ${_obj}.d -c
            ${CMAKE_CURRENT_SOURCE_DIR}/gpu/${_src}.cu -o ${_obj}
    DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/gpu/${_src}.cu
    DEPFILE ${_obj}.d
    COMMENT "HIP ${_src}.cu (${MXFP8_HIP_ARCHS})"
    VERBATIM)
  list(APPEND _hip_objects ${_obj})
endforeach()
set_source_files_properties(${_hip_objects} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)

mxfp8_gpu_handlers_objects(_handlers)
nanobind_add_module(_mxfp8_rocm NB_STATIC gpu/module.cc ${_handlers} ${_hip_objects})
target_include_directories(_mxfp8_rocm PRIVATE ${MXFP8_INCLUDES})
target_compile_definitions(_mxfp8_rocm PRIVATE MXFP8_GPU_MODULE=_mxfp8_rocm)
target_link_libraries(_mxfp8_rocm PRIVATE ${MXFP8_AMDHIP64})
install(TARGETS _mxfp8_rocm LIBRARY DESTINATION mxfp8_jax)
