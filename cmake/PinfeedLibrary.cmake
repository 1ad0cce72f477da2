# pinfeed_library(<name> <source>...): one module's static library, as every
# module of the project declares it: target pinfeed_<name>, alias
# pinfeed::<name> (the name installed consumers use: EXPORT_NAME), and the
# folder's include/ public, installed under include/ (cmake/PinfeedInstall.cmake).
function(pinfeed_library name)
  add_library(pinfeed_${name} ${ARGN})
  add_library(pinfeed::${name} ALIAS pinfeed_${name})
  set_target_properties(pinfeed_${name} PROPERTIES EXPORT_NAME ${name})
  target_include_directories(pinfeed_${name} PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
                                                    $<INSTALL_INTERFACE:include>)
endfunction()
