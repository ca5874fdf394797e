# Finds hax's dependencies: LibTorch (Debian's libtorch-dev, or the LibTorch inside the `torch`
# Python package when that is where it lives, as on the GPU machine), CLI11, fmt, nlohmann-json, GTest.

# LibTorch: an explicit Torch_DIR / CMAKE_PREFIX_PATH wins; otherwise prefer the Python package's
# (it is the CUDA-enabled one where it exists), then the system's.
if(NOT Torch_DIR)
  find_program(HAX_PYTHON NAMES python3 python)
  if(HAX_PYTHON)
    execute_process(
      COMMAND ${HAX_PYTHON} -c "import torch; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE HAX_TORCH_PY_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET RESULT_VARIABLE HAX_TORCH_PY_RC)
    if(HAX_TORCH_PY_RC EQUAL 0 AND EXISTS "${HAX_TORCH_PY_PREFIX}")
      message(STATUS "hax: using the LibTorch of the Python torch package: ${HAX_TORCH_PY_PREFIX}")
      list(PREPEND CMAKE_PREFIX_PATH "${HAX_TORCH_PY_PREFIX}")
    endif()
  endif()
endif()
# The CUDA architecture of the hax kernels, H100 / H200 (Hopper) with its architecture-specific
# instructions (wgmma; "a": no PTX for later GPUs); for other GPUs pass -DCMAKE_CUDA_ARCHITECTURES=...
# (the kernels then take their mma.sync paths). Set here, before find_package(Torch): a CUDA
# LibTorch's config enables the CUDA language, which caches nvcc's default (sm_75 with CMake 4)
# when the cache has no entry. On the H100 that default was cached and every kernel was compiled
# twice, for sm_75 and for the sm_90a that LibTorch's TORCH_CUDA_ARCH_LIST flags add.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT HAX_CUDA STREQUAL "OFF")
  set(CMAKE_CUDA_ARCHITECTURES 90a CACHE STRING "CUDA architectures of the hax kernels (default 90a: H100 / H200)")
endif()
find_package(Torch REQUIRED)
message(STATUS "hax: Torch ${Torch_VERSION} at ${Torch_DIR}")
# LibTorch's exported flags (e.g. -D_GLIBCXX_USE_CXX11_ABI) must reach every target.
set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} ${TORCH_CXX_FLAGS}")

# at::parallel_for is a header template whose OpenMP pragmas compile into hax itself: without
# -fopenmp every hax kernel would silently run on one thread.
find_package(OpenMP REQUIRED COMPONENTS CXX)

find_package(fmt REQUIRED)
find_package(nlohmann_json 3.9 REQUIRED)
find_package(CLI11 CONFIG QUIET)
if(NOT TARGET CLI11::CLI11)
  find_path(HAX_CLI11_INCLUDE CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${HAX_CLI11_INCLUDE})
endif()
