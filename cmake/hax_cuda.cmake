# The CUDA backend (issue 5). HAX_CUDA picks it:
#   AUTO (default): the kernels are compiled whenever nvcc is found, and run when LibTorch is a
#                   CUDA build (on a CPU-only LibTorch they still compile and link, so CI checks them);
#   ON:             as AUTO, but a missing nvcc or a CPU-only LibTorch is a configure error;
#   OFF:            no CUDA at all.
# Results: HAX_CUDA_KERNELS (the .cu kernels are built into hax_kernels and linked) and
# HAX_TORCH_CUDA (LibTorch can hold CUDA tensors, so the kernels can run).
set(HAX_CUDA AUTO CACHE STRING "CUDA backend: AUTO, ON or OFF")
set_property(CACHE HAX_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${HAX_CUDA}" HAX_CUDA_MODE)
if(NOT HAX_CUDA_MODE MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "-DHAX_CUDA=${HAX_CUDA} is unknown; choose AUTO, ON or OFF")
endif()

set(HAX_CUDA_KERNELS OFF)
set(HAX_TORCH_CUDA OFF)
if(TARGET torch_cuda OR TARGET c10_cuda)
  set(HAX_TORCH_CUDA ON)
endif()

if(NOT HAX_CUDA_MODE STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER)
    # The toolkit's usual place, for shells whose PATH lacks it.
    if(EXISTS /usr/local/cuda/bin/nvcc)
      set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
    endif()
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The default architecture (90a) is set in hax_deps.cmake, before LibTorch's config enables
    # CUDA and caches nvcc's default.
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(HAX_CUDA_KERNELS ON)
  endif()
  if(HAX_CUDA_MODE STREQUAL "ON")
    if(NOT HAX_CUDA_KERNELS)
      message(FATAL_ERROR "-DHAX_CUDA=ON but no CUDA compiler (nvcc) was found; set CMAKE_CUDA_COMPILER or PATH")
    endif()
    if(NOT HAX_TORCH_CUDA)
      message(FATAL_ERROR "-DHAX_CUDA=ON but LibTorch ${Torch_VERSION} at ${Torch_DIR} is a CPU-only build; "
                          "point Torch_DIR at a CUDA LibTorch")
    endif()
  endif()
endif()

if(HAX_CUDA_KERNELS)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  file(GLOB_RECURSE HAX_CUDA_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/*.cu)
  # Kernels see only plain params structs (no LibTorch headers), so they compile fast and anywhere.
  add_library(hax_kernels STATIC ${HAX_CUDA_SOURCES})
  target_include_directories(hax_kernels PRIVATE ${CMAKE_SOURCE_DIR}/src)
  target_compile_options(hax_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-Wall,-Wno-unused-parameter>)
  set_target_properties(hax_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_RUNTIME_LIBRARY Shared)
  target_link_libraries(hax_kernels PUBLIC CUDA::cudart)
endif()
message(STATUS "hax: CUDA kernels ${HAX_CUDA_KERNELS} (HAX_CUDA=${HAX_CUDA_MODE}), CUDA LibTorch ${HAX_TORCH_CUDA}")
