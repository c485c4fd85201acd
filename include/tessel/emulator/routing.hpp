// Topology graph and shortest paths for the emulated fabric: nodes are cards and switches,
// directed edges are ports. The fabric asks the router for a card-level route (direct over a set
// of planes, or 2-hop through a transit card); routes are cached per topology epoch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

#include <tessel/emulator/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

// A directed graph with weighted edges; weights are supplied at query time so the same graph
// serves latency-only and latency+load queries.
class topology_graph {
 public:
  struct edge {
    std::uint32_t to;
    std::uint32_t id;  // caller's edge id (a port)
  };
  explicit topology_graph(std::size_t nodes = 0) : adj_(nodes) {}
  std::size_t nodes() const { return adj_.size(); }
  void resize(std::size_t n) { adj_.resize(n); }
  void add_edge(std::uint32_t from, std::uint32_t to, std::uint32_t id) {
    if (from >= adj_.size() || to >= adj_.size())
      throw invalid_card_error("routing: edge " + std::to_string(from) + " -> " + std::to_string(to) + " names a node outside the " +
                               std::to_string(adj_.size()) + "-node graph");
    adj_[from].push_back({to, id});
  }
  const std::vector<edge>& out(std::uint32_t n) const { return adj_[n]; }

  static constexpr double unreachable = std::numeric_limits<double>::infinity();
  static constexpr std::uint32_t none = std::numeric_limits<std::uint32_t>::max();

  struct tree {
    std::vector<double> dist;
    std::vector<std::uint32_t> parent_edge;  // edge id used to reach the node
    std::vector<std::uint32_t> parent;       // previous node
    // Edge ids from the source to `dst` (empty if unreachable or dst == source).
    std::vector<std::uint32_t> path_to(std::uint32_t dst) const {
      std::vector<std::uint32_t> p;
      if (dist[dst] == unreachable) return p;
      for (std::uint32_t n = dst; parent[n] != none; n = parent[n]) p.push_back(parent_edge[n]);
      return {p.rbegin(), p.rend()};
    }
  };

  // Dijkstra from `src`. `weight(edge_id)` returns the edge cost (infinity = unusable);
  // `through(node)` says whether paths may pass through a node (e.g. cards that do not forward).
  // Ties are broken by node index, so results are deterministic.
  template <class Weight, class Through>
  tree dijkstra(std::uint32_t src, Weight&& weight, Through&& through) const {
    tree t;
    t.dist.assign(adj_.size(), unreachable);
    t.parent_edge.assign(adj_.size(), none);
    t.parent.assign(adj_.size(), none);
    using item = std::pair<double, std::uint32_t>;
    std::priority_queue<item, std::vector<item>, std::greater<item>> q;
    t.dist[src] = 0;
    q.push({0.0, src});
    while (!q.empty()) {
      auto [d, n] = q.top();
      q.pop();
      if (d > t.dist[n]) continue;
      if (n != src && !through(n)) continue;
      for (const edge& e : adj_[n]) {
        double w = weight(e.id);
        if (!(w < unreachable)) continue;
        double nd = d + w;
        if (nd < t.dist[e.to]) {
          t.dist[e.to] = nd;
          t.parent[e.to] = n;
          t.parent_edge[e.to] = e.id;
          q.push({nd, e.to});
        }
      }
    }
    return t;
  }

 private:
  std::vector<std::vector<edge>> adj_;
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
