// The one error family: every typed error the library throws derives from tessel::error, which
// carries a code a caller can switch on (errc, also as a std::error_code) and the area that raised
// it; what() reads "tessel::<area>: <detail>" everywhere.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

namespace tessel {
inline namespace v0 {

// What kind of failure; stable values (a caller may store or compare them).
enum class errc : int {
  invalid_argument = 1,  // a shape, pointer, option or value the operation cannot take
  out_of_range = 2,      // an index, rank, card or byte range outside its object
  overflow = 3,          // size arithmetic that would wrap
  capacity = 4,          // a memory request above what is left
  unsupported = 5,       // well-formed, but not available here (an ISA, a dtype pairing, a build option)
  config = 6,            // a description (cluster, model config) that cannot describe its object
  format = 7,            // a file or message whose bytes break its format's rules
  io = 8,                // the operating system refused a file or memory operation
  fault = 9,             // a peer, card or link failed while the operation ran
  timeout = 10,          // a wait passed its deadline
  aborted = 11,          // the operation was cancelled (abort, revoke, a stopped rank)
};

constexpr std::string_view to_string(errc e) noexcept {
  switch (e) {
    case errc::invalid_argument: return "invalid argument";
    case errc::out_of_range: return "out of range";
    case errc::overflow: return "size overflow";
    case errc::capacity: return "capacity exceeded";
    case errc::unsupported: return "unsupported";
    case errc::config: return "bad configuration";
    case errc::format: return "malformed data";
    case errc::io: return "i/o failure";
    case errc::fault: return "fault";
    case errc::timeout: return "timeout";
    case errc::aborted: return "aborted";
  }
  return "unknown tessel error";
}

}  // namespace v0

// tessel::detail, not tessel::v0::detail: a second `detail` inside the inline namespace makes every
// later `detail::` in namespace tessel ambiguous (types/ and detail/checked.hpp use tessel::detail).
namespace detail {
class tessel_category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "tessel"; }
  std::string message(int v) const override { return std::string(to_string(static_cast<errc>(v))); }
};
}  // namespace detail

inline namespace v0 {

inline const std::error_category& error_category() noexcept {
  static const detail::tessel_category c;
  return c;
}
inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), error_category()}; }

// Base of every typed error. `area` is the layer or operator that raised it ("gemm", "emulator",
// "comm", ...), a string literal kept by pointer.
class error : public std::runtime_error {
 public:
  error(errc code, const char* area, const std::string& detail)
      : std::runtime_error(std::string("tessel::") + area + ": " + detail), code_(code), area_(area) {}
  errc code() const noexcept { return code_; }
  std::error_code error_code() const noexcept { return make_error_code(code_); }
  const char* area() const noexcept { return area_; }

 private:
  errc code_;
  const char* area_;
};

// Size arithmetic that would wrap (detail/checked.hpp throws it for every layer).
struct overflow_error : error {
  overflow_error(const char* area, const std::string& detail) : error(errc::overflow, area, detail) {}
};

}  // namespace v0
}  // namespace tessel

template <>
struct std::is_error_code_enum<tessel::errc> : std::true_type {};
