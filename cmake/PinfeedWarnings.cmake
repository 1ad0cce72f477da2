# One interface target every pinfeed target links: warnings, -Werror in CI
# presets, and the sanitizer flags of the preset.
add_library(pinfeed_build_flags INTERFACE)
# C++ only: the CUDA kernels are compiled by nvcc, which takes its own flags.
target_compile_options(pinfeed_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion
  -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Wnull-dereference
  -Wimplicit-fallthrough>)
if(PINFEED_WERROR)
  target_compile_options(pinfeed_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                                       $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
endif()
if(PINFEED_SANITIZE)
  target_compile_options(pinfeed_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${PINFEED_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
  target_link_options(pinfeed_build_flags INTERFACE -fsanitize=${PINFEED_SANITIZE})
endif()
