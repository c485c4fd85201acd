// tessel::e4m3 / tessel::e5m2: every code, the conversion table, and value semantics.
#include "all_codes.hpp"

#include <sstream>

using tessel::e4m3;
using tessel::e5m2;
using tessel::overflow;

namespace {
template <class T, overflow Ov>
unsigned enc(float x) {
  return tessel::detail::encode<typename T::format, Ov>(x);
}
template <class T>
unsigned sat(float x) {  // through the public bulk API
  const float src[1] = {x};
  T dst[1];
  tessel::convert(std::span<const float>(src), std::span<T>(dst), overflow::saturate);
  return dst[0].bits();
}
}  // namespace

TEST_CASE("e4m3 every code decodes and round-trips", "[types][fp8]") { check_every_code<e4m3>(tessel_ref::e4m3_spec); }
TEST_CASE("e5m2 every code decodes and round-trips", "[types][fp8]") { check_every_code<e5m2>(tessel_ref::e5m2_spec); }

TEST_CASE("fp8 NaN sets are exactly OCP's", "[types][fp8]") {
  int e4 = 0, e5 = 0;
  for (unsigned c = 0; c < 256; ++c) {
    const bool n4 = isnan(e4m3::from_bits(std::uint8_t(c))), n5 = isnan(e5m2::from_bits(std::uint8_t(c)));
    CHECK(n4 == ((c & 0x7F) == 0x7F));  // S.1111.111
    CHECK(n5 == ((c & 0x7F) > 0x7C));   // S.11111.{01,10,11}
    CHECK(isinf(e5m2::from_bits(std::uint8_t(c))) == ((c & 0x7F) == 0x7C));
    CHECK_FALSE(isinf(e4m3::from_bits(std::uint8_t(c))));
    e4 += n4;
    e5 += n5;
  }
  CHECK(e4 == 2);
  CHECK(e5 == 6);
}

TEST_CASE("fp8 conversion table from the issue", "[types][fp8]") {
  struct row {
    float x;
    unsigned e4, e4s, e5, e5s;
  };
  const row rows[] = {
      {1.0f, 0x38, 0x38, 0x3C, 0x3C},
      {448.0f, 0x7E, 0x7E, 0x5F, 0x5F},
      {464.0f, 0x7E, 0x7E, 0x5F, 0x5F},
      {480.0f, 0x7F, 0x7E, 0x60, 0x60},
      {61440.0f, 0x7F, 0x7E, 0x7C, 0x7B},
      {std::ldexp(1.0f, -9), 0x01, 0x01, 0x18, 0x18},
      {std::ldexp(1.0f, -10), 0x00, 0x00, 0x14, 0x14},
      {std::ldexp(1.0f, -16), 0x00, 0x00, 0x01, 0x01},
      {-0.0f, 0x80, 0x80, 0x80, 0x80},
  };
  for (const row& r : rows) {
    INFO("x = " << r.x);
    CHECK(e4m3(r.x).bits() == r.e4);
    CHECK(e4m3(double(r.x)).bits() == r.e4);
    CHECK(enc<e4m3, overflow::saturate>(r.x) == r.e4s);
    CHECK(sat<e4m3>(r.x) == r.e4s);
    CHECK(e5m2(r.x).bits() == r.e5);
    CHECK(enc<e5m2, overflow::saturate>(r.x) == r.e5s);
    CHECK(sat<e5m2>(r.x) == r.e5s);
  }
}

TEST_CASE("fp8 specials: Inf, NaN, ties, subnormal rounding", "[types][fp8]") {
  const float inf = std::numeric_limits<float>::infinity(), qnan = std::numeric_limits<float>::quiet_NaN();
  CHECK(e4m3(inf).bits() == 0x7F);
  CHECK(e4m3(-inf).bits() == 0xFF);
  CHECK(sat<e4m3>(-inf) == 0xFE);
  CHECK(e5m2(-inf).bits() == 0xFC);
  CHECK(sat<e5m2>(inf) == 0x7B);
  CHECK(e4m3(-qnan).bits() == 0xFF);
  CHECK(sat<e4m3>(qnan) == 0x7F);
  CHECK(isnan(e5m2::from_bits(std::uint8_t(sat<e5m2>(qnan)))));
  CHECK(e4m3(std::ldexp(1.0f, -10)).bits() == 0x00);  // exact tie to 0 (even)
  CHECK(e4m3(std::ldexp(3.0f, -10)).bits() == 0x02);  // 1.5 * 2^-9 ties to even 2 * 2^-9
  CHECK(e4m3(std::ldexp(3.0f, -11)).bits() == 0x01);  // 0.75 * 2^-9 rounds to 1 * 2^-9
  CHECK(e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)).bits() == 0x01);
  CHECK(e4m3(std::numeric_limits<float>::denorm_min()).bits() == 0x00);
  CHECK(e4m3(-std::numeric_limits<float>::denorm_min()).bits() == 0x80);
  CHECK(e4m3(0.015625f * 0.97f).bits() == 0x08);  // rounds up into the smallest normal
  // Double does not round twice: just above the tie in double, a tie after rounding to float.
  const double above_tie = 464.0 + std::ldexp(1.0, -40);
  CHECK(float(above_tie) == 464.0f);
  CHECK(e4m3(above_tie).bits() == 0x7F);
  CHECK(e4m3(464.0f).bits() == 0x7E);
  CHECK(e4m3(1).bits() == 0x38);
  CHECK(e5m2(std::int64_t(-57344)).bits() == 0xFB);
  CHECK(e4m3(std::uint64_t(0xFFFFFFFFFFFFFFFFull)).bits() == 0x7F);
  std::ostringstream os;
  os << e4m3(0.5f) << ' ' << e5m2(-3.0f);
  CHECK(os.str() == "0.5 -3");
}

TEST_CASE("fp8 arithmetic and comparison semantics", "[types][fp8]") {
  check_ieee_semantics<e4m3>();
  check_ieee_semantics<e5m2>();
  static_assert(e4m3(448.0f).bits() == 0x7E && float(e5m2::from_bits(0x7B)) == 57344.0f);
  static_assert(double(e4m3(0.1)) == 0.1015625);
}
