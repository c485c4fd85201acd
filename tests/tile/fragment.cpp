// fragment and staged tiles: element (r, c) lives where the tile's layout says, the mapping is a
// bijection of [0,R)x[0,C) into the storage (row, col, panel and column-panel layouts, shapes incl.
// 1, primes and panel edges), storage from the arena is 64-byte aligned, and the concepts accept
// exactly the tiles each primitive can use.
#include <catch2/catch.hpp>

#include <cstdint>
#include <set>
#include <vector>

#include <tessel/tile/fragment.hpp>
#include <tessel/types/bf16.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_fragment {

using namespace tessel;

namespace {
scratch_arena& arena() {
  static scratch_arena a;
  return a;
}

// staged<T, R, C, L>: operator() addresses L::offset, every offset is inside the storage, and no two
// elements share one.
template <class T, std::size_t R, std::size_t C, class L>
void check_staged() {
  using S = staged<T, R, C, L>;
  STATIC_REQUIRE(S::elements == L::size(R, C));
  STATIC_REQUIRE(S::elements >= R * C);
  block_ctx ctx(grid{1}, 0, 0, 1, arena());
  S s{ctx};
  REQUIRE(reinterpret_cast<std::uintptr_t>(s.data()) % 64 == 0);
  std::set<std::size_t> offsets;
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) {
      const std::size_t off = static_cast<std::size_t>(&s(r, c) - s.data());
      REQUIRE(off == L::offset(r, c, R, C));
      REQUIRE(off < S::elements);
      offsets.insert(off);
      const S& cs = s;
      REQUIRE(&cs(r, c) == &s(r, c));
    }
  REQUIRE(offsets.size() == R * C);
  s.fill(T(3.0f));
  for (std::size_t i = 0; i < S::elements; ++i) REQUIRE(float(s.data()[i]) == 3.0f);
  // over caller storage
  std::vector<T> mem(S::elements);
  S t(mem.data());
  REQUIRE(t.data() == mem.data());
  t(R - 1, C - 1) = T(5.0f);
  REQUIRE(float(mem[L::offset(R - 1, C - 1, R, C)]) == 5.0f);
}

template <class T, std::size_t R, std::size_t C>
void check_fragment() {
  using F = fragment<T, R, C>;
  F f{};
  STATIC_REQUIRE(alignof(F) == 64);
  STATIC_REQUIRE(F::tile_rows == R && F::tile_cols == C && F::ld == C);
  for (std::size_t i = 0; i < R * C; ++i) REQUIRE(float(f.v[i]) == 0.0f);  // value-initialised
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) REQUIRE(&f(r, c) == f.data() + r * C + c);  // row-major
  f.fill(T(2.0f));
  for (auto x : f.v) REQUIRE(float(x) == 2.0f);
}
}  // namespace

TEST_CASE("staged tiles address their layout, bijectively, in every layout and edge shape", "[tile][fragment]") {
  check_staged<float, 1, 1, layout::row>();
  check_staged<float, 7, 13, layout::row>();
  check_staged<float, 7, 13, layout::col>();
  check_staged<float, 7, 13, layout::panel<4, 1>>();
  check_staged<bf16, 7, 13, layout::panel<4, 2>>();
  check_staged<float, 16, 32, layout::panel<8, 1>>();
  check_staged<bf16, 13, 7, layout::col_panel<4, 2>>();
  check_staged<bf16, 32, 64, layout::vnni2<32>>();
  check_staged<float, 5, 17, layout::col_panel<16, 1>>();
  check_staged<bf16, 1, 1, layout::vnni2<16>>();
  check_staged<float, 1, 1, layout::panel<8, 1>>();
}

TEST_CASE("staged leading dimension is the row/column length, 0 for panels", "[tile][fragment]") {
  STATIC_REQUIRE(staged<float, 7, 13, layout::row>::ld == 13);
  STATIC_REQUIRE(staged<float, 7, 13, layout::col>::ld == 7);
  STATIC_REQUIRE(staged<float, 7, 13, layout::panel<4, 1>>::ld == 0);
  STATIC_REQUIRE(staged<bf16, 7, 13, layout::vnni2<16>>::ld == 0);
}

TEST_CASE("fragments are zero-initialised, 64-byte aligned, row-major", "[tile][fragment]") {
  check_fragment<float, 1, 1>();
  check_fragment<float, 3, 7>();
  check_fragment<bf16, 5, 13>();
  check_fragment<float, 16, 16>();
  STATIC_REQUIRE(std::is_same_v<rt_f<2, 4>, fragment<float, 2, 4>>);
}

TEST_CASE("concepts accept exactly the tiles each primitive takes", "[tile][fragment]") {
  STATIC_REQUIRE(tile_like<fragment<float, 2, 3>>);
  STATIC_REQUIRE(tile_like<staged<bf16, 4, 4, layout::vnni2<2>>>);
  STATIC_REQUIRE(row_major_tile<fragment<bf16, 2, 3>>);
  STATIC_REQUIRE(row_major_tile<staged<float, 2, 3>>);
  STATIC_REQUIRE_FALSE(row_major_tile<staged<float, 2, 3, layout::col>>);
  STATIC_REQUIRE_FALSE(row_major_tile<staged<float, 8, 8, layout::panel<4, 1>>>);
  STATIC_REQUIRE(f32_accumulator<fragment<float, 2, 3>>);
  STATIC_REQUIRE(f32_accumulator<staged<float, 6, 64>>);
  STATIC_REQUIRE_FALSE(f32_accumulator<fragment<bf16, 2, 3>>);
  STATIC_REQUIRE_FALSE(f32_accumulator<staged<float, 2, 3, layout::col>>);
  STATIC_REQUIRE_FALSE(tile_like<float>);
  STATIC_REQUIRE_FALSE(tile_like<std::vector<float>>);
}

}  // namespace tessel_test_tile_fragment
