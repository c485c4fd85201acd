// tessel::int4x2: packing, sign extension, range errors.
#include <catch2/catch.hpp>
#include <tessel/types/int4.hpp>
#include <vector>
#include "error_match.hpp"

using tessel_test::is_error;
using tessel::errc;

using tessel::int4x2;

TEST_CASE("int4x2 packs every pair and unpacks it", "[types][int4]") {
  for (int lo = -8; lo <= 7; ++lo)
    for (int hi = -8; hi <= 7; ++hi) {
      const int4x2 p(lo, hi);
      REQUIRE(p.lo() == lo);
      REQUIRE(p.hi() == hi);
      REQUIRE(p.get(0) == lo);
      REQUIRE(p.get(1) == hi);
      REQUIRE(int4x2::from_bits(p.bits()) == p);
      REQUIRE(int4x2::saturate(lo, hi) == p);
    }
  CHECK(int4x2(-1, 2).bits() == 0x2F);
  CHECK(int4x2(7, -8).bits() == 0x87);
  static_assert(int4x2(3, -4).hi() == -4);
}

TEST_CASE("int4x2 rejects values outside [-8, 7]", "[types][int4]") {
  CHECK_THROWS_MATCHES(int4x2(8, 0), tessel::type_error, is_error(errc::out_of_range, "types"));
  CHECK_THROWS_MATCHES(int4x2(0, -9), tessel::type_error, is_error(errc::out_of_range, "types"));
  CHECK_THROWS_WITH(int4x2(100, 0), Catch::Contains("100"));
  CHECK_THROWS_MATCHES(int4x2(1, 1).get(2), tessel::type_error, is_error(errc::out_of_range, "types"));
  CHECK(int4x2::saturate(100, -100) == int4x2(7, -8));
}

TEST_CASE("pack_int4 / unpack_int4 over spans", "[types][int4]") {
  std::vector<std::int8_t> v;
  for (int i = -8; i <= 7; ++i) v.push_back(std::int8_t(i));
  v.push_back(3);
  v.push_back(-1);
  std::vector<int4x2> packed(v.size() / 2);
  tessel::pack_int4(v, packed);
  CHECK(packed[0] == int4x2(-8, -7));
  std::vector<std::int8_t> back(v.size());
  tessel::unpack_int4(packed, back);
  CHECK(back == v);
  v[5] = 100;
  v[6] = -128;
  CHECK_THROWS_MATCHES(tessel::pack_int4(v, packed, tessel::overflow::propagate), tessel::type_error, is_error(errc::out_of_range, "types"));
  CHECK_THROWS_WITH(tessel::pack_int4(v, packed, tessel::overflow::propagate), Catch::Contains("100") && Catch::Contains("5"));
  tessel::pack_int4(v, packed);  // saturates
  CHECK(packed[2].hi() == 7);
  CHECK(packed[3].lo() == -8);
  CHECK_THROWS_MATCHES(tessel::pack_int4(std::span<const std::int8_t>(v.data(), 3), packed), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_MATCHES(tessel::unpack_int4(packed, std::span<std::int8_t>(back.data(), 5)), tessel::type_error,
                       is_error(errc::invalid_argument, "types"));
}
