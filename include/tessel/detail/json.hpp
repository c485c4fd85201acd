// Writing JSON by hand, for the trace writers (the emulator's timeline and the profiler's): string
// escaping and fixed-point numbers. Internal; the file readers use nlohmann-json instead.
#pragma once

#include <cmath>
#include <cstdio>
#include <ostream>
#include <string_view>

namespace tessel::detail {

// `s` as a quoted JSON string: quotes, backslashes and control characters escaped; other bytes
// (UTF-8 included) pass through.
inline void json_escape(std::ostream& o, std::string_view s) {
  o << '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': o << "\\\""; break;
      case '\\': o << "\\\\"; break;
      case '\n': o << "\\n"; break;
      case '\t': o << "\\t"; break;
      case '\r': o << "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          o << buf;
        } else {
          o << static_cast<char>(c);
        }
    }
  }
  o << '"';
}

// `v` with six decimals (microsecond timestamps keep picoseconds); JSON has no NaN or infinity, so
// those are written as 0.
inline void json_number(std::ostream& o, double v) {
  if (!std::isfinite(v)) v = 0;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6f", v);
  o << buf;
}

}  // namespace tessel::detail
