// Shared elementwise math: vector span kernels against the scalar forms and known values.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <tessel/arch/math.hpp>
#include <tessel/arch/unpack.hpp>

using namespace tessel;
namespace m = tessel::arch::math;

TEST_CASE("gelu/silu/relu/exp span kernels match the scalar forms", "[arch][math]") {
  std::vector<float> x;
  for (int i = -2000; i <= 2000; ++i) x.push_back(i * 0.01f);
  x.push_back(-100.0f);
  x.push_back(100.0f);
  auto check = [&](auto span_fn, auto scalar_fn, float tol) {
    auto y = x;
    span_fn(y.data(), y.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float want = scalar_fn(x[i]);
      INFO("x=" << x[i]);
      REQUIRE(std::fabs(y[i] - want) <= tol * std::fabs(want) + 1e-6f);
    }
  };
  check(
      m::gelu_tanh_inplace, [](float v) { return m::gelu_tanh(v); }, 1e-5f);
  check(
      m::gelu_erf_inplace, [](float v) { return m::gelu_erf(v); }, 1e-5f);
  check(
      m::silu_inplace, [](float v) { return m::silu(v); }, 1e-5f);
  check(
      m::relu_inplace, [](float v) { return m::relu(v); }, 0.0f);
  auto small = x;
  small.resize(1000);
  std::vector<float> e = small;
  m::exp_inplace(e.data(), e.size());
  for (std::size_t i = 0; i < small.size(); ++i) REQUIRE(std::fabs(e[i] - std::exp(small[i])) <= 1e-6f * std::exp(small[i]));
}

TEST_CASE("relu's span form keeps NaN and zeroes -0 and negatives as the scalar form does, in vectors and tails", "[arch][math]") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float vals[] = {nan, -nan, -0.0f, 0.0f, -inf, inf, -1.5f, 2.5f, std::numeric_limits<float>::denorm_min()};
  std::vector<float> x;
  for (int i = 0; i < 41; ++i) x.push_back(vals[(i * 5) % 9]);  // 41: whole vectors and a tail at any width
  auto y = x;
  m::relu_inplace(y.data(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    INFO("i=" << i << " x=" << x[i]);
    const float want = m::relu(x[i]);
    std::uint32_t a, b;
    std::memcpy(&a, &y[i], 4);
    std::memcpy(&b, &want, 4);
    CHECK(a == b);
  }
}

TEST_CASE("known values", "[arch][math]") {
  REQUIRE(m::gelu_erf(0.0f) == 0.0f);
  REQUIRE(std::fabs(m::gelu_erf(1.0f) - 0.8413447f) < 1e-6f);
  REQUIRE(std::fabs(m::gelu_tanh(1.0f) - 0.8411920f) < 1e-6f);
  REQUIRE(std::fabs(m::silu(1.0f) - 0.7310586f) < 1e-6f);
  REQUIRE(m::relu(-1.0f) == 0.0f);
  REQUIRE(std::isnan(m::relu(std::nanf(""))));
}

TEST_CASE("widening decoders are exact over all FP8 codes", "[arch][unpack]") {
  for (unsigned i = 0; i < 256; ++i) {
    const auto a = e4m3::from_bits(static_cast<std::uint8_t>(i));
    const auto b = e5m2::from_bits(static_cast<std::uint8_t>(i));
    const float fa = static_cast<float>(a), fb = static_cast<float>(b);
    if (std::isnan(fa)) {
      REQUIRE(std::isnan(arch::to_f32(a)));
      REQUIRE(std::isnan(static_cast<float>(bf16::from_bits(arch::to_bf16_bits(a)))));
    } else {
      REQUIRE(arch::to_f32(a) == fa);
      REQUIRE(static_cast<float>(bf16::from_bits(arch::to_bf16_bits(a))) == fa);
    }
    if (std::isnan(fb)) {
      REQUIRE(std::isnan(arch::to_f32(b)));
    } else {
      REQUIRE(arch::to_f32(b) == fb);
      REQUIRE(static_cast<float>(bf16::from_bits(arch::to_bf16_bits(b))) == fb);
    }
  }
}

TEST_CASE("interleave_u16 makes K-pairs", "[arch][unpack]") {
  for (std::size_t n : {0, 1, 31, 32, 33, 100}) {
    std::vector<std::uint16_t> r0(n), r1(n), out(2 * n);
    for (std::size_t i = 0; i < n; ++i) {
      r0[i] = static_cast<std::uint16_t>(i);
      r1[i] = static_cast<std::uint16_t>(1000 + i);
    }
    arch::interleave_u16(r0.data(), r1.data(), out.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(out[2 * i] == r0[i]);
      REQUIRE(out[2 * i + 1] == r1[i]);
    }
  }
}
