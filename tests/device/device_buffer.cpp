// device_buffer: owning, typed, move-only device memory. Properties: the memory is the device's
// (its counters see it), released exactly once whatever moves happen, copies round-trip bit-exact,
// sizes are checked (overflow, mismatched spans).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/types.hpp>
#include "error_match.hpp"

namespace tessel_test_device_device_buffer {

using tessel_test::is_error;
using tessel::errc;
using namespace tessel;

TEMPLATE_TEST_CASE("device_buffer round-trips every element bit-exact", "[device][device_buffer]", float, bf16, std::uint8_t, double) {
  host_device d(2);
  std::mt19937 rng(7);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4099}}) {
    std::vector<TestType> src(n);
    for (auto& x : src) x = static_cast<TestType>(static_cast<float>(rng() % 1000) / 8.0f);
    device_buffer<TestType, host_device> b(d, std::span<const TestType>(src));
    REQUIRE(b.size() == n);
    REQUIRE(b.size_bytes() == n * sizeof(TestType));
    std::vector<TestType> back(n);
    b.copy_to(back);
    if (n) REQUIRE(std::memcmp(back.data(), src.data(), n * sizeof(TestType)) == 0);  // memcmp(nullptr, ...) is UB even for 0 bytes
    for (std::size_t i = 0; i < n; ++i) REQUIRE(std::memcmp(&b.span()[i], &src[i], sizeof(TestType)) == 0);
  }
}

TEST_CASE("device_buffer memory belongs to the device and is freed exactly once", "[device][device_buffer]") {
  host_device d(1);
  const auto before = d.memory().in_use;
  {
    auto a = device_buffer<float, host_device>::zeros(d, 1000);
    REQUIRE(d.memory().in_use >= before + 4000);
    for (float x : a.span()) REQUIRE(x == 0.0f);
    device_buffer<float, host_device> b(std::move(a));  // move: one owner
    REQUIRE(a.empty());
    REQUIRE(a.data() == nullptr);
    REQUIRE(b.size() == 1000);
    device_buffer<float, host_device> c(d, 10);
    c = std::move(b);  // c's own 10 floats are freed, b's 1000 move in
    REQUIRE(c.size() == 1000);
    REQUIRE(b.empty());
    c.fill(2.5f);
    for (float x : std::span<const float>(c)) REQUIRE(x == 2.5f);
    c.reset();
    REQUIRE(c.empty());
    REQUIRE(d.memory().in_use == before);
    auto e = device_buffer<float, host_device>::zeros(d, 5);
    auto& alias = e;       // through a reference: a direct self-move is a compile-time warning
    e = std::move(alias);  // self-move keeps the buffer
    REQUIRE(e.size() == 5);
  }
  REQUIRE(d.memory().in_use == before);  // destructors released everything, and only once
}

TEST_CASE("device_buffer rejects impossible sizes with typed errors", "[device][device_buffer][errors]") {
  host_device d(1);
  CHECK_THROWS_MATCHES((device_buffer<double, host_device>(d, SIZE_MAX / 4)), tessel::overflow_error,
                       is_error(errc::overflow, "size", "device_buffer bytes"));
  device_buffer<float, host_device> b(d, 4);
  std::vector<float> three(3);
  CHECK_THROWS_MATCHES(b.copy_from(three), device_error, is_error(errc::invalid_argument, "device", "3 elements for a buffer of 4"));
  CHECK_THROWS_MATCHES(b.copy_to(three), device_error, is_error(errc::invalid_argument, "device", "copy_to"));
  device_buffer<float, host_device> empty;
  CHECK(empty.empty());
  CHECK(empty.span().empty());
}
}  // namespace tessel_test_device_device_buffer
