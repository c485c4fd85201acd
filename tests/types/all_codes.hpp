// Shared checks over every code of a narrow float type: decode, round trips, NaN set, sign rules.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include <catch2/catch.hpp>
#include <reference/types_ref.hpp>
#include <tessel/types.hpp>

template <class T>
void check_every_code(const tessel_ref::format_spec& spec) {
  using S = typename T::storage_type;
  constexpr std::uint32_t n = 1u << (8 * sizeof(S));
  std::uint32_t failures = 0;
  for (std::uint32_t c = 0; c < n; ++c) {
    const T x = T::from_bits(static_cast<S>(c));
    const double ref = tessel_ref::ref_decode(spec, c);
    const float f = static_cast<float>(x);
    const double d = static_cast<double>(x);
    const bool nan = tessel_ref::ref_is_nan(spec, c);
    bool ok = isnan(x) == nan && std::isnan(f) == nan && std::isnan(d) == nan;
    ok = ok && std::signbit(f) == bool(c >> (8 * sizeof(S) - 1)) && std::signbit(d) == std::signbit(f);
    if (!nan) ok = ok && double(f) == ref && d == ref && std::signbit(ref) == std::signbit(f);
    ok = ok && isinf(x) == tessel_ref::ref_is_inf(spec, c) && isfinite(x) == std::isfinite(ref);
    // Round trips: every code, NaN payloads included, comes back bit-exactly.
    ok = ok && T(f).bits() == c && T(d).bits() == c;
    if (!ok && failures++ < 10) FAIL_CHECK("code 0x" << std::hex << c << " decodes to " << f << " (ref " << ref << ")");
  }
  CHECK(failures == 0);
}

// Arithmetic and comparisons go through float with IEEE semantics.
template <class T>
void check_ieee_semantics() {
  const T pz(0.0f), nz(-0.0f), one(1.0f), two(2.0f), nan = std::numeric_limits<T>::quiet_NaN();
  CHECK(pz == nz);
  CHECK(pz.bits() != nz.bits());
  CHECK(std::signbit(float(nz)));
  CHECK_FALSE(nan == nan);
  CHECK(nan != nan);
  CHECK_FALSE(nan < one);
  CHECK_FALSE(nan > one);
  CHECK_FALSE(nan <= nan);
  CHECK(one < two);
  CHECK(two >= one);
  CHECK(float(one + one) == 2.0f);
  CHECK(float(two * two) == 4.0f);
  CHECK(float(one - two) == -1.0f);
  CHECK(float(one / two) == 0.5f);
  CHECK(float(-one) == -1.0f);
  T acc = one;
  acc += one;
  acc *= two;
  CHECK(float(acc) == 4.0f);
  CHECK((-pz).bits() == nz.bits());
  CHECK(isnan(T(std::numeric_limits<float>::quiet_NaN())));
  CHECK(signbit(T(-std::numeric_limits<float>::quiet_NaN())));
  CHECK(isnan(T(-std::numeric_limits<double>::quiet_NaN())));
}
