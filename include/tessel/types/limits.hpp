// std::numeric_limits specializations for tessel's narrow float types (bf16, fp16, e4m3, e5m2).
// Values are given as bit patterns so every member is exact and constexpr.
#pragma once

#include <limits>

#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel::detail {

// Members shared by all four formats; each specialization adds its own codes and exponents.
template <class T>
struct narrow_float_limits_base {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_quiet_NaN = true;
  static constexpr std::float_denorm_style has_denorm = std::denorm_present;
  static constexpr bool has_denorm_loss = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr int radix = 2;
  static constexpr bool traps = false;
  static constexpr bool tinyness_before = false;
  static constexpr int digits = T::format::man_bits + 1;

  static constexpr T min() noexcept { return T::from_bits(1u << T::format::man_bits); }
  static constexpr T max() noexcept { return T::from_bits(T::format::max_code); }
  static constexpr T lowest() noexcept { return T::from_bits(T::format::max_code | T::format::sign_bit); }
  static constexpr T denorm_min() noexcept { return T::from_bits(1); }
  // 2^-man_bits: biased exponent bias - man_bits, mantissa 0.
  static constexpr T epsilon() noexcept { return T::from_bits((T::format::bias - T::format::man_bits) << T::format::man_bits); }
  static constexpr T round_error() noexcept { return T::from_bits((T::format::bias - 1) << T::format::man_bits); }
  static constexpr T quiet_NaN() noexcept { return T::from_bits(T::format::nan_code); }
};

}  // namespace tessel::detail

namespace std {

template <>
struct numeric_limits<tessel::bf16> : tessel::detail::narrow_float_limits_base<tessel::bf16> {
  using T = tessel::bf16;
  static constexpr bool has_infinity = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr bool is_iec559 = false;
  static constexpr int digits10 = 2;
  static constexpr int max_digits10 = 4;
  static constexpr int min_exponent = -125;
  static constexpr int min_exponent10 = -37;
  static constexpr int max_exponent = 128;
  static constexpr int max_exponent10 = 38;
  static constexpr T infinity() noexcept { return T::from_bits(0x7F80); }
  static constexpr T signaling_NaN() noexcept { return T::from_bits(0x7F81); }
};

template <>
struct numeric_limits<tessel::fp16> : tessel::detail::narrow_float_limits_base<tessel::fp16> {
  using T = tessel::fp16;
  static constexpr bool has_infinity = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr bool is_iec559 = true;  // IEEE binary16; float-computed ops round correctly
  static constexpr int digits10 = 3;
  static constexpr int max_digits10 = 5;
  static constexpr int min_exponent = -13;
  static constexpr int min_exponent10 = -4;
  static constexpr int max_exponent = 16;
  static constexpr int max_exponent10 = 4;
  static constexpr T infinity() noexcept { return T::from_bits(0x7C00); }
  static constexpr T signaling_NaN() noexcept { return T::from_bits(0x7D00); }
};

// E4M3FN has no infinity and a single NaN (per sign): infinity() and signaling_NaN() are not
// meaningful (has_infinity/has_signaling_NaN are false); they return the quiet NaN so a misuse
// never looks like a finite number.
template <>
struct numeric_limits<tessel::e4m3> : tessel::detail::narrow_float_limits_base<tessel::e4m3> {
  using T = tessel::e4m3;
  static constexpr bool has_infinity = false;
  static constexpr bool has_signaling_NaN = false;
  static constexpr bool is_iec559 = false;
  static constexpr int digits10 = 0;
  static constexpr int max_digits10 = 3;
  static constexpr int min_exponent = -5;
  static constexpr int min_exponent10 = -1;
  static constexpr int max_exponent = 9;
  static constexpr int max_exponent10 = 2;
  static constexpr T infinity() noexcept { return T::from_bits(0x7F); }
  static constexpr T signaling_NaN() noexcept { return T::from_bits(0x7F); }
};

template <>
struct numeric_limits<tessel::e5m2> : tessel::detail::narrow_float_limits_base<tessel::e5m2> {
  using T = tessel::e5m2;
  static constexpr bool has_infinity = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr bool is_iec559 = false;
  static constexpr int digits10 = 0;
  static constexpr int max_digits10 = 2;
  static constexpr int min_exponent = -13;
  static constexpr int min_exponent10 = -4;
  static constexpr int max_exponent = 16;
  static constexpr int max_exponent10 = 4;
  static constexpr T infinity() noexcept { return T::from_bits(0x7C); }
  static constexpr T signaling_NaN() noexcept { return T::from_bits(0x7D); }
};

}  // namespace std
