// Bulk conversions: bulk == scalar on a seeded sample (every length mod the vector width), the
// quantize/dequantize contracts, and error messages. The full 2^32 sweeps are in convert_exhaustive.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <reference/types_ref.hpp>
#include <tessel/types.hpp>
#include <vector>
#include "error_match.hpp"

using tessel_test::is_error;
using tessel::errc;

using tessel::overflow;

namespace {
std::vector<float> sample(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (i % 3) {
      case 0: v[i] = std::bit_cast<float>(std::uint32_t(g())); break;                       // any bits (NaN, Inf, subnormal)
      case 1: v[i] = std::ldexp(float(int(g() % 2001) - 1000), int(g() % 40) - 30); break;  // near the fp8 range
      default: v[i] = std::normal_distribution<float>(0.0f, 100.0f)(g);
    }
  }
  return v;
}

template <class T>
void bulk_equals_scalar() {
  const auto src = sample(70000, 42);
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(15), std::size_t(17), std::size_t(33), src.size()}) {
    const std::span<const float> s(src.data(), n);
    std::vector<T> p(n), q(n);
    std::vector<float> back(n);
    tessel::convert(s, std::span<T>(p));
    tessel::convert(s, std::span<T>(q), overflow::saturate);
    tessel::convert(std::span<const T>(p), std::span<float>(back));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      bad += p[i].bits() != T(src[i]).bits();
      bad += q[i].bits() != tessel::detail::encode<typename T::format, overflow::saturate>(src[i]);
      bad += std::bit_cast<std::uint32_t>(back[i]) != std::bit_cast<std::uint32_t>(float(p[i]));
    }
    INFO("n = " << n);
    CHECK(bad == 0);
  }
}
}  // namespace

TEMPLATE_TEST_CASE("bulk convert equals scalar", "[types][convert]", tessel::bf16, tessel::fp16, tessel::e4m3, tessel::e5m2) {
  bulk_equals_scalar<TestType>();
}

TEMPLATE_TEST_CASE("quantize and dequantize with one scale", "[types][convert]", tessel::e4m3, tessel::e5m2, tessel::bf16, tessel::fp16) {
  const auto src = sample(1000, 7);
  std::vector<TestType> q(src.size());
  std::vector<float> back(src.size());
  const float scale = 0.37f;
  tessel::quantize(std::span<const float>(src), std::span<TestType>(q), scale);
  tessel::dequantize(std::span<const TestType>(q), std::span<float>(back), scale);
  for (std::size_t i = 0; i < src.size(); ++i) {
    const auto expect = tessel::detail::encode<typename TestType::format, overflow::saturate>(src[i] / scale);
    REQUIRE(q[i].bits() == expect);
    const float b = float(q[i]) * scale;
    REQUIRE(std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(b));
  }
  CHECK_THROWS_MATCHES(tessel::quantize(std::span<const float>(src), std::span<TestType>(q), 0.0f), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_MATCHES(tessel::quantize(std::span<const float>(src), std::span<TestType>(q), -1.0f), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_MATCHES(tessel::quantize(std::span<const float>(src), std::span<TestType>(q), NAN), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
}

TEST_CASE("block-scaled e4m3: amax maps to max, error bound, zero blocks", "[types][convert]") {
  std::mt19937 g(3);
  std::vector<float> src(128 * 6);
  for (auto& x : src) x = std::normal_distribution<float>(0.0f, 1.0f)(g);
  src[5] = 1000.0f;                                                // block 0 amax
  std::fill(src.begin() + 128, src.begin() + 256, 0.0f);           // block 1 all zero
  src[300] = NAN;                                                  // block 2 NaN (ignored by amax)
  src[301] = -INFINITY;                                            // block 2 -Inf -> -max (saturate)
  for (int i = 384; i < 512; ++i) src[i] = 1e-40f * float(i % 3);  // block 3 subnormal floats
  std::vector<tessel::e4m3> q(src.size());
  const auto scales = tessel::quantize_blocks(std::span<const float>(src), std::span<tessel::e4m3>(q));
  REQUIRE(scales.size() == 6);
  CHECK(scales[0] == 1000.0f / 448.0f);
  CHECK(float(q[5]) == 448.0f);
  CHECK(scales[1] == 1.0f);
  CHECK(scales[3] == std::numeric_limits<float>::min());
  CHECK(isnan(q[300]));
  CHECK(q[301].bits() == 0xFE);
  std::vector<float> back(src.size());
  tessel::dequantize_blocks(std::span<const tessel::e4m3>(q), std::span<const float>(scales), std::span<float>(back));
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (!std::isfinite(src[i])) continue;
    const float s = scales[i / 128];
    // E4M3: relative error <= 2^-4 for normals, absolute <= 2^-10 * s in the subnormal range.
    REQUIRE(std::fabs(back[i] - src[i]) <= std::fabs(src[i]) / 16 + std::ldexp(s, -10) * 1.0001f);
    REQUIRE(back[i] == float(q[i]) * s);
  }
  // Per-tensor quantize with each block's scale gives the same codes.
  std::vector<tessel::e4m3> q2(128);
  tessel::quantize(std::span<const float>(src.data() + 512, 128), std::span<tessel::e4m3>(q2), scales[4]);
  for (int i = 0; i < 128; ++i) REQUIRE(q2[i].bits() == q[512 + i].bits());
}

TEST_CASE("bulk API errors name both sizes", "[types][convert]") {
  std::vector<float> a(10), b(7);
  std::vector<tessel::bf16> h(9);
  std::vector<tessel::e4m3> q(10);
  CHECK_THROWS_MATCHES(tessel::convert(std::span<const float>(a), std::span<tessel::bf16>(h)), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_WITH(tessel::convert(std::span<const float>(a), std::span<tessel::bf16>(h)), Catch::Contains("10") && Catch::Contains("9"));
  CHECK_THROWS_WITH(tessel::convert(std::span<const tessel::bf16>(h), std::span<float>(b)), Catch::Contains("9") && Catch::Contains("7"));
  CHECK_THROWS_WITH(tessel::quantize_blocks(std::span<const float>(a), std::span<tessel::e4m3>(q), 4), Catch::Contains("4") && Catch::Contains("10"));
  CHECK_THROWS_MATCHES(tessel::quantize_blocks(std::span<const float>(a), std::span<tessel::e4m3>(q), 0), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
  std::vector<float> sc(3);
  CHECK_THROWS_WITH(tessel::quantize_blocks(std::span<const float>(a), std::span<tessel::e4m3>(q), std::span<float>(sc), 5),
                    Catch::Contains("3") && Catch::Contains("2"));
  CHECK_THROWS_MATCHES(tessel::dequantize_blocks(std::span<const tessel::e4m3>(q), std::span<const float>(sc), std::span<float>(a), 5),
                       tessel::type_error, is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_MATCHES(tessel::dequantize(std::span<const tessel::e4m3>(q), std::span<float>(b), 1.0f), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
}

TEST_CASE("convert between other float pairs (double, narrow <-> narrow)", "[types][convert]") {
  const std::vector<double> d = {1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40), 1e300, -0.0, 448.0, 500.0};
  std::vector<tessel::bf16> h(d.size());
  tessel::convert(std::span<const double>(d), std::span<tessel::bf16>(h));
  CHECK(h[0].bits() == 0x3F81);  // one rounding from double
  CHECK(h[1].bits() == 0x7F80);
  CHECK(h[2].bits() == 0x8000);
  std::vector<tessel::e4m3> q(d.size());
  tessel::convert(std::span<const double>(d), std::span<tessel::e4m3>(q), overflow::saturate);
  CHECK(q[1].bits() == 0x7E);
  CHECK(q[4].bits() == 0x7E);
  std::vector<tessel::e5m2> e(d.size());
  tessel::convert(std::span<const tessel::e4m3>(q), std::span<tessel::e5m2>(e));
  CHECK(float(e[3]) == 448.0f);
  std::vector<double> back(d.size());
  tessel::convert(std::span<const tessel::e5m2>(e), std::span<double>(back));
  CHECK(back[3] == 448.0);
  CHECK_THROWS_MATCHES(tessel::convert(std::span<const double>(d), std::span<tessel::e5m2>(e.data(), 2)), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
}

namespace {
template <class T>
void sample_against_reference(const tessel_ref::format_spec& spec) {
  const tessel_ref::encoder enc(spec);
  std::mt19937_64 g(11);
  std::size_t bad = 0;
  for (int i = 0; i < 200000; ++i) {
    // Doubles whose exponents straddle the type's range, with full 52-bit mantissas (ties and
    // near-ties below float precision included), plus random floats.
    const int lo = -(spec.bias + spec.man_bits + 3), hi = spec.bias + 3;
    const int e = lo + int(g() % std::uint64_t(hi - lo + 1));
    const std::uint64_t bits = (std::uint64_t(1023 + e) << 52) | (g() & ((std::uint64_t(1) << 52) - 1)) | (g() & (std::uint64_t(1) << 63));
    const double d = i % 4 == 0 ? double(std::bit_cast<float>(std::uint32_t(g()))) : std::bit_cast<double>(bits);
    if (std::isnan(d)) continue;
    bad += T(d).bits() != enc.encode(d, false);
    bad += tessel::detail::encode<typename T::format, overflow::saturate>(d) != enc.encode(d, true);
  }
  CHECK(bad == 0);
}
}  // namespace

TEST_CASE("scalar conversions from double agree with the reference (sample)", "[types][convert]") {
  sample_against_reference<tessel::bf16>(tessel_ref::bf16_spec);
  sample_against_reference<tessel::fp16>(tessel_ref::fp16_spec);
  sample_against_reference<tessel::e4m3>(tessel_ref::e4m3_spec);
  sample_against_reference<tessel::e5m2>(tessel_ref::e5m2_spec);
}

#if defined(__x86_64__) || defined(__i386__)
TEMPLATE_TEST_CASE("bulk convert stays exact under FTZ/DAZ", "[types][convert]", tessel::bf16, tessel::fp16, tessel::e4m3, tessel::e5m2) {
  // Programs linked with -ffast-math run with FTZ|DAZ set; the integer rounding must not care.
  std::vector<float> src;
  for (std::uint32_t u = 1; u < 0x00800000u; u += 0x1FFFu) {
    src.push_back(std::bit_cast<float>(u));
    src.push_back(std::bit_cast<float>(u | 0x80000000u));
  }
  src.push_back(std::bit_cast<float>(0x7F7F8000u));
  src.push_back(std::numeric_limits<float>::quiet_NaN());
  std::vector<TestType> p(src.size()), q(src.size());
  std::vector<float> back(src.size());
  const unsigned saved = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(saved | 0x8040u);  // FTZ | DAZ
  tessel::convert(std::span<const float>(src), std::span<TestType>(p));
  tessel::convert(std::span<const float>(src), std::span<TestType>(q), overflow::saturate);
  tessel::convert(std::span<const TestType>(p), std::span<float>(back));
  __builtin_ia32_ldmxcsr(saved);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < src.size(); ++i) {
    bad += p[i].bits() != tessel::detail::encode<typename TestType::format, overflow::propagate>(src[i]);
    bad += q[i].bits() != tessel::detail::encode<typename TestType::format, overflow::saturate>(src[i]);
    bad += std::bit_cast<std::uint32_t>(back[i]) !=
           std::bit_cast<std::uint32_t>(tessel::detail::decode_bits<typename TestType::format, float>(p[i].bits()));
  }
  CHECK(bad == 0);
}
#endif
