// Checked size arithmetic, shared by every layer: sizes that would overflow std::size_t throw
// tessel::overflow_error (errc::overflow, "tessel::size: <what> overflows: a * b") naming the
// quantity and both operands instead of wrapping silently.
#pragma once

#include <cstddef>
#include <string>

#include <tessel/error.hpp>

namespace tessel::detail {

// The throw is out of line and cold, so the checks inline to one flag test: built inline, the
// message formatting kept mul_checked a call (12% of an 8x8x8 GEMM call, where a size is checked a
// dozen times).
[[noreturn, gnu::cold, gnu::noinline]] inline void throw_size_overflow(const char* what, std::size_t a, const char* op, std::size_t b) {
  throw overflow_error("size", std::string(what) + " overflows: " + std::to_string(a) + op + std::to_string(b));
}

inline std::size_t mul_checked(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]]
    throw_size_overflow(what, a, " * ", b);
  return r;
}

inline std::size_t add_checked(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]]
    throw_size_overflow(what, a, " + ", b);
  return r;
}

}  // namespace tessel::detail
