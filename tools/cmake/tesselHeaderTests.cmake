# Every public header compiles on its own (TESSEL_HEADER_TESTS; included from the top-level
# CMakeLists.txt, independent of TESSEL_BUILD_TESTS: the Clang preset compiles them, which keeps
# the default test command shorter by ~500 s of compile on 2 cores).
file(GLOB_RECURSE public_headers CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/include
     ${PROJECT_SOURCE_DIR}/include/tessel/*.hpp)
# detail/ headers are internals that users never include, except where one declares a name of
# the public API (a non-empty `inline namespace v0`): e.g. overflow (types/detail/codec.hpp), the
# graph executor's kernels (graph/detail/exec_*.hpp) and the fabric's out-of-class members
# (emulator/detail/fabric_*.hpp). A user meets those names, so those headers must compile alone as well. (types/detail/
# basic_float.hpp holds the number types' interface in tessel::detail; bf16.hpp, which includes
# it first and nothing else, already compiles it alone.)
# An umbrella (a layer's tessel/<layer>.hpp holding nothing but includes) compiles alone when the
# headers it includes do; tessel/tessel.hpp, which includes every umbrella, stays as their check
# (each umbrella alone cost 5-18 s of the build on 2 cores).
set(checked_headers)
foreach(h IN LISTS public_headers)
  if(h MATCHES "^tessel/[^/]+\\.hpp$" AND NOT h STREQUAL "tessel/tessel.hpp")
    file(STRINGS ${PROJECT_SOURCE_DIR}/include/${h} code REGEX "^[ \t]*[^ \t/#]|^[ \t]*#[ \t]*(define|if|else|endif)")
    if(NOT code)
      continue()
    endif()
  endif()
  if(h MATCHES "/detail/")
    file(READ ${PROJECT_SOURCE_DIR}/include/${h} text)
    string(REGEX REPLACE "inline namespace v0 {[ \t\r\n]*}" "" text "${text}")
    if(NOT text MATCHES "inline namespace v0 {")
      continue()
    endif()
  endif()
  if(h STREQUAL "tessel/graph/onnx.hpp")
    continue()  # needs tessel::onnx (ONNX's headers): checked alone below when that target exists
  endif()
  list(APPEND checked_headers ${h})
endforeach()
set(header_tus)
foreach(h IN LISTS checked_headers)
  string(MAKE_C_IDENTIFIER "${h}" id)
  set(tu ${PROJECT_BINARY_DIR}/header_tests/${id}.cpp)
  file(CONFIGURE OUTPUT ${tu} CONTENT "#include <${h}>\n#include <${h}> // twice: include guards work\n")
  list(APPEND header_tus ${tu})
endforeach()
set(main_tu ${PROJECT_BINARY_DIR}/header_tests/main.cpp)
file(CONFIGURE OUTPUT ${main_tu} CONTENT "int main() { return 0; }\n")
add_executable(test_headers_alone ${header_tus} ${main_tu})
target_link_libraries(test_headers_alone PRIVATE tessel::tessel tessel_project_flags)
add_test(NAME test_headers_alone COMMAND test_headers_alone)
set_tests_properties(test_headers_alone PROPERTIES LABELS "headers")

if(TARGET tessel::onnx)
  set(onnx_tu ${PROJECT_BINARY_DIR}/header_tests/onnx_alone.cpp)
  file(CONFIGURE OUTPUT ${onnx_tu} CONTENT "#include <tessel/graph/onnx.hpp>\n#include <tessel/graph/onnx.hpp>\nint main() { return 0; }\n")
  add_executable(test_onnx_header_alone ${onnx_tu})
  target_link_libraries(test_onnx_header_alone PRIVATE tessel::onnx tessel_project_flags)
  add_test(NAME test_onnx_header_alone COMMAND test_onnx_header_alone)
  set_tests_properties(test_onnx_header_alone PROPERTIES LABELS "headers")
endif()
