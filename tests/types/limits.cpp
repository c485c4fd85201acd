// std::numeric_limits for the narrow float types: values checked against their definitions.
#include <catch2/catch.hpp>
#include <cmath>
#include <tessel/types.hpp>

template <class T>
void check_common(float max, float min_normal, float denorm_min, float eps, int digits, bool inf) {
  using L = std::numeric_limits<T>;
  static_assert(L::is_specialized && L::is_signed && !L::is_integer && !L::is_exact && L::radix == 2);
  static_assert(L::has_quiet_NaN && L::has_denorm == std::denorm_present && L::round_style == std::round_to_nearest);
  CHECK(float(L::max()) == max);
  CHECK(float(L::lowest()) == -max);
  CHECK(float(L::min()) == min_normal);
  CHECK(float(L::denorm_min()) == denorm_min);
  CHECK(float(L::epsilon()) == eps);
  CHECK(float(L::round_error()) == 0.5f);
  CHECK(L::digits == digits);
  CHECK(L::has_infinity == inf);
  CHECK(isnan(L::quiet_NaN()));
  if (inf) {
    CHECK(float(L::infinity()) == HUGE_VALF);
    CHECK(isnan(L::signaling_NaN()));
  }
  // epsilon is the gap after 1; max_exponent / min_exponent follow the std definitions.
  CHECK(float(T::from_bits(T(1.0f).bits() + 1)) - 1.0f == float(L::epsilon()));
  CHECK(std::ldexp(1.0f, L::max_exponent - 1) <= max);
  CHECK(std::ldexp(1.0f, L::max_exponent) > max);
  CHECK(std::ldexp(1.0f, L::min_exponent - 1) == min_normal);
  CHECK(std::pow(10.0, L::max_exponent10) <= max);
  CHECK(std::pow(10.0, L::max_exponent10 + 1) > max);
  CHECK(std::pow(10.0, L::min_exponent10) >= min_normal);
  CHECK(std::pow(10.0, L::min_exponent10 - 1) < min_normal);
  CHECK(L::digits10 == int(std::floor((L::digits - 1) * std::log10(2.0))));
  CHECK(L::max_digits10 == int(std::ceil(1 + L::digits * std::log10(2.0))));
}

TEST_CASE("numeric_limits of the narrow float types", "[types][limits]") {
  check_common<tessel::bf16>(std::bit_cast<float>(0x7F7F0000u), std::ldexp(1.0f, -126), std::ldexp(1.0f, -133), std::ldexp(1.0f, -7), 8, true);
  check_common<tessel::fp16>(65504.0f, std::ldexp(1.0f, -14), std::ldexp(1.0f, -24), std::ldexp(1.0f, -10), 11, true);
  check_common<tessel::e4m3>(448.0f, std::ldexp(1.0f, -6), std::ldexp(1.0f, -9), 0.125f, 4, false);
  check_common<tessel::e5m2>(57344.0f, std::ldexp(1.0f, -14), std::ldexp(1.0f, -16), 0.25f, 3, true);
  static_assert(float(std::numeric_limits<tessel::e4m3>::max()) == 448.0f);
  static_assert(float(std::numeric_limits<tessel::e5m2>::max()) == 57344.0f);
  static_assert(std::numeric_limits<const tessel::bf16>::digits == 8);
}
