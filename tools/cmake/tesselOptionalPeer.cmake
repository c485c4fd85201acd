# tessel_optional_peer(<package> <target-or-variable> <result-var>)
#
# Finds a benchmark peer (or any optional dependency) without letting a broken package config stop
# our configure. Some Debian configs call find_package(... REQUIRED) on packages they merely
# recommend (libdnnl-dev's dnnl-config.cmake needs OpenCL headers from ocl-icd-opencl-dev); a
# fatal error there cannot be caught in this scope (nor by try_compile), so the package is first
# found by a separate cmake process configuring a throw-away project, and only found here when
# that succeeded. A macro, so that find_package's variables land in the caller's scope.
# Sets <result-var> to TRUE/FALSE and prints one line saying whether we have the peer and why not.
macro(tessel_optional_peer _peer_package _peer_what _peer_result)
  set(_peer_dir ${CMAKE_BINARY_DIR}/peer-probes/${_peer_package})
  file(REMOVE_RECURSE ${_peer_dir})
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${PROJECT_SOURCE_DIR}/tools/cmake/probe -B ${_peer_dir}
            -G ${CMAKE_GENERATOR} -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
            -DPEER_PACKAGE=${_peer_package} -DPEER_WHAT=${_peer_what}
            "-DCMAKE_PREFIX_PATH=${CMAKE_PREFIX_PATH}"
    RESULT_VARIABLE _peer_rc OUTPUT_VARIABLE _peer_output ERROR_VARIABLE _peer_output)
  if(_peer_rc EQUAL 0)
    find_package(${_peer_package} CONFIG QUIET)
    set(${_peer_result} TRUE)
    message(STATUS "tessel: peer ${_peer_package}: found")
  else()
    set(${_peer_result} FALSE)
    # The first "Could NOT find" line says why (no config, or a dependency of the config).
    string(REGEX MATCH "Could NOT find [^\n]*|Could not find a package configuration file[^\n]*"
           _peer_why "${_peer_output}")
    if(NOT _peer_why)
      set(_peer_why "its CMake package does not configure")
    endif()
    message(STATUS "tessel: peer ${_peer_package}: not available (${_peer_why}); benchmarks run without it")
  endif()
endmacro()
