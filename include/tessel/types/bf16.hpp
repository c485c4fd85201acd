// tessel::bf16: bfloat16 (1-8-7), the top half of an IEEE binary32.
// One 16-bit word; exact RNE conversions from/to float and double; arithmetic through float.
#pragma once

#include <tessel/types/detail/basic_float.hpp>

namespace tessel {
inline namespace v0 {

using bf16 = detail::basic_float<detail::bf16_format>;
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);

}  // namespace v0
}  // namespace tessel
