// Strict command-line number parsing for tessel's tools: the whole argument must be a number in
// range (no trailing garbage, no silent wrap of "-1" or 99999999999999999999 into a huge size).
// Each parser throws std::invalid_argument naming the option and what it accepts; the tools print
// it with their usage and exit 2.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

namespace tessel_tools {

// A byte size: a non-negative number with an optional K/M/G suffix (powers of 1024), e.g. 8, 1.5K, 256M.
inline std::size_t parse_size(const std::string& opt, const std::string& s) {
  auto bad = [&](const char* why) { return std::invalid_argument(opt + ": '" + s + "' " + why); };
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.')) throw bad("is not a size (e.g. 8, 64K, 256M, 1G)");
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  double mul = 1;
  if (*end == 'K' || *end == 'k')
    mul = 1024.0, ++end;
  else if (*end == 'M' || *end == 'm')
    mul = 1024.0 * 1024, ++end;
  else if (*end == 'G' || *end == 'g')
    mul = 1024.0 * 1024 * 1024, ++end;
  if (*end == 'B' || *end == 'b') ++end;
  if (*end != '\0') throw bad("is not a size (e.g. 8, 64K, 256M, 1G)");
  const double bytes = v * mul;
  // 2^62 bytes is far beyond any machine and leaves room for the sweep's arithmetic.
  if (errno == ERANGE || !std::isfinite(bytes) || bytes >= 4.611686018427388e18) throw bad("is too large");
  if (bytes != std::floor(bytes)) throw bad("is not a whole number of bytes");
  return static_cast<std::size_t>(bytes);
}

// An integer in [lo, hi].
inline long long parse_int(const std::string& opt, const std::string& s, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = s.empty() ? 0 : std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0') throw std::invalid_argument(opt + ": '" + s + "' is not an integer");
  if (errno == ERANGE || v < lo || v > hi)
    throw std::invalid_argument(opt + ": " + s + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

// A finite real number in [lo, hi].
inline double parse_real(const std::string& opt, const std::string& s, double lo, double hi) {
  char* end = nullptr;
  const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v)) throw std::invalid_argument(opt + ": '" + s + "' is not a number");
  if (v < lo || v > hi) throw std::invalid_argument(opt + ": " + s + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

}  // namespace tessel_tools
