// tessel::int4x2: packing, sign extension, range errors.
#include <catch2/catch.hpp>
#include <tessel/types/int4.hpp>

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
  CHECK_THROWS_AS(int4x2(8, 0), std::out_of_range);
  CHECK_THROWS_AS(int4x2(0, -9), std::out_of_range);
  CHECK_THROWS_WITH(int4x2(100, 0), Catch::Contains("100"));
  CHECK_THROWS_AS(int4x2(1, 1).get(2), std::out_of_range);
  CHECK(int4x2::saturate(100, -100) == int4x2(7, -8));
}
