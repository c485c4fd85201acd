// Umbrella for tessel/device: the device concept, the executor, host_device, device_buffer, the
// memory planner and the profiler.
#pragma once
#include <tessel/device/device.hpp>
#include <tessel/device/executor.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/device/memory_plan.hpp>
#include <tessel/device/profiler.hpp>
