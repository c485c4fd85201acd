// A parallel layout: how a world of ranks is cut into data-parallel replicas, tensor-parallel groups
// and pipeline stages; expert parallelism splits each group of ep consecutive dp replicas' experts
// between them (ep divides dp: the experts' data parallelism is dp / ep). The rank order is tp fastest, then dp, then pp, as Megatron-Core's, so
// a tp group is a run of adjacent ranks (on UBL128: the ranks of one super-node first). Every check
// runs before any work and names the numbers.
#pragma once

#include <cstddef>
#include <string>

#include <tessel/detail/checked.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/io/model_config.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

// Where one rank sits in a layout.
struct rank_coords {
  int dp = 0, tp = 0, pp = 0;
  bool operator==(const rank_coords&) const = default;
};

struct parallel_layout {
  int dp = 1;          // data-parallel replicas
  int tp = 1;          // tensor-parallel ranks per replica
  int pp = 1;          // pipeline stages
  int ep = 1;          // expert-parallel ranks: consecutive dp replicas sharing their experts (divides dp)
  int zero_stage = 0;  // 0: plain DP; 1: optimizer state sharded over dp (2 and 3 later)

  // dp·tp·pp; a product that overflows int is a dist_error(errc::overflow).
  int world_size() const {
    check_positive();
    const std::size_t n =
        tessel::detail::mul_checked(tessel::detail::mul_checked(std::size_t(dp), std::size_t(tp), "layout size"), std::size_t(pp), "layout size");
    if (n > std::size_t(0x7fffffff)) throw dist_error(errc::overflow, "layout " + to_string() + " has more than 2^31 - 1 ranks");
    return int(n);
  }

  // The layout itself is well formed and fits a world of `world` ranks.
  void validate(int world) const {
    check_positive();
    if (dp % ep != 0)
      throw dist_error(errc::config, "layout " + to_string() + ": ep = " + std::to_string(ep) + " does not divide dp = " + std::to_string(dp) +
                                         " (expert-parallel ranks are data-parallel replicas)");
    if (zero_stage > 1)
      throw dist_error(errc::unsupported, "layout " + to_string() + ": ZeRO stage " + std::to_string(zero_stage) + " is not built yet (0 and 1 are)");
    if (world_size() != world)
      throw dist_error(errc::config, "layout " + to_string() + " needs dp·tp·pp = " + std::to_string(world_size()) + " ranks, the world has " +
                                         std::to_string(world));
  }

  // The layout can split this model: tp divides the attention heads and the MLP's intermediate size
  // (each tp rank holds whole heads and an equal slice of the MLP), either tp divides the kv heads
  // (each rank holds some) or the kv heads divide tp (each is replicated on tp / kv ranks), and
  // every pipeline stage gets at least one layer.
  void validate(const io::model_config& c) const {
    check_positive();
    if (std::size_t(pp) > c.num_hidden_layers)
      throw dist_error(errc::config,
                       "pp = " + std::to_string(pp) + " stages for " + std::to_string(c.num_hidden_layers) + " layers: every stage needs one");
    const std::size_t t = std::size_t(tp);
    if (c.num_attention_heads % t != 0)
      throw dist_error(errc::config,
                       "tp = " + std::to_string(tp) + " does not divide the " + std::to_string(c.num_attention_heads) + " attention heads");
    const std::size_t kv = c.num_key_value_heads;
    if (kv == 0 || (kv % t != 0 && t % kv != 0))
      throw dist_error(errc::config, "tp = " + std::to_string(tp) + " and the " + std::to_string(kv) +
                                         " kv heads: one must divide the other (kv heads are split over tp or replicated on tp / kv ranks)");
    if (!c.is_moe() && c.intermediate_size % t != 0)
      throw dist_error(errc::config, "tp = " + std::to_string(tp) + " does not divide the intermediate size " + std::to_string(c.intermediate_size));
    if (ep > 1 && !c.is_moe()) throw dist_error(errc::config, "ep = " + std::to_string(ep) + " for a model without experts");
    if (c.is_moe() && c.num_local_experts % std::size_t(ep) != 0)
      throw dist_error(errc::config, "ep = " + std::to_string(ep) + " does not divide the " + std::to_string(c.num_local_experts) + " experts");
  }

  rank_coords coords(int rank) const {
    const int n = world_size();
    if (rank < 0 || rank >= n)
      throw dist_error(errc::out_of_range, "rank " + std::to_string(rank) + " outside the layout's [0, " + std::to_string(n) + ")");
    return rank_coords{.dp = (rank / tp) % dp, .tp = rank % tp, .pp = rank / (tp * dp)};
  }
  int rank_of(rank_coords c) const {
    if (c.dp < 0 || c.dp >= dp || c.tp < 0 || c.tp >= tp || c.pp < 0 || c.pp >= pp)
      throw dist_error(errc::out_of_range, "coordinates (dp " + std::to_string(c.dp) + ", tp " + std::to_string(c.tp) + ", pp " +
                                               std::to_string(c.pp) + ") outside layout " + to_string());
    return (c.pp * dp + c.dp) * tp + c.tp;
  }

  std::string to_string() const {
    std::string s = "{dp " + std::to_string(dp) + ", tp " + std::to_string(tp);
    if (pp != 1) s += ", pp " + std::to_string(pp);
    if (ep != 1) s += ", ep " + std::to_string(ep);
    if (zero_stage != 0) s += ", zero " + std::to_string(zero_stage);
    return s + "}";
  }

 private:
  void check_positive() const {
    if (dp <= 0 || tp <= 0 || pp <= 0 || ep <= 0)
      throw dist_error(errc::config, "layout {dp " + std::to_string(dp) + ", tp " + std::to_string(tp) + ", pp " + std::to_string(pp) + ", ep " +
                                         std::to_string(ep) + "}: every degree must be at least 1");
    if (zero_stage < 0 || zero_stage > 3) throw dist_error(errc::config, "ZeRO stage " + std::to_string(zero_stage) + " is not one of 0, 1, 2, 3");
  }
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
