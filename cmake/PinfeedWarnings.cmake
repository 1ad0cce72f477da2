# One interface target every pinfeed target links: warnings, -Werror in CI
# presets, and the sanitizer flags of the preset.
add_library(pinfeed_build_flags INTERFACE)
target_compile_options(pinfeed_build_flags INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion
  -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Wnull-dereference
  -Wimplicit-fallthrough)
if(PINFEED_WERROR)
  target_compile_options(pinfeed_build_flags INTERFACE -Werror)
endif()
if(PINFEED_SANITIZE)
  target_compile_options(pinfeed_build_flags INTERFACE
    -fsanitize=${PINFEED_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(pinfeed_build_flags INTERFACE -fsanitize=${PINFEED_SANITIZE})
endif()
