// 91: elastic training on the emulated UBL128 cluster (dist::elastic_run).
//
// Part 1, a 7B-class model's state: 32 cards of a 128-card super-node train (tp 8 x dp 4, ZeRO-1:
// each card holds an eighth of the f32 master weights and a 1/32 shard of the AdamW moments,
// 5.25 GB), 4 cards wait as hot spares (more cards train the same way; the emulator's host time
// grows with them). Every step is the model's compute (6·N·tokens FLOP over the cards, at the card's
// bf16 peak, in blocks of 4 layers with a tensor-parallel all-reduce after each) and its data-parallel
// gradient reduce-scatter and all-gather (bf16), then an
// in-memory snapshot: a card-local copy plus a copy to a buddy card over the fabric. Card 21 dies
// in the middle of its third step; the heartbeat monitor reports it, the survivors revoke and agree, spare
// 32 takes its place and receives its state from its buddy, every rank rolls back to the step
// all of them hold. The recovery's parts are printed in simulated seconds (timing-only cluster:
// sizes move, no bytes). Target: detect + agree + restore within 30 s (the seeds: 90 s).
//
// Part 2, a soak: 16 cards train a small real state (every byte moves) for `steps` steps under
// seeded Poisson card failures (each a hot swap that returns the card empty after 2 s) with 4
// spares, recovering each time from peer memory. Printed: failures, goodput (the failure-free
// run's time / the soak's time) and whether the final state is bitwise the failure-free run's.
//
// Arguments: [soak steps (default 1000)]. Exit 1 when a target is missed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/dist.hpp>

#include "example_args.hpp"

namespace {
using namespace tessel;

struct seven_b {
  double params = 7e9, tokens = 512.0 * 4096;  // global batch: 512 sequences of 4096
  int tp = 8, dp = 4, layers = 32;
  int cards() const { return tp * dp; }
  std::size_t values() const { return std::size_t(params / tp); }              // f32 master weights per card
  std::size_t moments() const { return std::size_t(params / tp / dp); }        // per moment, ZeRO-1 shard
  double step_flops() const { return 6 * params * tokens / double(cards()); }  // per card
};

// Part 1: returns false when the 30 s target is missed.
bool recovery_7b() {
  const seven_b m;
  emu::cluster_config cfg;
  cfg.cards_per_supernode = 128;
  cfg.timing_only = true;
  cfg.faults.op_timeout = 30;  // a rank may wait a whole step of simulated compute on a slower one
  emu::cluster cl(cfg, 1);
  std::vector<std::size_t> cards(std::size_t(m.cards()));
  for (std::size_t i = 0; i < cards.size(); ++i) cards[i] = i;
  dist::elastic_options o;
  for (std::size_t c = cards.size(); c < cards.size() + 4; ++c) o.spares.push_back(c);
  o.failure_domain = 8;  // a server of 8 cards: a snapshot's copy goes to the next server
  const std::uint64_t steps = 4;
  std::mutex mu;
  std::vector<double> step_end(steps, 0), snap_time;
  const double per_step = emu::roofline_time(cfg.card, kernel_cost{m.step_flops(), 0, math_precision::bf16});
  // the failure: card 21 in the middle of step 2 (0-based; a step takes a little over per_step)
  cl.schedule({2.5 * per_step, emu::fault_kind::card_down, 21, 0, 0});
  auto job = [&](dist::elastic_rank& er) {
    comm_options co;
    co.segment_bytes = std::size_t{1} << 30;  // whole chunks per ring step: fewer simulated messages, the same bandwidth
    dist::process_groups grp(er.transport(), {.dp = m.dp, .tp = m.tp, .zero_stage = 1}, co);
    std::vector<dist::elastic_part> state{{"value", nullptr, m.values()}, {"zero1/m", nullptr, m.moments()}, {"zero1/v", nullptr, m.moments()}};
    const auto st = er.restore(state, grp.world());
    emu::card& card = er.transport().cluster().at(er.card());
    for (std::uint64_t s = st ? st->step : 0; s < steps; ++s) {
      // forward and backward in blocks of 4 layers, each followed by a tensor-parallel all-reduce
      // of its activations (bf16, one sequence of 4096 x hidden 4096): a survivor learns of a
      // failure at its next message, so a block's compute bounds the agreement's wait
      const int blocks = 2 * m.layers / 4;
      for (int l = 0; l < blocks; ++l) {
        card.charge(kernel_cost{m.step_flops() / blocks, 0, math_precision::bf16}, l < blocks / 2 ? "forward" : "backward");
        grp.tp().all_reduce(nullptr, nullptr, 4096 * 4096, dtype::bf16, reduce_op::sum);
      }
      // ZeRO-1's gradient reduce-scatter and parameter all-gather on the dp group (bf16)
      const std::size_t shard = m.values() / std::size_t(m.dp);
      grp.dp().reduce_scatter(nullptr, nullptr, shard, dtype::bf16, reduce_op::sum);
      grp.dp().all_gather(nullptr, nullptr, shard, dtype::bf16);
      const double t0 = grp.world().now();
      er.snapshot(state, grp.world(), {.step = s + 1});
      const double t1 = grp.world().now();
      if (er.rank() == 0) {
        std::lock_guard lk(mu);
        step_end[s] = t1;
        snap_time.push_back(t1 - t0);
      }
    }
  };
  const auto rep = dist::elastic_run(cl, cards, o, job);
  const double state_gb = double(m.values() + 2 * m.moments()) * 4 / 1e9;
  std::printf("part 1: a 7B-class model on %d of 128 emulated UBL128 cards (tp %d x dp %d, ZeRO-1), %.2f GB of state per card,\n", m.cards(), m.tp,
              m.dp, state_gb);
  std::printf("        snapshots in peer memory every step (a copy on the next 8-card server), ports %.0f GB/s x %zu planes\n",
              cfg.fabric.port_bandwidth / 1e9, cfg.fabric.planes);
  const double step = step_end[1] - step_end[0];
  const double snap = *std::min_element(snap_time.begin(), snap_time.end());
  std::printf("  step %.3f s simulated; snapshot stall %.1f ms = %.2f%% of the step\n", step, snap * 1e3, 100 * snap / step);
  bool ok = true;
  for (const auto& r : rep.recoveries) {
    std::printf("  card %zu (rank %d) failed at %.3f s; spare %zu took its place; rolled back to step %llu from %s\n", r.failed_card, r.rank,
                r.happened, r.replacement_card, static_cast<unsigned long long>(r.step), r.source.c_str());
    std::printf("  %-10s %12s\n", "part", "seconds");
    std::printf("  %-10s %12.6f  (the monitor's bound: %.6f)\n", "detect", r.detect(), cl.net().detection_bound());
    std::printf("  %-10s %12.6f\n", "agree", r.agree());
    std::printf("  %-10s %12.6f\n", "restore", r.restore());
    std::printf("  %-10s %12.6f  (the lost part of a step, redone)\n", "warm-up", r.warm_up());
    const double recovery = r.detect() + r.agree() + r.restore();
    std::printf("  detect + agree + restore = %.3f s (target 30 s): %s\n", recovery, recovery <= 30 ? "met" : "MISSED");
    ok = ok && recovery <= 30;
  }
  if (rep.recoveries.size() != 1) {
    std::printf("  expected one recovery, got %zu\n", rep.recoveries.size());
    ok = false;
  }
  return ok;
}

// Part 2: the soak. Each rank's state is 4096 floats; a step adds a gradient that depends on the
// step and the rank, summed over the world (real bytes), then charges a 50 ms step of compute.
struct soak_result {
  std::vector<float> state;  // rank 0's at the end
  double end = 0;
  std::size_t failures = 0, from_start = 0;
};
soak_result soak(std::uint64_t steps, double failure_rate) {
  constexpr int n = 16;
  constexpr std::size_t elems = 4096;
  emu::cluster_config cfg;
  cfg.cards_per_supernode = n + 4;
  cfg.card.memory_bytes = std::size_t{1} << 30;
  cfg.faults.op_timeout = 1;
  cfg.faults.card_failure_rate = failure_rate;
  cfg.faults.repair_time = 2.0;
  cfg.faults.horizon = double(steps) * 0.06 * 4;
  cfg.faults.seed = 2026;
  emu::cluster cl(cfg, 1);
  std::vector<std::size_t> cards(n);
  for (std::size_t i = 0; i < cards.size(); ++i) cards[i] = i;
  dist::elastic_options o;
  o.spares = {16, 17, 18, 19};
  o.max_recoveries = 1000;
  soak_result out;
  std::mutex mu;
  auto job = [&](dist::elastic_rank& er) {
    communicator world(er.transport());
    std::vector<float> w(elems, 0.0f), g(elems);
    std::vector<dist::elastic_part> state{{"w", w.data(), w.size()}};
    const auto st = er.restore(state, world);
    emu::card& card = er.transport().cluster().at(er.card());
    for (std::uint64_t s = st ? st->step : 0; s < steps; ++s) {
      for (std::size_t i = 0; i < elems; ++i) g[i] = float(std::sin(double(s * 131 + i * 7 + std::size_t(world.rank()) * 17)));
      card.charge(kernel_cost{20e12, 0, math_precision::bf16}, "step");  // 50 ms at 400 TFLOP/s
      world.all_reduce(std::span<float>(g), reduce_op::sum);
      for (std::size_t i = 0; i < elems; ++i) w[i] = 0.999f * w[i] - 1e-3f * g[i];
      er.snapshot(state, world, {.step = s + 1});
    }
    if (world.rank() == 0) {
      std::lock_guard lk(mu);
      out.state = w;
    }
  };
  const auto rep = dist::elastic_run(cl, cards, o, job);
  out.end = rep.end;
  out.failures = rep.recoveries.size();
  for (const auto& r : rep.recoveries) out.from_start += r.source != "peer memory";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const example_args::positional args(argc, argv, "[soak steps]", 1);
  const auto steps = static_cast<std::uint64_t>(args.integer(1, "soak steps", 10, 100000, 1000));
  bool ok = recovery_7b();
  // failures at a rate that gives about one per 60 steps over the 20 cards (Llama 3's ~3 hours
  // between interruptions on 16k GPUs, sped up)
  const double rate = 1.0 / (60 * 0.05 * 20);
  const soak_result clean = soak(steps, 0), faulty = soak(steps, rate);
  const bool same =
      clean.state.size() == faulty.state.size() && std::memcmp(clean.state.data(), faulty.state.data(), clean.state.size() * sizeof(float)) == 0;
  const double goodput = clean.end / faulty.end;
  std::printf("part 2: a soak of %llu steps on 16 cards + 4 spares, seeded Poisson card failures (hot swaps, 2 s repairs)\n",
              static_cast<unsigned long long>(steps));
  std::printf("  failures %zu (%zu without a memory copy), simulated time %.2f s vs %.2f s without failures: goodput %.1f%% (target 95%%): %s\n",
              faulty.failures, faulty.from_start, faulty.end, clean.end, 100 * goodput, goodput >= 0.95 ? "met" : "MISSED");
  std::printf("  final state bitwise the failure-free run's: %s\n", same ? "yes" : "NO");
  ok = ok && same && goodput >= 0.95 && faulty.failures > 0;
  return ok ? 0 : 1;
}
