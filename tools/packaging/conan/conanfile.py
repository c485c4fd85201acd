"""Conan 2 recipe for tessel, a header-only package built from this source tree.

    conan create tools/packaging/conan --build=missing

package() runs tessel's own CMake install, so Conan packages exactly the files `cmake --install`
installs (headers, tesselConfig.cmake, the version file and tessel.pc); consumers use the shipped
CMake config through find_package(tessel CONFIG REQUIRED).
"""
import os

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout
from conan.tools.files import copy


class TesselConan(ConanFile):
    name = "tessel"
    version = "0.1.0"
    license = "Apache-2.0"
    description = ("Header-only C++20 tile templates, fused operators, a UBL128 cluster emulator "
                   "and collectives")
    topics = ("gemm", "attention", "simd", "collectives", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    no_copy_source = True

    def export_sources(self):
        root = os.path.join(self.recipe_folder, "..", "..", "..")
        for pattern in ("CMakeLists.txt", "LICENSE", "include/*", "tools/cmake/*"):
            copy(self, pattern, root, self.export_sources_folder)

    def requirements(self):
        self.requires("xsimd/[>=8.1 <14]")
        self.requires("highway/[>=1.0.3 <2]")
        self.requires("nlohmann_json/[>=3.11 <4]")

    def layout(self):
        cmake_layout(self)

    def generate(self):
        CMakeDeps(self).generate()
        tc = CMakeToolchain(self)
        for option in ("TESTS", "BENCH", "EXAMPLES", "TOOLS"):
            tc.cache_variables[f"TESSEL_BUILD_{option}"] = False
        tc.cache_variables["TESSEL_HEADER_TESTS"] = False
        tc.cache_variables["TESSEL_INSTALL"] = True
        tc.generate()

    def package(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.install()
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))

    def package_id(self):
        self.info.clear()

    def package_info(self):
        # Use the CMake config that tessel installs rather than a generated one.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs = [os.path.join("share", "cmake", "tessel")]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("pkg_config_name", "tessel")
