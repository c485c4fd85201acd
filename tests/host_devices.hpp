// The host with one worker or two, made once per test binary (tests that compare results across
// thread counts share them instead of each making its own pool).
#pragma once

#include <tessel/device/host_device.hpp>

namespace tessel_test {

inline tessel::host_device& host(unsigned threads) {
  static tessel::host_device one(1), two(2);
  return threads == 1 ? one : two;
}

}  // namespace tessel_test
