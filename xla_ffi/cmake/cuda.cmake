# CUDA handlers: the _mxfp8_cuda module, registered for jax platform "CUDA".
#
# MXFP8_CUDA: AUTO builds it when nvcc is found (CUDACXX, CMAKE_CUDA_COMPILER or PATH), ON
# requires it, OFF skips it. Code for sm_90 (Hopper), sm_100a (Blackwell datacenter) and sm_120
# (Blackwell consumer); the CUDA runtime is linked statically and loads the driver on first use,
# so importing the module on a machine without a GPU (or driver) stays clean.
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

set(MXFP8_CUDA_ARCHS "90-real;100a-real;120-real" CACHE STRING
    "CUDA architectures of the _mxfp8_cuda kernels")
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8)
  if(_mxfp8_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "MXFP8_CUDA=ON needs CUDA >= 12.8 (sm_100a/sm_120); found ${CMAKE_CUDA_COMPILER_VERSION}")
  endif()
  message(STATUS "mxfp8: CUDA ${CMAKE_CUDA_COMPILER_VERSION} < 12.8 cannot target sm_100a/sm_120; "
                 "the CUDA handlers are not built")
  return()
endif()
message(STATUS "mxfp8: CUDA handlers for ${MXFP8_CUDA_ARCHS} (nvcc ${CMAKE_CUDA_COMPILER_VERSION})")

add_library(mxfp8_cuda_kernels OBJECT
  gpu/quantize.cu
  gpu/quantize_segments.cu
  gpu/rmsnorm_quantize.cu
  gpu/allgather.cu
)
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
