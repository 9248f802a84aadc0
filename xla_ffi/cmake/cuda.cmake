# CUDA handlers: the _mxfp8_cuda module, registered for jax platform "CUDA".
#
# MXFP8_CUDA: AUTO builds it when nvcc is found (CUDACXX, CMAKE_CUDA_COMPILER or PATH), ON
# requires it, OFF skips it. The CUDA runtime is linked statically and loads the driver on first
# use, so importing the module on a machine without a GPU (or driver) stays clean; a driver too
# old for the runtime (CUDA 13 needs the R580 branch or newer) fails the import with that reason
# (gpu/runtime.cu).
#
# Architectures (MXFP8_CUDA_ARCHS). The kernels use no architecture-specific feature beyond the
# hardware E4M3 convert of sm_89+ (tile.cuh, with an exact integer form elsewhere), so:
#   80-real    SASS for Ampere; it also runs on 8.6/8.7/8.9 (A10, L4, L40S, RTX 30xx/40xx), where
#              the cast takes the exact integer form (correct, not tuned);
#   90-real    Hopper (H100, H200, GH200);
#   100f-real  the Blackwell datacenter family: 10.0 (B200, GB200) and 10.3 (B300, GB300)
#              (an sm_100a cubin runs on 10.0 only);
#   120f-real  the Blackwell workstation family: 12.0 (RTX 50xx, RTX PRO 6000), 12.1 (GB10);
#   90-virtual compute_90 PTX, which the driver compiles for any newer GPU without SASS here.
# GPUs below compute capability 8.0 (Turing and older) have no code: mxfp8_jax warns once and
# runs the pure-JAX reference there (_ffi.py reads the list through the module).
string(TOUPPER "${MXFP8_CUDA}" _mxfp8_cuda_mode)
if(_mxfp8_cuda_mode STREQUAL "OFF")
  message(STATUS "mxfp8: CUDA handlers disabled (MXFP8_CUDA=OFF)")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(_mxfp8_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "MXFP8_CUDA=ON but no CUDA compiler was found: put nvcc on PATH or set CUDACXX")
  endif()
  message(STATUS "mxfp8: nvcc not found, the CUDA handlers (_mxfp8_cuda) are not built")
  return()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(MXFP8_CUDA_ARCHS "80-real;90-real;100f-real;120f-real;90-virtual" CACHE STRING
    "CUDA architectures of the _mxfp8_cuda kernels")
# Family targets (100f, 120f) need CUDA 12.9.
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.9)
  if(_mxfp8_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "MXFP8_CUDA=ON needs CUDA >= 12.9 (sm_100f/sm_120f); found ${CMAKE_CUDA_COMPILER_VERSION}")
  endif()
  message(STATUS "mxfp8: CUDA ${CMAKE_CUDA_COMPILER_VERSION} < 12.9 cannot target sm_100f/sm_120f; "
                 "the CUDA handlers are not built")
  return()
endif()
message(STATUS "mxfp8: CUDA handlers for ${MXFP8_CUDA_ARCHS} (nvcc ${CMAKE_CUDA_COMPILER_VERSION})")

add_library(mxfp8_cuda_kernels OBJECT
  gpu/quantize.cu
  gpu/quantize_tiles.cu
  gpu/quantize_segments.cu
  gpu/rmsnorm_quantize.cu
  gpu/allgather.cu
  gpu/runtime.cu
)
# The module reports what it was built for (comma-separated: CMake lists use ';').
string(REPLACE ";" "," _mxfp8_cuda_archs_csv "${MXFP8_CUDA_ARCHS}")
set_source_files_properties(gpu/runtime.cu PROPERTIES
  COMPILE_DEFINITIONS "MXFP8_GPU_ARCHS=\"${_mxfp8_cuda_archs_csv}\"")
set_target_properties(mxfp8_cuda_kernels PROPERTIES
  CUDA_ARCHITECTURES "${MXFP8_CUDA_ARCHS}"
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  POSITION_INDEPENDENT_CODE ON)
# The kernels see no XLA header: the FFI handlers (gpu/handlers.cc) are host code of the module.
target_include_directories(mxfp8_cuda_kernels PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/include ${CMAKE_CURRENT_SOURCE_DIR})
# IEEE arithmetic: no fast-math, no contraction into FMA (numerics.h asks for mul_rn/add_rn).
# --threads lets nvcc compile the architectures side by side.
target_compile_options(mxfp8_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --fmad=false --threads=0 -Xcompiler=-fvisibility=hidden>)

mxfp8_gpu_handlers_objects(_handlers)
nanobind_add_module(_mxfp8_cuda NB_STATIC gpu/module.cc ${_handlers})
target_include_directories(_mxfp8_cuda PRIVATE ${MXFP8_INCLUDES})
target_compile_definitions(_mxfp8_cuda PRIVATE MXFP8_GPU_MODULE=_mxfp8_cuda)
target_link_libraries(_mxfp8_cuda PRIVATE mxfp8_cuda_kernels CUDA::cudart_static)
# Keep the static runtime's symbols private to this module.
target_link_options(_mxfp8_cuda PRIVATE "LINKER:--exclude-libs,ALL")
install(TARGETS _mxfp8_cuda LIBRARY DESTINATION mxfp8_jax)
