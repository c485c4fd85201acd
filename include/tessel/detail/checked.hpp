// Checked size arithmetic, shared by every layer: sizes that would overflow std::size_t throw
// std::overflow_error naming the quantity and both operands instead of wrapping silently.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace tessel::detail {

inline std::size_t mul_checked(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw std::overflow_error(std::string("tessel: ") + what + " overflows: " + std::to_string(a) + " * " +
                              std::to_string(b));
  return r;
}

inline std::size_t add_checked(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw std::overflow_error(std::string("tessel: ") + what + " overflows: " + std::to_string(a) + " + " +
                              std::to_string(b));
  return r;
}

}  // namespace tessel::detail
