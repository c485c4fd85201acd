// nn::arena_plan: offsets for tensors with lifetimes, checked against the rules that define a
// correct plan (no two tensors live in a common phase share a byte; offsets aligned; the arena at
// least the most bytes live in one phase and at most one buffer per tensor), over random tables.
#include <tessel/nn/arena.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <random>
#include <utility>
#include <vector>

#include "error_match.hpp"

namespace tessel_test_nn_arena {

using namespace tessel;
using tessel_test::is_error;

namespace {

void check_plan(const nn::arena_plan& p) {
  REQUIRE(p.solved());
  for (std::size_t a = 0; a < p.tensors(); ++a) {
    CHECK(p.offset(a) % nn::arena_plan::alignment == 0);
    CHECK(p.offset(a) + p.bytes(a) <= p.size());
    for (std::size_t b = a + 1; b < p.tensors(); ++b) {
      const bool together = p.first(a) <= p.last(b) && p.first(b) <= p.last(a);
      const bool share = p.offset(a) < p.offset(b) + p.bytes(b) && p.offset(b) < p.offset(a) + p.bytes(a);
      if (together && share) FAIL_CHECK("tensors " << a << " and " << b << " live together and share bytes");
    }
  }
  CHECK(p.size() >= p.live_peak());
  CHECK(p.size() <= p.total());
}

}  // namespace

TEST_CASE("arena plans keep tensors live together apart and reuse the bytes of dead ones", "[nn][arena]") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    nn::arena_plan p;
    const std::size_t phases = 1 + rng() % 40, count = rng() % 60;
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t a = rng() % phases, b = rng() % phases;
      p.add(rng() % 5000, std::min(a, b), std::max(a, b));  // sizes from 0, not multiples of 64
    }
    p.solve();
    check_plan(p);
    nn::arena_plan q = p;
    q.solve(false);  // one buffer per tensor
    check_plan(q);
    CHECK(q.size() == q.total());
  }
  // a chain of tensors each live in its own phase shares one place; tensors live together stack
  nn::arena_plan chain;
  for (std::size_t i = 0; i < 10; ++i) chain.add(1000, i, i);
  chain.solve();
  CHECK(chain.size() == 1024);
  CHECK(chain.total() == 10 * 1024);
  nn::arena_plan stack;
  for (std::size_t i = 0; i < 10; ++i) stack.add(64, 0, 3);
  stack.solve();
  CHECK(stack.size() == 640);
}

TEST_CASE("arena free ranges are the bytes no tensor live in a phase covers", "[nn][arena]") {
  nn::arena_plan p;
  const std::size_t a = p.add(128, 0, 1), b = p.add(64, 1, 2), c = p.add(128, 2, 3);
  p.solve();
  check_plan(p);
  CHECK(p.offset(a) != p.offset(b));
  CHECK(p.offset(c) == p.offset(a));  // c is born after a died: its bytes
  CHECK(p.size() == 192);
  using ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  CHECK(p.free_ranges(0) == ranges{{128, 192}});
  CHECK(p.free_ranges(1).empty());
  CHECK(p.free_ranges(3) == ranges{{128, 192}});
  CHECK(p.free_ranges(7) == ranges{{0, 192}});  // after every lifetime: all of it
}

TEST_CASE("arena plan errors are typed", "[nn][arena][errors]") {
  nn::arena_plan p;
  CHECK_THROWS_MATCHES(p.add(8, 3, 2), nn::nn_error, is_error(errc::invalid_argument, "nn", "from phase 3 to 2"));
  p.add(8, 0, 0);
  CHECK_THROWS_MATCHES(p.offset(0), nn::nn_error, is_error(errc::invalid_argument, "nn", "before solve"));
  p.solve();
  CHECK_THROWS_MATCHES(p.offset(1), nn::nn_error, is_error(errc::out_of_range, "nn", "no tensor 1"));
  CHECK_THROWS_AS(p.add(std::size_t(-1), 0, 0), overflow_error);
  p.add(std::size_t(-1) / 2, 0, 0);
  CHECK_THROWS_AS(p.add(std::size_t(-1) / 2, 0, 0), overflow_error);  // the total overflows
}

}  // namespace tessel_test_nn_arena
