// grid, ceil_div, scratch_arena, block_ctx and the tile_program concept: grid linearisation is a
// bijection onto [0, size) with the first index fastest; ceil_div is the least cover for all small
// operands and never overflows; the arena hands out aligned, disjoint blocks, rewinds to marks
// and keeps its chunks' memory across resets; block_ctx reports what it was built with.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include <tessel/tile/block_ctx.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_block_ctx {

using namespace tessel;
using Catch::Matchers::Contains;

TEST_CASE("grid linear ids and (i0, i1, i2) are a bijection, first index fastest", "[tile][grid]") {
  for (grid g : {grid{}, grid{1}, grid{7}, grid{3, 5}, grid{2, 3, 4}, grid{13, 1, 7}, grid{1, 1, 11}, grid{5, 0}, grid{0, 3, 2}}) {
    INFO("grid " << g.x << "x" << g.y << "x" << g.z);
    REQUIRE(g.size() == g.x * g.y * g.z);
    REQUIRE(g.empty() == (g.size() == 0));
    std::vector<int> hit(g.size(), 0);
    for (std::size_t l = 0; l < g.size(); ++l) {
      const auto [i0, i1, i2] = g.index_of(l);
      REQUIRE(i0 < g.x);
      REQUIRE(i1 < g.y);
      REQUIRE(i2 < g.z);
      REQUIRE(i0 + g.x * (i1 + g.y * i2) == l);
      ++hit[i0 + g.x * (i1 + g.y * i2)];
    }
    REQUIRE(std::all_of(hit.begin(), hit.end(), [](int h) { return h == 1; }));
  }
  STATIC_REQUIRE(grid{4, 5}.size() == 20);
  STATIC_REQUIRE(grid{4, 5, 2}.index_of(27) == std::array<std::size_t, 3>{3, 1, 1});
  STATIC_REQUIRE(grid{} == grid{1, 1, 1});
  STATIC_REQUIRE(grid{2} != grid{2, 2});
}

TEST_CASE("a grid with more than SIZE_MAX blocks throws instead of wrapping", "[tile][grid][errors]") {
  const std::size_t big = std::size_t{1} << 33;
  REQUIRE(grid{big, big >> 4}.size() == big * (big >> 4));
  REQUIRE_THROWS_WITH(grid(big, big).size(), Contains("too many blocks"));
  REQUIRE_THROWS_WITH(grid(big, 2, big).size(), Contains("too many blocks"));
  REQUIRE_THROWS_AS(grid(SIZE_MAX, 2).size(), std::exception);
  REQUIRE_FALSE(grid(SIZE_MAX, 1).empty());
}

TEST_CASE("ceil_div(a, b) is the least q with q*b >= a, for all small a, b and at the top of size_t", "[tile][grid]") {
  for (std::size_t a = 0; a <= 300; ++a)
    for (std::size_t b = 1; b <= 40; ++b) {
      const std::size_t q = ceil_div(a, b);
      if (q * b < a || (q > 0 && (q - 1) * b >= a)) FAIL("ceil_div(" << a << ", " << b << ") = " << q);
    }
  REQUIRE(ceil_div(7, 0) == 0);  // documented: no division by zero
  REQUIRE(ceil_div(SIZE_MAX, 1) == SIZE_MAX);
  REQUIRE(ceil_div(SIZE_MAX, 2) == SIZE_MAX / 2 + 1);
  REQUIRE(ceil_div(SIZE_MAX, SIZE_MAX) == 1);
  REQUIRE(ceil_div(SIZE_MAX - 1, SIZE_MAX) == 1);
  STATIC_REQUIRE(ceil_div(10, 3) == 4);
}

TEST_CASE("scratch_arena hands out aligned, disjoint blocks (seeded sizes and alignments)", "[tile][scratch]") {
  std::mt19937 g(6);
  for (std::size_t initial : {std::size_t{64}, std::size_t{4096}, std::size_t{1} << 16}) {
    scratch_arena a(initial);
    REQUIRE(a.capacity() == 0);
    REQUIRE(a.high_water() == 0);
    for (int round = 0; round < 4; ++round) {
      std::vector<std::pair<unsigned char*, std::size_t>> blocks;
      std::size_t last_high = a.high_water();
      for (int i = 0; i < 60; ++i) {
        const std::size_t bytes = g() % 3 == 0 ? g() % 5 : g() % 3000;
        const std::size_t align = std::size_t{1} << (g() % 13);  // 1 .. 4096
        auto* p = static_cast<unsigned char*>(a.allocate(bytes, align));
        REQUIRE(p != nullptr);
        REQUIRE(reinterpret_cast<std::uintptr_t>(p) % align == 0);
        std::memset(p, i + 1, bytes);
        blocks.emplace_back(p, bytes);
        REQUIRE(a.high_water() >= last_high);  // never decreases
        last_high = a.high_water();
      }
      // every block still holds its own pattern: none overlapped another or moved
      for (std::size_t i = 0; i < blocks.size(); ++i)
        for (std::size_t j = 0; j < blocks[i].second; ++j)
          if (blocks[i].first[j] != static_cast<unsigned char>(i + 1)) FAIL("block " << i << " byte " << j << " was overwritten");
      a.reset();
    }
    REQUIRE(a.capacity() >= a.high_water());
  }
}

TEST_CASE("scratch_arena: reset keeps one consolidated chunk, marks rewind to the same address", "[tile][scratch]") {
  scratch_arena a(256);
  (void)a.allocate(100);
  (void)a.allocate(6000);  // a second chunk
  (void)a.allocate(9000);  // a third
  const std::size_t cap = a.capacity();
  a.reset();
  REQUIRE(a.capacity() >= cap);  // merged, not freed
  // the whole previous footprint now fits in the one chunk, without growing
  void* p = a.allocate(100);
  void* q = a.allocate(6000, 64);
  void* r = a.allocate(9000, 64);
  REQUIRE(a.capacity() == cap);
  REQUIRE(static_cast<char*>(q) >= static_cast<char*>(p) + 100);
  REQUIRE(static_cast<char*>(r) >= static_cast<char*>(q) + 6000);
  REQUIRE(static_cast<char*>(r) + 9000 <= static_cast<char*>(p) + cap);
  const auto m = a.mark();
  void* x = a.allocate(32);
  (void)a.allocate(10000);
  a.rewind(m);
  REQUIRE(a.allocate(32) == x);
  // a mark of an empty arena rewinds to the start
  scratch_arena e(128);
  const auto m0 = e.mark();
  void* y = e.allocate(16);
  e.rewind(m0);
  REQUIRE(e.allocate(16) == y);
}

TEST_CASE("scratch_arena rejects bad alignments and overflowing arrays", "[tile][scratch][errors]") {
  scratch_arena a(1024);
  for (std::size_t bad : {std::size_t{0}, std::size_t{3}, std::size_t{48}, std::size_t{8192}})
    REQUIRE_THROWS_WITH(a.allocate(8, bad), Contains("alignment"));
  REQUIRE_THROWS_WITH(a.allocate_array<double>(SIZE_MAX / 4), Contains("overflows"));
  auto* d = a.allocate_array<double>(3, 1);  // the element's own alignment is the floor
  REQUIRE(reinterpret_cast<std::uintptr_t>(d) % alignof(double) == 0);
  // a failed request leaves the arena usable
  REQUIRE(a.allocate(8) != nullptr);
}

TEST_CASE("block_ctx reports its grid, block, worker and arena", "[tile][block_ctx]") {
  scratch_arena a(1024);
  const grid g{3, 4, 5};
  for (std::size_t l = 0; l < g.size(); l += 7) {
    block_ctx ctx(g, l, 1, 2, a);
    REQUIRE(ctx.dims() == g);
    REQUIRE(ctx.block_linear() == l);
    REQUIRE(ctx.block_index3() == g.index_of(l));
    REQUIRE(ctx.block_index() == std::array<std::size_t, 2>{g.index_of(l)[0], g.index_of(l)[1]});
    REQUIRE(ctx.worker_id() == 1);
    REQUIRE(ctx.num_workers() == 2);
    REQUIRE(&ctx.scratch() == &a);
  }
}

namespace {
struct copyable_program {
  void operator()(block_ctx&) const {}
};
struct move_only_program {
  move_only_program() = default;
  move_only_program(move_only_program&&) = default;
  move_only_program(const move_only_program&) = delete;
  void operator()(block_ctx&) const {}
};
struct wrong_signature {
  void operator()(int) const {}
};
struct non_const_call {
  void operator()(block_ctx&) {}
};
}  // namespace

TEST_CASE("tile_program: a copyable callable taking block_ctx& through a const object", "[tile][block_ctx]") {
  STATIC_REQUIRE(tile_program<copyable_program>);
  STATIC_REQUIRE(tile_program<decltype([](block_ctx&) {})>);
  STATIC_REQUIRE_FALSE(tile_program<move_only_program>);
  STATIC_REQUIRE_FALSE(tile_program<wrong_signature>);
  STATIC_REQUIRE_FALSE(tile_program<non_const_call>);
  STATIC_REQUIRE_FALSE(tile_program<int>);
}

}  // namespace tessel_test_tile_block_ctx
