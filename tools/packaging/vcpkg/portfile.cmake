# vcpkg overlay port for tessel, built from this source tree (the port lives inside the repository):
#   vcpkg install tessel --overlay-ports=<tessel>/tools/packaging/vcpkg
# It runs tessel's own CMake install, so vcpkg installs exactly the files `cmake --install` does.
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DTESSEL_BUILD_TESTS=OFF
    -DTESSEL_BUILD_BENCH=OFF
    -DTESSEL_BUILD_EXAMPLES=OFF
    -DTESSEL_BUILD_TOOLS=OFF
    -DTESSEL_HEADER_TESTS=OFF
    -DTESSEL_INSTALL=ON
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME tessel CONFIG_PATH share/cmake/tessel)
vcpkg_fixup_pkgconfig()

# Header-only: nothing is built per configuration.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug")
file(INSTALL "${SOURCE_PATH}/LICENSE" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}" RENAME copyright)
