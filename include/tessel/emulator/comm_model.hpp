// Closed forms of the collectives' simulated time on an emulated cluster: what the communicator's
// default (direct and hierarchical) algorithms cost on the fabric model of `cluster_config`, so the
// planner (dist/planner.hpp) prices a layout with the same figures the emulator charges.
//
// The fabric is a single-layer switch per plane, non-blocking, every card with `card_bandwidth()`
// bytes/s in and out (its ports over all planes; adaptive routing stripes one message over every
// plane). A direct step (every rank sends its share to every peer at once) is bandwidth-bound at
// each card's port and costs one wire latency (`direct_latency()`: uplink, switch, downlink):
//   reduce-scatter, all-gather, all-to-all of S bytes per rank:  (n-1)/n · S / B + L
//   all-reduce (reduce-scatter then all-gather):                  2 (n-1)/n · S / B + 2 L
//   one message of S bytes:                                       S / B + L
// A group whose ranks span super-nodes all-reduces hierarchically (reduce-scatter inside each
// super-node, the 1/g shards folded along the super-nodes in order and sent back from the last one
// at each card's NIC bandwidth, all-gather inside); its direct steps send the remote shares through
// the NIC after the local ones.
// tests/emulator/comm_model.cpp holds these against timing-only runs on the default cluster and on
// clusters with other planes, port bandwidths and card counts.
#pragma once

#include <algorithm>
#include <cstddef>

#include <tessel/emulator/config.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

// Where a group's ranks sit: `size` ranks, `per_node` of them in each super-node they touch
// (size when the group is inside one super-node).
struct group_shape {
  std::size_t size = 1;
  std::size_t per_node = 1;
  static group_shape local(std::size_t n) { return {n, n}; }
};

class comm_model {
 public:
  explicit comm_model(const cluster_config& c) : c_(c) {}

  double card_bandwidth() const { return c_.card_bandwidth(); }
  double nic_bandwidth() const { return c_.scaleout.nic_bandwidth; }
  double latency() const { return c_.direct_latency(); }
  // One wire crossing of the scale-out tier (NIC, leaf, spine, leaf, NIC).
  double scaleout_latency() const { return 4 * c_.scaleout.link_latency + 3 * c_.scaleout.switch_latency; }

  // Reduce-scatter or all-gather of S bytes per rank (the whole vector; each rank ends with S/n).
  double reduce_scatter(group_shape g, double bytes) const { return all_to_all(g, bytes); }
  double all_gather(group_shape g, double bytes) const { return all_to_all(g, bytes); }

  // All-reduce of S bytes per rank. `acc_ratio`: accumulator bytes per element over element bytes
  // (2 for BF16 and FP16, which the chain carries in f32).
  // `hierarchical`: the communicator knows the super-node size (a world communicator on the
  // emulated transport does; dist's group communicators do not, and reduce directly).
  double all_reduce(group_shape g, double bytes, double acc_ratio = 1, bool hierarchical = true) const {
    if (g.size <= 1 || bytes <= 0) return 0;
    if (spans(g) && !hierarchical) return 2 * all_to_all(g, bytes);
    if (spans(g)) {
      // ar_hier: the super-nodes' shards fold along a chain in node order (deterministic), then the
      // last node sends the result to each other node from its NIC; neither is pipelined.
      const double k = double(g.size / g.per_node), shard = bytes / double(g.per_node);
      const double chain = (k - 1) * (shard * acc_ratio / nic_bandwidth() + scaleout_latency());
      const double fan_out = (k - 1) * shard / nic_bandwidth() + scaleout_latency();
      return 2 * local_step(g.per_node, bytes) + chain + fan_out;
    }
    return 2 * local_step(g.size, bytes);
  }

  // All-to-all with S bytes sent by each rank in total (S/n to each rank, itself included). Across
  // super-nodes the NIC's share follows the switch's (the sends are posted in one pass).
  double all_to_all(group_shape g, double bytes) const {
    if (g.size <= 1 || bytes <= 0) return 0;
    const double n = double(g.size), share = bytes / n;
    if (spans(g)) {
      const double local = (double(g.per_node) - 1) * share, remote = (n - double(g.per_node)) * share;
      return local / card_bandwidth() + latency() + remote / nic_bandwidth() + scaleout_latency();
    }
    return (n - 1) * share / card_bandwidth() + latency();
  }

  // One message of S bytes between two cards (`same_node`: inside one super-node).
  double message(double bytes, bool same_node = true) const {
    if (bytes <= 0) return 0;
    return same_node ? bytes / card_bandwidth() + latency() : bytes / nic_bandwidth() + scaleout_latency();
  }

 private:
  bool spans(group_shape g) const { return g.per_node > 0 && g.per_node < g.size && g.size % g.per_node == 0; }
  double local_step(std::size_t n, double bytes) const {
    if (n <= 1) return 0;
    return (double(n) - 1) / double(n) * bytes / card_bandwidth() + latency();
  }
  cluster_config c_;
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
