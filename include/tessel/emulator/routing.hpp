// Route choice for the emulated fabric. The topology graph (nodes are cards and switches, directed
// edges are ports) with deterministic shortest paths, and the router: for each message the fabric
// asks for a card-level route (striped over a set of planes, 2-hop through a transit card, or out
// through the scale-out NICs), chosen from the health the monitor has reported and the ports' load;
// transit choices are cached until the topology changes.
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <tessel/emulator/config.hpp>
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

enum class route_kind : std::uint8_t { none, direct, transit, scaleout };

// How a message travels: over the planes in mask1 (direct), or over mask1 to card `via` and from
// there over mask2 (transit); scale-out messages use the NICs; none: no usable path.
struct route {
  route_kind kind = route_kind::none;
  std::uint64_t mask1 = 0, mask2 = 0;
  std::uint32_t via = 0;
  friend bool operator==(const route&, const route&) = default;
};

// What the router reads from the fabric: the configuration, the health the monitor has reported
// (never the physical truth, which cards learn only by detection), and each port's latency,
// bandwidth and backlog (seconds of bytes queued at or routed towards it). Card ports are numbered
// 2 (card x planes + plane) for the uplink and one more for the downlink; the rest are scale-out.
template <class F>
concept routing_state = requires(const F& f, std::size_t c, std::size_t p, std::size_t q) {
  { f.config() } -> std::convertible_to<const cluster_config&>;
  { f.known_alive(c) } -> std::convertible_to<bool>;
  { f.known_link(c, p) } -> std::convertible_to<bool>;
  { f.port_latency(q) } -> std::convertible_to<double>;
  { f.port_bandwidth(q) } -> std::convertible_to<double>;
  { f.port_backlog(q) } -> std::convertible_to<double>;
};

class router {
 public:
  topology_graph& graph() { return graph_; }
  const topology_graph& graph() const { return graph_; }
  // Transit routes computed so far (cache misses).
  std::uint64_t computations() const { return computations_; }
  // The topology (or what the monitor knows of it) changed: cached routes are stale.
  void invalidate() { cache_.clear(); }

  // Planes both cards can use, and the planes one card can use, as the monitor knows them.
  template <routing_state F>
  static std::uint64_t pair_mask(const F& f, std::size_t a, std::size_t b) {
    std::uint64_t m = 0;
    for (std::size_t p = 0; p < f.config().fabric.planes; ++p)
      if (f.known_link(a, p) && f.known_link(b, p)) m |= std::uint64_t{1} << p;
    return m;
  }
  template <routing_state F>
  static std::uint64_t card_mask(const F& f, std::size_t a) {
    std::uint64_t m = 0;
    for (std::size_t p = 0; p < f.config().fabric.planes; ++p)
      if (f.known_link(a, p)) m |= std::uint64_t{1} << p;
    return m;
  }

  // The route of a message of `bytes` from card s to card d. Adaptive: stripe over every plane both
  // ends can use; when the pair has lost planes the other end still has, Dijkstra (latency + load
  // weights) looks for a 2-hop path through another card, and the cheaper of the two estimates
  // wins. Static: the one plane (s + d) mod planes, or the next healthy one.
  template <routing_state F>
  route choose(const F& f, std::size_t s, std::size_t d, double bytes) {
    const cluster_config& cfg = f.config();
    const std::size_t planes = cfg.fabric.planes, n = cfg.cards(), card_ports = 2 * n * planes;
    route r;
    if (cfg.supernode_of(s) != cfg.supernode_of(d)) {
      if (f.known_alive(s) && f.known_alive(d)) r.kind = route_kind::scaleout;
      return r;
    }
    const std::uint64_t direct = pair_mask(f, s, d);
    if (cfg.fabric.routing == routing_policy::static_plane) {
      const std::size_t p0 = (s + d) % planes;
      for (std::size_t i = 0; i < planes; ++i) {
        const std::size_t p = (p0 + i) % planes;
        if (direct >> p & 1) {
          r.kind = route_kind::direct;
          r.mask1 = std::uint64_t{1} << p;
          break;
        }
      }
      return r;
    }
    const int best_possible = std::min(std::popcount(card_mask(f, s)), std::popcount(card_mask(f, d)));
    if (direct != 0 && (std::popcount(direct) >= best_possible || !cfg.fabric.transit)) {
      r.kind = route_kind::direct;
      r.mask1 = direct;
      return r;
    }
    if (!cfg.fabric.transit) return r;
    const std::uint64_t key = (static_cast<std::uint64_t>(s) << 32) | d;
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    computations_++;
    // Dijkstra over the physical graph; cards may forward (they pay transit latency). A card's
    // port weight also carries the message's serialization over the planes that card can use,
    // so a path through a card with more healthy planes is preferred.
    auto weight = [&](std::uint32_t q) -> double {
      if (q >= card_ports) return topology_graph::unreachable;  // scale-out ports not used inside a super-node
      const std::size_t c = q / 2 / planes, p = (q / 2) % planes;
      if (!f.known_link(c, p)) return topology_graph::unreachable;
      double w = f.port_latency(q) + f.port_backlog(q);
      if (q % 2 == 0) w += cfg.fabric.transit_latency * (c != s);
      w += bytes / (f.port_bandwidth(q) * std::max(1, std::popcount(card_mask(f, c))));
      return w;
    };
    auto through = [&](std::uint32_t node) { return node >= n || (f.known_alive(node) && cfg.supernode_of(node) == cfg.supernode_of(s)); };
    const auto tree = graph_.dijkstra(static_cast<std::uint32_t>(s), weight, through);
    route best;
    double best_cost = topology_graph::unreachable;
    if (direct != 0) {
      best.kind = route_kind::direct;
      best.mask1 = direct;
      best_cost = cfg.direct_latency() + bytes / (cfg.link_bandwidth() * std::popcount(direct));
    }
    // Transit candidates: the card Dijkstra reached d through, plus the best 2-hop by bandwidth.
    auto consider = [&](std::size_t via) {
      if (via == s || via == d || !f.known_alive(via)) return;
      const std::uint64_t m1 = pair_mask(f, s, via), m2 = pair_mask(f, via, d);
      if (!m1 || !m2) return;
      const double bw = cfg.link_bandwidth() * std::min(std::popcount(m1), std::popcount(m2));
      double load = 0;
      for (std::size_t p = 0; p < planes; ++p) load = std::max(load, f.port_backlog(2 * (via * planes + p)));
      const double cost = 2 * cfg.direct_latency() + cfg.fabric.transit_latency + bytes / bw + load;
      if (cost < best_cost) {
        best_cost = cost;
        best = route{route_kind::transit, m1, m2, static_cast<std::uint32_t>(via)};
      }
    };
    for (std::uint32_t q : tree.path_to(static_cast<std::uint32_t>(d)))
      if (q % 2 == 0 && q < card_ports) consider(q / 2 / planes);
    const std::size_t base = cfg.supernode_of(s) * cfg.cards_per_supernode;
    for (std::size_t v = base; v < base + cfg.cards_per_supernode; ++v) consider(v);
    cache_[key] = best;
    return best;
  }

 private:
  topology_graph graph_;
  std::unordered_map<std::uint64_t, route> cache_;
  std::uint64_t computations_ = 0;
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
