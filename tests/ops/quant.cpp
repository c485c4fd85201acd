// Bulk conversion (tessel/ops/quant.hpp): every bf16 code round-trips, f32 -> bf16/fp16/e4m3 agree
// bitwise with the scalar RNE conversions of types/ (specials and subnormals included), scales
// apply before rounding, mismatched sizes are errors.
#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <limits>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/quant.hpp>

#include "error_match.hpp"
#include "reference/train_ref.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_quant {

using namespace tessel;

TEST_CASE("convert agrees with the scalar conversions for every bf16 code and random floats", "[ops][quant]") {
  host_device dev(2);
  std::vector<bf16> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = std::bit_cast<bf16>(std::uint16_t(i));
  std::vector<float> wide(all.size());
  convert(dev, std::span<const bf16>(all), std::span<float>(wide));
  std::vector<bf16> back(all.size());
  convert(dev, std::span<const float>(wide), std::span<bf16>(back));
  for (std::size_t i = 0; i < all.size(); ++i) {
    REQUIRE(std::bit_cast<std::uint32_t>(wide[i]) == std::uint32_t(i) << 16);
    if (!std::isnan(wide[i]))
      REQUIRE(back[i].bits() == all[i].bits());
    else
      REQUIRE(std::isnan(float(back[i])));
  }
  auto x = train_ref::randn(100003, 5, 300.0f);
  x[0] = std::numeric_limits<float>::denorm_min();
  x[1] = -std::numeric_limits<float>::infinity();
  x[2] = 1.00390625f;  // a bf16 tie: rounds to even
  std::vector<bf16> h(x.size());
  std::vector<fp16> f(x.size());
  std::vector<e4m3> q(x.size());
  convert(dev, std::span<const float>(x), std::span<bf16>(h));
  convert(dev, std::span<const float>(x), std::span<fp16>(f));
  convert(dev, std::span<const float>(x), std::span<e4m3>(q), 0.5f);
  for (std::size_t i = 0; i < x.size(); ++i) {
    REQUIRE(h[i].bits() == bf16(x[i]).bits());
    REQUIRE(f[i].bits() == fp16(x[i]).bits());
    const e4m3 want(x[i] * 0.5f);
    REQUIRE((q[i].bits() == want.bits() || (std::isnan(float(q[i])) && std::isnan(float(want)))));
  }
  std::vector<float> scaled(x.size());
  convert(dev, std::span<const float>(x), std::span<float>(scaled), 3.0f);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(std::bit_cast<std::uint32_t>(scaled[i]) == std::bit_cast<std::uint32_t>(x[i] * 3.0f));
}

TEST_CASE("convert rejects mismatched sizes and null buffers", "[ops][quant]") {
  host_device dev(1);
  std::vector<float> a(4);
  std::vector<bf16> b(3);
  CHECK_THROWS_MATCHES(convert(dev, std::span<const float>(a), std::span<bf16>(b)), layer_error,
                       tessel_test::is_error(errc::invalid_argument, "layers", "source has 4 elements, destination 3"));
  CHECK_THROWS_AS(convert(dev, std::span<const float>(static_cast<const float*>(nullptr), 2), std::span<float>(a.data(), 2)), layer_error);
  convert(dev, std::span<const float>(a), std::span<float>(a));  // the same storage: nothing to do
}

}  // namespace tessel_test_ops_quant
