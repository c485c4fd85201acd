// pipelined(n): the stages of a K loop, for n in {0, 1, primes, powers of two}: exactly the indices
// 0..n-1 in order, each knowing its count and neighbours, usable in constant expressions.
#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>

#include <tessel/tile/pipelined.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_pipelined {

using namespace tessel;

namespace {
constexpr std::size_t sum_of_stages(std::size_t n) {
  std::size_t s = 0;
  for (auto k : pipelined(n)) s += k;
  return s;
}
}  // namespace

TEST_CASE("pipelined(n) yields exactly 0..n-1 and each stage knows its neighbours", "[tile][pipelined]") {
  for (std::size_t n : {0, 1, 2, 3, 7, 13, 16, 64, 97, 1000}) {
    INFO("n = " << n);
    const auto range = pipelined(n);
    REQUIRE(range.size() == n);
    REQUIRE((range.begin() == range.end()) == (n == 0));
    std::vector<std::size_t> seen;
    std::size_t bad = 0;
    for (auto k : range) {
      const std::size_t i = k;  // converts to its index
      bad += k.index != i || k.count != n;
      bad += k.first() != (i == 0);
      bad += k.last() != (i + 1 == n);
      bad += k.has_next() != (i + 1 < n);
      bad += k.next() != i + 1;
      seen.push_back(i);
    }
    REQUIRE(bad == 0);
    REQUIRE(seen.size() == n);
    for (std::size_t i = 0; i < seen.size(); ++i) REQUIRE(seen[i] == i);
  }
}

TEST_CASE("exactly one stage is first and one is last when n > 0", "[tile][pipelined]") {
  for (std::size_t n = 1; n <= 40; ++n) {
    std::size_t firsts = 0, lasts = 0, with_next = 0;
    for (auto k : pipelined<3>(n)) {
      firsts += k.first();
      lasts += k.last();
      with_next += k.has_next();
    }
    REQUIRE(firsts == 1);
    REQUIRE(lasts == 1);
    REQUIRE(with_next == n - 1);
  }
}

TEST_CASE("pipelined is usable in constant expressions and carries its depth", "[tile][pipelined]") {
  STATIC_REQUIRE(sum_of_stages(0) == 0);
  STATIC_REQUIRE(sum_of_stages(1) == 0);
  STATIC_REQUIRE(sum_of_stages(10) == 45);
  STATIC_REQUIRE(decltype(pipelined(4))::depth == 1);
  STATIC_REQUIRE(decltype(pipelined<3>(4))::depth == 3);
  STATIC_REQUIRE(stage{2, 3}.last());
  STATIC_REQUIRE(!stage{2, 3}.has_next());
  STATIC_REQUIRE(stage{0, 3}.first());
  STATIC_REQUIRE(std::size_t(stage{5, 9}) == 5);
}

}  // namespace tessel_test_tile_pipelined
