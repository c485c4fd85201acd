// The largest count, 2^20 elements, through the full verifiable-data matrix of
// communicator.cpp (every collective x dtype x op x algorithm x in/out-of-place x ranks
// {1, 2, 3, 5, 8}); too long for the default suite, which runs 2^20 on a subset.
#include "verifiable.hpp"

namespace {
constexpr std::size_t big[] = {std::size_t{1} << 20};
}  // namespace

TEST_CASE("2^20 elements, full matrix: all_reduce", "[collectives][exhaustive]") { all_reduce_matrix(big); }

TEST_CASE("2^20 elements in all, full matrix: reduce_scatter", "[collectives][exhaustive]") { reduce_scatter_matrix(big, true); }

TEST_CASE("2^20 elements, full matrix: reduce", "[collectives][exhaustive]") { reduce_matrix(big); }

TEST_CASE("2^20 elements, full matrix: broadcast, all_gather, gather, scatter, all_to_all(v), send/recv", "[collectives][exhaustive]") {
  movement_matrix(big);
}
