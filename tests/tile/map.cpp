// map, reduce_rows and reduce_cols against plain loops over fragments and staged tiles in every
// layout, shapes incl. 1x1, primes and panel edges: map is elementwise (in place too), and the
// reductions fold in the documented order (checked with an order-sensitive integer fold).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <tessel/tile/map.hpp>
#include <tessel/types/bf16.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_map {

using namespace tessel;

namespace {
scratch_arena& arena() {
  static scratch_arena a;
  return a;
}

template <class Tile>
void fill_random(Tile& t, std::mt19937& g) {
  std::uniform_int_distribution<int> d(-1000, 1000);
  for (std::size_t r = 0; r < Tile::tile_rows; ++r)
    for (std::size_t c = 0; c < Tile::tile_cols; ++c) t(r, c) = typename Tile::value_type(float(d(g)) / 8.0f);
}

template <class Src, class Dst>
void check_map(Src& a, Dst& b, std::mt19937& g) {
  constexpr std::size_t R = Src::tile_rows, C = Src::tile_cols;
  fill_random(b, g);
  fill_random(a, g);  // (a and b may be one tile: src == dst is allowed)
  std::vector<typename Src::value_type> src;
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) src.push_back(a(r, c));
  const auto f = [](auto x) { return typename Dst::value_type(float(x) * 3.0f - 1.0f); };
  map(a, b, f);
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) REQUIRE(float(b(r, c)) == float(f(src[r * C + c])));
  // in place: t(r, c) = f(t(r, c))
  std::vector<float> before;
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) before.push_back(float(a(r, c)));
  map(a, [](auto x) { return decltype(x)(-float(x)); });
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) REQUIRE(float(a(r, c)) == -before[r * C + c]);
}

template <std::size_t R, std::size_t C, class L>
void check_map_shapes(std::mt19937& g) {
  block_ctx ctx(grid{1}, 0, 0, 1, arena());
  fragment<float, R, C> f;
  staged<float, R, C, L> s{ctx};
  staged<bf16, R, C, L> sb{ctx};
  check_map(f, s, g);
  check_map(s, f, g);
  check_map(f, sb, g);
  check_map(s, s, g);
}

// An order-sensitive fold (a polynomial hash): equal results mean equal order.
constexpr std::uint64_t fold(std::uint64_t acc, std::uint64_t x) { return acc * 31 + x; }  // wraps: defined

template <std::size_t R, std::size_t C>
void check_reduce(std::mt19937& g) {
  fragment<std::uint64_t, R, C> t;
  for (auto& x : t.v) x = g() % 1000;
  std::uint64_t rows[R], cols[C];
  reduce_rows(t, rows, fold, 7);
  reduce_cols(t, cols, fold, 7);
  for (std::size_t r = 0; r < R; ++r) {
    std::uint64_t want = 7;
    for (std::size_t c = 0; c < C; ++c) want = fold(want, t(r, c));  // column order
    REQUIRE(rows[r] == want);
  }
  for (std::size_t c = 0; c < C; ++c) {
    std::uint64_t want = 7;
    for (std::size_t r = 0; r < R; ++r) want = fold(want, t(r, c));  // row order
    REQUIRE(cols[c] == want);
  }
  // float sum/max through a std::vector output, against the same loops
  fragment<float, R, C> f;
  fill_random(f, g);
  std::vector<float> mx(R), sum(C);
  reduce_rows(
      f, mx, [](float a, float b) { return std::fmax(a, b); }, -INFINITY);
  reduce_cols(
      f, sum, [](float a, float b) { return a + b; }, 0.0f);
  for (std::size_t r = 0; r < R; ++r) {
    float want = -INFINITY;
    for (std::size_t c = 0; c < C; ++c) want = std::fmax(want, f(r, c));
    REQUIRE(mx[r] == want);
  }
  for (std::size_t c = 0; c < C; ++c) {
    float want = 0.0f;
    for (std::size_t r = 0; r < R; ++r) want += f(r, c);
    REQUIRE(sum[c] == want);
  }
}
}  // namespace

TEST_CASE("map is elementwise for every tile kind, layout and edge shape", "[tile][map]") {
  std::mt19937 g(21);
  check_map_shapes<1, 1, layout::row>(g);
  check_map_shapes<7, 13, layout::row>(g);
  check_map_shapes<7, 13, layout::col>(g);
  check_map_shapes<7, 13, layout::panel<4, 1>>(g);
  check_map_shapes<13, 7, layout::vnni2<4>>(g);
  check_map_shapes<16, 32, layout::col_panel<16, 1>>(g);
}

TEST_CASE("reduce_rows folds in column order, reduce_cols in row order", "[tile][map]") {
  std::mt19937 g(22);
  check_reduce<1, 1>(g);
  check_reduce<1, 17>(g);
  check_reduce<17, 1>(g);
  check_reduce<7, 13>(g);
  check_reduce<16, 16>(g);
}

TEST_CASE("reduce over a staged panel tile equals the reduction of its row-major copy", "[tile][map]") {
  std::mt19937 g(23);
  block_ctx ctx(grid{1}, 0, 0, 1, arena());
  staged<float, 9, 11, layout::panel<4, 1>> p{ctx};
  fragment<float, 9, 11> f;
  fill_random(p, g);
  map(p, f, [](float x) { return x; });
  float a[9], b[9], c[11], d[11];
  reduce_rows(
      p, a, [](float x, float y) { return x + y; }, 0.5f);
  reduce_rows(
      f, b, [](float x, float y) { return x + y; }, 0.5f);
  reduce_cols(
      p, c, [](float x, float y) { return x * 0.5f + y; }, 1.0f);
  reduce_cols(
      f, d, [](float x, float y) { return x * 0.5f + y; }, 1.0f);
  for (int i = 0; i < 9; ++i) REQUIRE(a[i] == b[i]);
  for (int i = 0; i < 11; ++i) REQUIRE(c[i] == d[i]);
}

}  // namespace tessel_test_tile_map
