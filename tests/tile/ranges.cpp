// make_chunks and split_even against their definitions for sizes 0, 1, primes and chunk edges:
// chunks tile every tensor in order without gaps or overlap, respect the chunk size and the unit
// (row) length, and depend only on the sizes; split_even is a balanced ordered partition.
#include <catch2/catch.hpp>

#include <cstddef>
#include <random>
#include <stdexcept>
#include <vector>

#include <tessel/tile/ranges.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_ranges {

using namespace tessel;
using Catch::Matchers::Contains;

namespace {
// The properties of make_chunks(sizes, chunk, units) for one input; returns the number of violations.
std::size_t chunk_violations(const std::vector<std::size_t>& sizes, std::size_t chunk, const std::vector<std::size_t>& units,
                             const std::vector<chunk_range>& out) {
  std::size_t bad = 0, at = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::size_t u = t < units.size() ? units[t] : 0;
    // the largest chunk: `chunk` rounded down to whole units, but at least one unit
    const std::size_t limit = u == 0 ? chunk : (chunk >= u ? chunk / u * u : u);
    std::size_t next = 0;
    while (at < out.size() && out[at].tensor == t) {
      const chunk_range& c = out[at++];
      bad += c.begin != next;   // contiguous, in order
      bad += c.end <= c.begin;  // never empty
      bad += c.size() != c.end - c.begin;
      bad += c.size() > limit;                        // at most one chunk
      bad += c.end != sizes[t] && c.size() != limit;  // only the last chunk of a tensor is short
      if (u) bad += c.begin % u != 0;                 // whole units stay together
      next = c.end;
    }
    bad += next != sizes[t];  // covers the tensor exactly
  }
  bad += at != out.size();  // tensors appear in order, nothing else
  return bad;
}
}  // namespace

TEST_CASE("make_chunks tiles every tensor in order within the chunk size", "[tile][ranges]") {
  const std::vector<std::size_t> interesting{0, 1, 2, 3, 7, 13, 63, 64, 65, 127, 128, 129, 1000, 4099};
  for (std::size_t chunk : {1, 2, 3, 7, 64, 128, 1000}) {
    std::vector<std::size_t> sizes = interesting;
    const auto out = make_chunks(sizes, chunk);
    INFO("chunk " << chunk);
    REQUIRE(chunk_violations(sizes, chunk, {}, out) == 0);
  }
  // the default chunk
  const std::vector<std::size_t> big{default_stream_chunk - 1, default_stream_chunk, default_stream_chunk + 1, 3 * default_stream_chunk};
  const auto out = make_chunks(big);
  REQUIRE(chunk_violations(big, default_stream_chunk, {}, out) == 0);
  REQUIRE(out.size() == 1 + 1 + 2 + 3);
  REQUIRE(make_chunks({}).empty());
  REQUIRE(make_chunks({0, 0, 0}).empty());
}

TEST_CASE("make_chunks keeps whole units (rows) inside one chunk, for random sizes and units", "[tile][ranges]") {
  std::mt19937 g(16);
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t tensors = g() % 6;
    std::vector<std::size_t> sizes(tensors), units(g() % (tensors + 1));
    for (auto& u : units) u = g() % 3 == 0 ? 0 : 1 + g() % 50;
    for (std::size_t t = 0; t < tensors; ++t) {
      const std::size_t u = t < units.size() && units[t] ? units[t] : 1;
      sizes[t] = u * (g() % 40);  // whole rows
    }
    const std::size_t chunk = 1 + g() % 200;
    const auto out = make_chunks(sizes, chunk, units);
    INFO("trial " << trial << " chunk " << chunk);
    REQUIRE(chunk_violations(sizes, chunk, units, out) == 0);
    // chunk boundaries depend only on the inputs
    REQUIRE(make_chunks(sizes, chunk, units).size() == out.size());
  }
}

TEST_CASE("make_chunks rejects a zero chunk size", "[tile][ranges]") {
  REQUIRE_THROWS_WITH(make_chunks({5}, 0), Contains("chunk size must be positive"));
  REQUIRE_THROWS_AS(make_chunks({5}, 0), std::exception);
}

TEST_CASE("split_even is an ordered partition whose parts differ by at most one", "[tile][ranges]") {
  for (std::size_t n : {0, 1, 2, 3, 5, 7, 13, 64, 97, 1000, 1009}) {
    for (std::size_t parts = 1; parts <= 19; ++parts) {
      std::size_t next = 0, lo = SIZE_MAX, hi = 0, bad = 0;
      for (std::size_t i = 0; i < parts; ++i) {
        const chunk_range c = split_even(n, parts, i);
        bad += c.begin != next || c.end < c.begin || c.tensor != 0;
        lo = std::min(lo, c.size());
        hi = std::max(hi, c.size());
        if (i > 0) bad += c.size() > split_even(n, parts, i - 1).size();  // larger parts first
        next = c.end;
      }
      INFO("n " << n << " parts " << parts);
      REQUIRE(bad == 0);
      REQUIRE(next == n);
      REQUIRE(hi - lo <= 1);
      REQUIRE(lo == n / parts);
    }
  }
}

TEST_CASE("split_even rejects zero parts and parts past the end", "[tile][ranges]") {
  REQUIRE_THROWS_WITH(split_even(10, 0, 0), Contains("split_even"));
  REQUIRE_THROWS_WITH(split_even(10, 3, 3), Contains("split_even part 3 of 3"));
  REQUIRE_THROWS_AS(split_even(10, 3, 7), std::exception);
}

}  // namespace tessel_test_tile_ranges
