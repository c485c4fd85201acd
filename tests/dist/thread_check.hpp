// Catch2 v2's assertions are not thread-safe: rank threads assert through one lock.
#pragma once

#include <catch2/catch.hpp>

#include <mutex>

namespace tessel_test {
inline std::mutex& catch_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace tessel_test

#define TS_CHECK(...)                                          \
  do {                                                         \
    std::lock_guard tessel_ts_lk_(tessel_test::catch_mutex()); \
    CHECK(__VA_ARGS__);                                        \
  } while (0)
