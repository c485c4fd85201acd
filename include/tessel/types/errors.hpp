// The number-type layer's error family: bad dtype values or names, int4 ranges, bulk conversion
// arguments (span sizes, block sizes, scales). Messages read "tessel::types: <function>: ...".
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {

struct type_error : error_of<type_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "types";
};

}  // namespace v0
}  // namespace tessel
