// The one-word float class template behind tessel::bf16, fp16, e4m3 and e5m2: exact RNE
// conversions from/to float and double, arithmetic and comparisons through float (IEEE semantics).
#pragma once

#include <compare>
#include <concepts>
#include <cstdint>
#include <iosfwd>

#include <tessel/types/detail/codec.hpp>

namespace tessel {
namespace detail {

template <class Fmt>
struct basic_float {
  using format = Fmt;
  using storage_type = typename Fmt::storage;

  basic_float() = default;
  // Round to nearest even; no saturation (see overflow::propagate).
  constexpr explicit basic_float(float f) noexcept : bits_(encode<Fmt, overflow::propagate>(f)) {}
  // Directly from double: one rounding, never double -> float -> T.
  constexpr explicit basic_float(double d) noexcept : bits_(encode<Fmt, overflow::propagate>(d)) {}
  // Integers round once as well: exact through double up to 2^53, beyond that a sticky bit keeps
  // the tie-breaking information before the (exact) power-of-two scaling.
  template <std::integral I>
  constexpr explicit basic_float(I i) noexcept : basic_float(int_to_double(i)) {}

  constexpr explicit operator float() const noexcept { return decode<Fmt, float>(bits_); }
  constexpr explicit operator double() const noexcept { return decode<Fmt, double>(bits_); }

  static constexpr basic_float from_bits(storage_type b) noexcept {
    basic_float r;
    r.bits_ = b;
    return r;
  }
  constexpr storage_type bits() const noexcept { return bits_; }

  // Arithmetic through float: for these formats a float result rounded once is correctly rounded.
  friend constexpr basic_float operator+(basic_float a, basic_float b) noexcept { return basic_float(float(a) + float(b)); }
  friend constexpr basic_float operator-(basic_float a, basic_float b) noexcept { return basic_float(float(a) - float(b)); }
  friend constexpr basic_float operator*(basic_float a, basic_float b) noexcept { return basic_float(float(a) * float(b)); }
  friend constexpr basic_float operator/(basic_float a, basic_float b) noexcept { return basic_float(float(a) / float(b)); }
  friend constexpr basic_float operator+(basic_float a) noexcept { return a; }
  friend constexpr basic_float operator-(basic_float a) noexcept {  // IEEE negate: flips the sign bit only
    return from_bits(static_cast<storage_type>(a.bits_ ^ Fmt::sign_bit));
  }
  constexpr basic_float& operator+=(basic_float b) noexcept { return *this = *this + b; }
  constexpr basic_float& operator-=(basic_float b) noexcept { return *this = *this - b; }
  constexpr basic_float& operator*=(basic_float b) noexcept { return *this = *this * b; }
  constexpr basic_float& operator/=(basic_float b) noexcept { return *this = *this / b; }

  // -0 == +0, NaN unordered (compares through float).
  friend constexpr bool operator==(basic_float a, basic_float b) noexcept { return float(a) == float(b); }
  friend constexpr std::partial_ordering operator<=>(basic_float a, basic_float b) noexcept { return float(a) <=> float(b); }

  friend constexpr bool isnan(basic_float a) noexcept {
    const std::uint32_t m = a.bits_ & Fmt::abs_mask;
    return Fmt::ieee ? m > Fmt::inf_code : m == Fmt::nan_code;
  }
  friend constexpr bool isinf(basic_float a) noexcept { return Fmt::ieee && (a.bits_ & Fmt::abs_mask) == Fmt::inf_code; }
  friend constexpr bool isfinite(basic_float a) noexcept { return !isnan(a) && !isinf(a); }
  friend constexpr bool signbit(basic_float a) noexcept { return (a.bits_ & Fmt::sign_bit) != 0; }
  friend constexpr basic_float abs(basic_float a) noexcept { return from_bits(static_cast<storage_type>(a.bits_ & Fmt::abs_mask)); }

  template <class CharT, class Traits>
  friend std::basic_ostream<CharT, Traits>& operator<<(std::basic_ostream<CharT, Traits>& os, basic_float a) {
    return os << static_cast<float>(a);
  }

 private:
  template <class I>
  static constexpr double int_to_double(I i) noexcept {
    if constexpr (sizeof(I) < 8) {
      return static_cast<double>(i);
    } else {
      const bool neg = i < 0;
      std::uint64_t m = neg ? std::uint64_t(0) - static_cast<std::uint64_t>(i) : static_cast<std::uint64_t>(i);
      int scale = 0;
      while (m >= (std::uint64_t(1) << 53)) {  // keep 53 bits, fold the dropped ones into a sticky bit
        m = (m >> 1) | (m & 1);
        ++scale;
      }
      const double d = static_cast<double>(m) * pow2<double>(scale);
      return neg ? -d : d;
    }
  }

  storage_type bits_;
};

}  // namespace detail
}  // namespace tessel
