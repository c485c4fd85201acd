#include <catch2/catch.hpp>

#include <random>
#include <tessel/emulator/routing.hpp>
#include "error_match.hpp"

namespace tessel_test_emulator_routing {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel::emu;

TEST_CASE("Dijkstra matches Floyd-Warshall on random graphs", "[emulator][routing]") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    const std::uint32_t n = 2 + rng() % 12;
    topology_graph g(n);
    std::vector<double> w;
    const double inf = topology_graph::unreachable;
    std::vector<std::vector<double>> d(n, std::vector<double>(n, inf));
    for (std::uint32_t i = 0; i < n; ++i) d[i][i] = 0;
    const std::uint32_t edges = rng() % (n * n);
    for (std::uint32_t e = 0; e < edges; ++e) {
      std::uint32_t a = rng() % n, b = rng() % n;
      double wt = (rng() % 3 == 0) ? inf : 1 + rng() % 100;  // some edges are "down"
      g.add_edge(a, b, static_cast<std::uint32_t>(w.size()));
      w.push_back(wt);
      if (a != b) d[a][b] = std::min(d[a][b], wt);
    }
    for (std::uint32_t k = 0; k < n; ++k)
      for (std::uint32_t i = 0; i < n; ++i)
        for (std::uint32_t j = 0; j < n; ++j)
          if (d[i][k] + d[k][j] < d[i][j]) d[i][j] = d[i][k] + d[k][j];
    const std::uint32_t src = rng() % n;
    auto t = g.dijkstra(
        src, [&](std::uint32_t id) { return w[id]; }, [](std::uint32_t) { return true; });
    for (std::uint32_t v = 0; v < n; ++v) {
      CHECK(t.dist[v] == d[src][v]);
      if (v != src && t.dist[v] < inf) {
        double sum = 0;
        for (auto id : t.path_to(v)) sum += w[id];
        CHECK(sum == t.dist[v]);
      }
    }
  }
}

TEST_CASE("nodes that do not forward are only endpoints", "[emulator][routing]") {
  topology_graph g(3);
  g.add_edge(0, 1, 0);
  g.add_edge(1, 2, 1);
  auto w = [](std::uint32_t) { return 1.0; };
  auto all = g.dijkstra(0, w, [](std::uint32_t) { return true; });
  CHECK(all.dist[2] == 2);
  auto blocked = g.dijkstra(0, w, [](std::uint32_t n) { return n != 1; });
  CHECK(blocked.dist[1] == 1);
  CHECK(blocked.dist[2] == topology_graph::unreachable);
  CHECK(blocked.path_to(2).empty());
  CHECK_THROWS_MATCHES(g.add_edge(5, 0, 9), invalid_card_error, is_error(errc::out_of_range, "emulator", "outside the"));
  CHECK_THROWS_AS(g.add_edge(0, 5, 9), invalid_card_error);
}
}  // namespace tessel_test_emulator_routing
