// 20 — UBL128 experiments on the emulator. Three measurements that mirror the seed's claims,
// printed whatever the numbers turn out to be, and a Chrome trace (open it in ui.perfetto.dev):
//   1. latency variation (p99 - p50) of 64 KiB messages under 16-to-1 incast, shaping off / on
//   2. end-to-end latency of a message pattern with failed links: adaptive routing vs static planes
//   3. a 1 GiB all-to-all on 128 cards against the port-bandwidth bound
// Usage: 20_ubl128_experiments [trace.json]
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <tessel/emulator.hpp>

#include "example_args.hpp"

using namespace tessel;
using namespace tessel::emu;

namespace {

// Partition-aggregate incast: in each of 200 rounds, 16 senders answer card 0 with a 64 KiB
// message at (nearly) the same moment (seeded jitter up to 1 us); a round every 5 us offers ~52%
// of card 0's bandwidth on average, but each round is a 1 MiB burst. Switch output ports buffer
// 64 KiB; a chunk arriving at a full buffer is dropped and resent after a 20 us timeout. With
// shaping on, credits (64 KiB per receiving port) keep senders from overrunning the buffer.
void incast_experiment(bool shaping) {
  cluster_config c;
  c.fabric.shaping = shaping;
  c.fabric.shaping_window = 64 << 10;
  c.fabric.switch_buffer = 64 << 10;
  c.fabric.retransmit_timeout = 20e-6;
  fabric f(c);
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> jitter(0, 1e-6);
  const std::uint64_t S = 64 << 10;
  std::vector<fabric::msg_id> ids;
  for (int round = 0; round < 200; ++round)
    for (std::size_t s = 1; s <= 16; ++s) ids.push_back(f.post(s, 0, S, round * 5e-6 + jitter(rng)));
  f.run();
  std::vector<double> lat;
  for (auto id : ids) lat.push_back(f.latency(id));
  std::uint64_t q = 0;
  for (std::size_t p = 0; p < c.fabric.planes; ++p) q = std::max(q, f.stats_of(f.down(0, p)).max_queue_bytes);
  const double p50 = fabric::percentile(lat, 50), p99 = fabric::percentile(lat, 99);
  std::printf("  shaping %-3s  p50 %7.2f us  p99 %7.2f us  p99-p50 %7.2f us  max %7.2f us  peak queue %5.1f KiB  drops %llu\n",
              shaping ? "on" : "off", p50 * 1e6, p99 * 1e6, (p99 - p50) * 1e6, fabric::percentile(lat, 100) * 1e6, static_cast<double>(q) / 1024.0,
              static_cast<unsigned long long>(f.drops()));
}

// 128 cards; plane 5 is down and 24 random links have failed (seeded). Every card sends 1 MiB to
// 4 random peers at once.
void failed_links_experiment(routing_policy policy, bool failures) {
  cluster_config c;
  c.fabric.routing = policy;
  fabric f(c);
  std::mt19937_64 rng(7);
  if (failures) {
    f.schedule_fault({0, fault_kind::plane_down, 0, 5, 0});
    for (int i = 0; i < 24; ++i) f.schedule_fault({0, fault_kind::link_down, rng() % 128, rng() % 8, 0});
  } else {
    for (int i = 0; i < 24; ++i) (void)(rng() + rng());  // same traffic pattern as with failures
  }
  f.run_until(50e-6);  // past detection
  const double t0 = f.now();
  std::vector<fabric::msg_id> ids;
  for (std::size_t s = 0; s < 128; ++s)
    for (int k = 0; k < 4; ++k) {
      std::size_t d = (s + 1 + rng() % 127) % 128;
      ids.push_back(f.post(s, d, 1 << 20, t0));
    }
  f.run();
  std::vector<double> lat;
  std::size_t failed = 0, transit = 0;
  for (auto id : ids) {
    if (f.state(id) != msg_state::done) {
      ++failed;
      continue;
    }
    lat.push_back(f.latency(id));
    transit += f.via(id) >= 0;
  }
  double mean = 0;
  for (double l : lat) mean += l;
  mean /= static_cast<double>(lat.size());
  std::printf("  %-8s %-12s mean %7.2f us  p50 %7.2f us  p99 %7.2f us  last done %7.2f us  2-hop %zu  failed %zu\n",
              policy == routing_policy::adaptive ? "adaptive" : "static", failures ? "with faults" : "healthy", mean * 1e6,
              fabric::percentile(lat, 50) * 1e6, fabric::percentile(lat, 99) * 1e6, (f.makespan() - t0) * 1e6, transit, failed);
}

void alltoall_experiment() {
  cluster_config c;
  c.timing_only = true;
  fabric f(c);
  const std::uint64_t per = (std::uint64_t{1} << 30) / 128;
  for (std::size_t i = 1; i < 128; ++i)
    for (std::size_t s = 0; s < 128; ++s) f.post(s, (s + i) % 128, per, 0);
  f.run();
  const double bound = 127.0 * static_cast<double>(per) / c.card_bandwidth();
  std::printf("  simulated %8.2f us   port-bandwidth bound %8.2f us   ratio %.4f   (%llu events)\n", f.makespan() * 1e6, bound * 1e6,
              f.makespan() / bound, static_cast<unsigned long long>(f.events_processed()));
}

// A tile program: scales a buffer in place; declares its roofline cost.
struct scale_prog {
  float* x;
  std::size_t n;
  float a;
  void operator()(block_ctx& ctx) const {
    const std::size_t b = ctx.block_linear(), lo = b * 4096, hi = std::min(n, lo + 4096);
    for (std::size_t i = lo; i < hi; ++i) x[i] *= a;
  }
  kernel_cost cost(const grid&) const { return {static_cast<double>(n), 8.0 * static_cast<double>(n), math_precision::f32}; }
};

void traced_run(const std::string& path) {
  cluster_config c;
  c.cards_per_supernode = 16;
  c.card.memory_bytes = 256 << 20;
  c.trace = true;
  cluster cl(c, 2);
  const std::size_t n = 1 << 20, per = n * sizeof(float) / 16;
  std::vector<float*> x(16), y(16);
  for (std::size_t r = 0; r < 16; ++r) {
    x[r] = cl[r].allocate_n<float>(n);
    y[r] = cl[r].allocate_n<float>(n);
    for (std::size_t i = 0; i < n; ++i) x[r][i] = static_cast<float>(r);
  }
  for (std::size_t r = 0; r < 16; ++r) cl[r].launch(grid{ceil_div(n, 4096)}, scale_prog{x[r], n, 2.0f});
  std::vector<cluster::completion> cs;
  std::vector<std::size_t> dst;
  for (std::size_t i = 1; i < 16; ++i)
    for (std::size_t s = 0; s < 16; ++s) {
      std::size_t d = (s + i) % 16;
      cs.push_back(cl.put(s, reinterpret_cast<char*>(x[s]) + d * per, d, reinterpret_cast<char*>(y[d]) + s * per, per));
      dst.push_back(d);
    }
  cl.wait_all(cs);                                                     // senders learn their puts are done
  for (std::size_t k = 0; k < cs.size(); ++k) cl.wait(cs[k], dst[k]);  // receivers learn their data arrived
  for (std::size_t r = 0; r < 16; ++r) cl[r].launch(grid{ceil_div(n, 4096)}, scale_prog{y[r], n, 0.5f});
  // check one value: card 3 got card 9's block, scaled by 2 then 0.5
  std::printf("  card 3 holds %g from card 9 (expect 9)\n", static_cast<double>(y[3][9 * per / sizeof(float)]));
  cl.write_trace(path);
  std::printf("%s\n  trace written to %s\n", cl.report().to_string().c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const example_args::positional args(argc, argv, "[trace.json]", 1);
  const std::string trace = args.output(1, "trace", "ubl128_trace.json");
  std::printf("UBL128: 128 cards x 8 planes x 50 GB/s ports (400 GB/s per card), 550 ns one-hop latency\n\n");
  std::printf("1. 64 KiB messages, 16-to-1 incast bursts (200 rounds, 64 KiB switch buffers, 20 us resend timeout)\n");
  incast_experiment(false);
  incast_experiment(true);
  std::printf("\n2. 512 x 1 MiB messages (4 random peers per card); faults: plane 5 and 24 random links down\n");
  failed_links_experiment(routing_policy::static_plane, false);
  failed_links_experiment(routing_policy::static_plane, true);
  failed_links_experiment(routing_policy::adaptive, false);
  failed_links_experiment(routing_policy::adaptive, true);
  std::printf("\n3. 1 GiB all-to-all on 128 cards (16,256 flows, timing-only)\n");
  alltoall_experiment();
  std::printf("\nA traced run: 16 cards compute, exchange 4 MiB all-to-all, compute again\n");
  traced_run(trace);
  return 0;
}
