// Checked size arithmetic, shared by every layer: sizes that would overflow std::size_t throw
// tessel::overflow_error (errc::overflow, "tessel::size: <what> overflows: a * b") naming the
// quantity and both operands instead of wrapping silently.
#pragma once

#include <cstddef>
#include <string>

#include <tessel/error.hpp>

namespace tessel::detail {

inline std::size_t mul_checked(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw overflow_error("size", std::string(what) + " overflows: " + std::to_string(a) + " * " + std::to_string(b));
  return r;
}

inline std::size_t add_checked(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw overflow_error("size", std::string(what) + " overflows: " + std::to_string(a) + " + " + std::to_string(b));
  return r;
}

}  // namespace tessel::detail
