// tessel::e4m3 (OCP FP8 E4M3FN: max 448, NaN = S.1111.111, no Inf) and tessel::e5m2 (OCP FP8 E5M2,
// IEEE-like: max 57344, Inf and NaN). One byte each; exact RNE conversions; arithmetic through float.
#pragma once

#include <tessel/types/detail/basic_float.hpp>

namespace tessel {
inline namespace v0 {

using e4m3 = detail::basic_float<detail::e4m3_format>;
using e5m2 = detail::basic_float<detail::e5m2_format>;
static_assert(sizeof(e4m3) == 1 && std::is_trivially_copyable_v<e4m3>);
static_assert(sizeof(e5m2) == 1 && std::is_trivially_copyable_v<e5m2>);

}  // namespace v0
}  // namespace tessel
