// Umbrella for tessel/device: the device concept, the executor and host_device.
#pragma once
#include <tessel/device/device.hpp>
#include <tessel/device/executor.hpp>
#include <tessel/device/host_device.hpp>
