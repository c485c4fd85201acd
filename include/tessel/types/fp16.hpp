// tessel::fp16: IEEE binary16 half precision (1-5-10).
// One 16-bit word; exact RNE conversions from/to float and double; arithmetic through float.
#pragma once

#include <tessel/types/detail/basic_float.hpp>

namespace tessel {
inline namespace v0 {

using fp16 = detail::basic_float<detail::fp16_format>;
static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable_v<fp16>);

}  // namespace v0
}  // namespace tessel
