// The tile layer's error family: tensor views and tiles outside their data, bad leading
// dimensions, grids and scratch requests that overflow, epilogue operands too small.
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {

struct tile_error : error_of<tile_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "tile";
};

}  // namespace v0
}  // namespace tessel
