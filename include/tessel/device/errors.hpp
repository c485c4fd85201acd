// The device layer's error family: executor sizes, allocation and copy arguments.
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {

struct device_error : error_of<device_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "device";
};

}  // namespace v0
}  // namespace tessel
