# cmake --install: headers, the libraries (static C++ libraries and the C
# ABI's libpinfeed.so), the tools, and a CMake package so that
#   find_package(pinfeed REQUIRED)
#   target_link_libraries(app PRIVATE pinfeed::loader)
# works from another build (examples/cpp is built that way by a test).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The modules' libraries name themselves (pinfeed_library, cmake/PinfeedLibrary.cmake).
set_target_properties(pinfeed_c PROPERTIES EXPORT_NAME c)
set_target_properties(pinfeed_libyuv PROPERTIES EXPORT_NAME libyuv)

install(TARGETS pinfeed_core pinfeed_memory pinfeed_codec pinfeed_transform pinfeed_dataset pinfeed_remote pinfeed_loader
                pinfeed_device pinfeed_launch pinfeed_comm pinfeed_model
                pinfeed_trainer pinfeed_c pinfeed_libyuv
        EXPORT pinfeedTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(dir memory/core/include memory/include loader/codec/include loader/transform/include loader/dataset/include
            loader/remote/include loader/include trainer/device/include trainer/launch/include
            trainer/comm/include trainer/model/include trainer/include capi/include)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(TARGETS pinfeed-diag pinfeed-data pinfeed-train RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET pinfeed-bench)
  install(TARGETS pinfeed-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

install(EXPORT pinfeedTargets NAMESPACE pinfeed:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pinfeed)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/pinfeedConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/pinfeedConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pinfeed)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/pinfeedConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/pinfeedConfig.cmake ${PROJECT_BINARY_DIR}/pinfeedConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pinfeed)

# The Python package (component "python", what `pip install .` installs;
# pyproject.toml): the extension next to __init__.py, the tools under
# pinfeed/bin, started by the console scripts of pinfeed/_tools.py.
if(TARGET _pinfeed)
  install(TARGETS _pinfeed LIBRARY DESTINATION pinfeed COMPONENT python)
  install(TARGETS pinfeed-diag pinfeed-data pinfeed-train RUNTIME DESTINATION pinfeed/bin COMPONENT python)
  if(TARGET pinfeed-bench)
    install(TARGETS pinfeed-bench RUNTIME DESTINATION pinfeed/bin COMPONENT python)
  endif()
endif()
