// The device layer's error families: executor sizes, allocation and copy arguments (device_error);
// the profiler's trace and limits files (profiler_error); the liveness planner's tensor lifetimes,
// in-place requests and alignment (memory_plan_error).
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {

struct device_error : error_of<device_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "device";
};

struct profiler_error : error_of<profiler_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "profiler";
};

struct memory_plan_error : error_of<memory_plan_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "memory plan";
};

}  // namespace v0
}  // namespace tessel
