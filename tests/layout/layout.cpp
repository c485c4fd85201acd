// Layouts are bijections from (r, c) onto [0, size) (panel padding aside), property-tested over
// whole index domains.
#include <catch2/catch.hpp>

#include <vector>

#include <tessel/layout/layout.hpp>

using namespace tessel;

template <class L>
static void check_injective(std::size_t R, std::size_t C) {
  std::vector<int> hit(L::size(R, C), 0);
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) {
      const std::size_t o = L::offset(r, c, R, C);
      REQUIRE(o < hit.size());
      REQUIRE(hit[o]++ == 0);
    }
}

TEST_CASE("row and col are bijections", "[layout][basic]") {
  for (std::size_t R : {1, 3, 8, 13})
    for (std::size_t C : {1, 5, 16}) {
      check_injective<layout::row>(R, C);
      check_injective<layout::col>(R, C);
      REQUIRE(layout::row::size(R, C) == R * C);
    }
  STATIC_REQUIRE(layout::row::offset(2, 3, 4, 5) == 13);
  STATIC_REQUIRE(layout::col::offset(2, 3, 4, 5) == 14);
}

TEST_CASE("panel and col_panel are injective and pad to whole panels", "[layout][panel]") {
  for (std::size_t R : {1, 7, 12, 25})
    for (std::size_t C : {1, 2, 9, 32}) {
      check_injective<layout::panel<8, 1>>(R, C);
      check_injective<layout::panel<12, 2>>(R, C);
      check_injective<layout::col_panel<16, 1>>(R, C);
      check_injective<layout::vnni2<32>>(R, C);
      REQUIRE(layout::panel<12, 2>::size(R, C) == ((R + 11) / 12 * 12) * ((C + 1) / 2 * 2));
    }
}

TEST_CASE("panel element order is what the atoms read", "[layout][panel]") {
  // panel<MR,KP>: K-group g, row i, pair q at g*MR*KP + i*KP + q inside the first panel
  using P = layout::panel<4, 2>;
  STATIC_REQUIRE(P::offset(1, 0, 4, 6) == 2);
  STATIC_REQUIRE(P::offset(1, 1, 4, 6) == 3);
  STATIC_REQUIRE(P::offset(0, 2, 4, 6) == 8);
  STATIC_REQUIRE(P::offset(4, 0, 8, 6) == 4 * 6);
  // vnni2<NR>: rows k, k+1 of column n adjacent
  using V = layout::vnni2<16>;
  STATIC_REQUIRE(V::offset(0, 3, 4, 32) == 6);
  STATIC_REQUIRE(V::offset(1, 3, 4, 32) == 7);
  STATIC_REQUIRE(V::offset(2, 0, 4, 32) == 32);
  STATIC_REQUIRE(V::offset(0, 16, 4, 32) == 16 * 4);
}

TEST_CASE("swizzle is a bijection within each row", "[layout][swizzle]") {
  for (std::size_t row = 0; row < 16; ++row) {
    std::vector<int> hit(8, 0);
    for (std::size_t c = 0; c < 8; ++c) hit[layout::swizzle<3>(row, c)]++;
    for (int h : hit) REQUIRE(h == 1);
  }
}
