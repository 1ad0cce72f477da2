# Every third-party dependency is found here, once. All come from Debian
# packages installed by scripts/install-deps.sh.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)
find_package(TBB REQUIRED)
# The pkg-config modules, as PREFIX:module (the imported target is
# PkgConfig::PREFIX). The image codecs' libraries are a list of their own:
# the loader links every one of them, and the installed package config
# (pinfeedConfig.cmake.in) finds the same list, so a new format's library is
# one word here and its -dev package in scripts/install-deps.sh.
set(PINFEED_CODEC_MODULES LIBJPEG:libjpeg TURBOJPEG:libturbojpeg SPNG:spng LIBWEBP:libwebp)
# OPENBLAS: the trainer's CPU matrix products.
# CURL: remote shards (HTTP(S), S3 through its AWS SigV4).
set(PINFEED_PKG_MODULES HWLOC:hwloc LIBCAP:libcap ${PINFEED_CODEC_MODULES} OPENBLAS:openblas CURL:libcurl)
set(PINFEED_CODEC_TARGETS)
foreach(module IN LISTS PINFEED_PKG_MODULES)
  string(REPLACE ":" ";" pair ${module})
  list(GET pair 0 prefix)
  list(GET pair 1 name)
  pkg_check_modules(${prefix} REQUIRED IMPORTED_TARGET ${name})
  if(module IN_LIST PINFEED_CODEC_MODULES)
    list(APPEND PINFEED_CODEC_TARGETS PkgConfig::${prefix})
  endif()
endforeach()
unset(pair)
unset(prefix)
unset(name)
find_package(ZLIB REQUIRED)  # crc32 of checkpoints
# xxHash, header-only (XXH_INLINE_ALL): datasets' fingerprints.
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
add_library(pinfeed_xxhash INTERFACE)
target_include_directories(pinfeed_xxhash SYSTEM INTERFACE ${XXHASH_INCLUDE_DIR})
target_compile_definitions(pinfeed_xxhash INTERFACE XXH_INLINE_ALL)
# libyuv ships no CMake or pkg-config file in Debian.
find_path(LIBYUV_INCLUDE_DIR libyuv.h REQUIRED)
find_library(LIBYUV_LIBRARY NAMES yuv REQUIRED)
add_library(pinfeed_libyuv INTERFACE)
target_include_directories(pinfeed_libyuv SYSTEM INTERFACE ${LIBYUV_INCLUDE_DIR})
target_link_libraries(pinfeed_libyuv INTERFACE ${LIBYUV_LIBRARY})

# MPI: optional at build time (multi-process launches under mpirun).
set(PINFEED_HAVE_MPI OFF)
if(NOT PINFEED_MPI STREQUAL "OFF")
  # The C API, found through the CXX component (the project has no C
  # language); the deprecated C++ bindings are skipped.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(PINFEED_HAVE_MPI ON)
  elseif(PINFEED_MPI STREQUAL "ON")
    message(FATAL_ERROR "PINFEED_MPI=ON but no MPI was found (install libopenmpi-dev)")
  endif()
endif()

# Gloo: optional at build time (CPU ranks under torchrun, without MPI).
set(PINFEED_HAVE_GLOO OFF)
if(NOT PINFEED_GLOO STREQUAL "OFF")
  find_package(Gloo CONFIG QUIET)
  if(TARGET gloo)
    set(PINFEED_HAVE_GLOO ON)
  elseif(PINFEED_GLOO STREQUAL "ON")
    message(FATAL_ERROR "PINFEED_GLOO=ON but Gloo was not found (install libgloo-dev)")
  endif()
endif()

# torchrun (Debian's python3-torch): the tests of torchrun launches.
find_program(TORCHRUN_EXECUTABLE torchrun)

# CUDA: optional at build time, detected at run time. We call only the
# runtime API from C++ translation units, linked statically, so binaries
# start on machines with no toolkit and report "no driver" there.
set(PINFEED_HAVE_CUDA OFF)
if(NOT PINFEED_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND NOT CMAKE_CUDA_COMPILER AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
    set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CUDAToolkit_FOUND AND CMAKE_CUDA_COMPILER)
    set(PINFEED_HAVE_CUDA ON)
    # The trainer's kernels: Hopper (H100/H200) and Ampere (A100), plus PTX
    # for newer GPUs to JIT.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    # CMake 3.25 knows nvcc up to C++17; the kernels need nothing newer.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
  elseif(PINFEED_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PINFEED_CUDA=ON but no CUDA toolkit was found "
                        "(set CUDAToolkit_ROOT, e.g. /usr/local/cuda)")
  endif()
endif()

# The Python module: optional (pybind11, Debian's python3 and its torch),
# never in sanitizer builds (an instrumented extension would need the
# sanitizer runtime preloaded into python3).
set(PINFEED_HAVE_PYTHON OFF)
if(NOT PINFEED_PYTHON STREQUAL "OFF" AND NOT PINFEED_SANITIZE)
  if(NOT DEFINED Python_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python_EXECUTABLE /usr/bin/python3)  # Debian's, where python3-torch lives (not a pyenv shim)
  endif()
  set(PYBIND11_FINDPYTHON ON)
  find_package(Python QUIET COMPONENTS Interpreter Development.Module)
  find_package(pybind11 CONFIG QUIET)
  find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h)
  if(Python_FOUND AND pybind11_FOUND AND DLPACK_INCLUDE_DIR)
    set(PINFEED_HAVE_PYTHON ON)
  elseif(PINFEED_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "PINFEED_PYTHON=ON but python3-dev, pybind11-dev or libdlpack-dev is missing")
  endif()
endif()

if(PINFEED_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(PINFEED_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
