// Writing JSON by hand, for the trace writers (the emulator's timeline and the profiler's): string
// escaping and numbers, to a stream or (faster) to an in-memory json_out. Internal; the file
// readers use nlohmann-json instead.
#pragma once

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdio>
#include <ostream>
#include <string>
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

// A JSON text built in memory with std::to_chars (several times faster than formatted stream
// output; the profiler writes tens of thousands of events at exit). `<<` appends text and integers.
struct json_out {
  std::string text;
  json_out& operator<<(std::string_view s) {
    text.append(s);
    return *this;
  }
  json_out& operator<<(const char* s) { return *this << std::string_view(s); }
  json_out& operator<<(const std::string& s) { return *this << std::string_view(s); }
  json_out& operator<<(char c) {
    text.push_back(c);
    return *this;
  }
  template <std::integral I>
  requires(!std::same_as<I, char> && !std::same_as<I, bool>) json_out& operator<<(I v) {
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    text.append(buf, r.ptr);
    return *this;
  }
};

inline void json_escape(json_out& o, std::string_view s) {
  o << '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      o << '\\' << ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o << buf;
    } else {
      o << ch;
    }
  }
  o << '"';
}
// The shortest text that reads back as `v` (non-finite: 0).
inline void json_number(json_out& o, double v) {
  if (!std::isfinite(v)) v = 0;
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  o.text.append(buf, r.ptr);
}
// `v` with `decimals` digits after the point (timestamps in microseconds: 3 keep nanoseconds).
inline void json_fixed(json_out& o, double v, int decimals) {
  if (!std::isfinite(v)) v = 0;
  char buf[48];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, decimals);
  if (r.ec == std::errc())
    o.text.append(buf, r.ptr);
  else
    o << '0';
}

}  // namespace tessel::detail
