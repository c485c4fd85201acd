// tessel-perf moe: MoE dispatch/combine bandwidth on the emulated cluster (DeepEP-style figures).
//   tessel-perf moe -g 128 --tokens 4096 --hidden 7168 --topk 8 --experts 256 [-n 3] [--check]
// Every rank routes its tokens to top-k distinct experts (uniform, seeded), dispatches FP8 (E4M3 +
// one FP32 scale per 128 channels) and combines BF16. Without --check the payloads are timing-only
// (moe_timing_only: real routing metadata, payload bytes timed by the fabric but never allocated),
// so 128 cards x 4096 tokens x 7168 channels fit in host memory; --check moves real payloads.
// Reported per phase: simulated time (slowest rank, from a common start), the payload bytes each
// rank puts on the wire (remote rows only), bandwidth = mean wire bytes per rank / time, its share
// of the per-card port bandwidth (the link limit), and of the modelled bound
// max over ranks of max(bytes sent, bytes received) / port bandwidth. `--cluster FILE` models
// another machine (the emulator's config format; -g then defaults to its card count).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/moe.hpp>
#include <tessel/emulator/config.hpp>

#include "../common/args.hpp"
#if __has_include(<tessel/collectives/transport/emulated.hpp>)
#include <tessel/collectives/transport/emulated.hpp>
#define TESSEL_PERF_MOE 1
#endif

using namespace tessel;

namespace {
[[noreturn]] void moe_usage(const char* msg) {
  std::fprintf(stderr,
               "tessel-perf moe: %s\n"
               "usage: tessel-perf moe [-g RANKS] [--tokens T] [--hidden H] [--topk K] [--experts E] [-n ITERS] [--check] [--cluster FILE]\n"
               "  (emulated transport only; defaults: 128 ranks, 4096 tokens, hidden 7168, top-8 of 256 experts)\n",
               msg);
  std::exit(2);
}
}  // namespace

int moe_main(int argc, char** argv) {
  int ranks = 128, iters = 3, experts = 256;
  std::size_t tokens = 4096, hidden = 7168, top_k = 8;
  bool check = false, ranks_given = false;
  std::string cluster_path;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) moe_usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    try {
      if (a == "-g" || a == "--ranks") {
        ranks = static_cast<int>(tessel_tools::parse_int(a, val(), 1, 1 << 20));
        ranks_given = true;
      } else if (a == "--cluster")
        cluster_path = val();
      else if (a == "--tokens")
        tokens = static_cast<std::size_t>(tessel_tools::parse_int(a, val(), 0, 1 << 24));
      else if (a == "--hidden")
        hidden = static_cast<std::size_t>(tessel_tools::parse_int(a, val(), 1, 1 << 20));
      else if (a == "--topk")
        top_k = static_cast<std::size_t>(tessel_tools::parse_int(a, val(), 1, 1 << 16));
      else if (a == "--experts")
        experts = static_cast<int>(tessel_tools::parse_int(a, val(), 1, 1 << 20));
      else if (a == "-n" || a == "--iters")
        iters = static_cast<int>(tessel_tools::parse_int(a, val(), 1, 1000000));
      else if (a == "-c" || a == "--check")
        check = true;
      else if (a == "--transport") {
        if (val() != "emulated") moe_usage("moe runs on the emulated transport only");
      } else
        moe_usage(("unknown option " + a).c_str());
    } catch (const std::exception& e) { moe_usage(e.what()); }
  }
  emu::cluster_config cfg;  // the default: super-nodes of 128 UBL128 cards
  if (!cluster_path.empty()) {
    try {
      cfg = emu::load_cluster_config(cluster_path);
    } catch (const tessel::error& e) { moe_usage(e.what()); }
    if (!ranks_given) ranks = static_cast<int>(std::min<std::size_t>(cfg.cards(), std::size_t{1} << 20));
    if (static_cast<std::size_t>(ranks) > cfg.cards())
      moe_usage(("-g " + std::to_string(ranks) + " is more ranks than the " + std::to_string(cfg.cards()) + " cards of " + cluster_path).c_str());
  } else if (ranks > 0) {
    const std::size_t n = static_cast<std::size_t>(ranks);
    cfg.cards_per_supernode = std::min<std::size_t>(n, 128);
    if (n % cfg.cards_per_supernode != 0) moe_usage("more than 128 ranks must be a multiple of 128 on the default cluster (or give --cluster)");
    cfg.scaleout.supernodes = n / cfg.cards_per_supernode;
  }
  cfg.timing_only = false;  // as before: routing metadata is real, the payload rows are byte counts (moe_timing_only)
  cfg.faults.op_timeout = std::max(cfg.faults.op_timeout, 1.0);  // large transfers queue behind each other for long
  if (ranks <= 0 || iters <= 0 || experts <= 0 || top_k == 0 || top_k > static_cast<std::size_t>(experts))
    moe_usage("ranks, iters, experts and topk must be positive, topk <= experts");
#if TESSEL_PERF_MOE
  struct rank_stats {
    double t0 = 0, t_dispatch = 0, t_combine = 0;
    std::size_t sent = 0, recvd = 0, csent = 0, crecvd = 0, rows = 0;
  };
  std::vector<std::vector<rank_stats>> st(static_cast<std::size_t>(iters), std::vector<rank_stats>(static_cast<std::size_t>(ranks)));
  double port_bw = 0;
  std::atomic<long> wrong{0};
  try {
    emu::cluster cl(cfg, 1);
    std::vector<std::size_t> cards(static_cast<std::size_t>(ranks));
    std::iota(cards.begin(), cards.end(), std::size_t{0});
    emulated_world(cl, cards).run([&](emulated_transport t) {
      if (t.rank() == 0) port_bw = t.cluster().config().card_bandwidth();
      communicator c(std::move(t));
      const int me = c.rank();
      std::mt19937_64 g(1234567 + static_cast<std::uint64_t>(me));
      std::vector<std::int64_t> idx(tokens * top_k);
      std::vector<float> w(idx.size());
      std::vector<int> perm(static_cast<std::size_t>(experts));
      for (std::size_t tk = 0; tk < tokens; ++tk) {  // top-k distinct experts, uniform
        std::iota(perm.begin(), perm.end(), 0);
        float sum = 0;
        for (std::size_t k = 0; k < top_k; ++k) {
          std::swap(perm[k], perm[k + g() % (perm.size() - k)]);
          idx[tk * top_k + k] = perm[k];
          w[tk * top_k + k] = 0.5f + static_cast<float>(g() % 1000) / 1000.0f;
          sum += w[tk * top_k + k];
        }
        for (std::size_t k = 0; k < top_k; ++k) w[tk * top_k + k] /= sum;
      }
      std::vector<e4m3> x;
      std::vector<float> sc;
      if (check) {
        x.resize(tokens * hidden);
        sc.resize(tokens * hidden / 128);
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = e4m3(static_cast<float>(static_cast<int>((i + static_cast<std::size_t>(me)) % 17) - 8));
        for (std::size_t i = 0; i < sc.size(); ++i) sc[i] = 1.0f;
      }
      for (int it = 0; it < iters; ++it) {
        auto& s = st[static_cast<std::size_t>(it)][static_cast<std::size_t>(me)];
        c.barrier();
        s.t0 = c.now();
        auto d = check ? moe_dispatch_fp8(c, x, sc, hidden, idx, w, top_k, experts)
                       : moe_dispatch_fp8(c, moe_timing_only, tokens, hidden, idx, w, top_k, experts);
        s.t_dispatch = c.now();
        std::vector<bf16> y;
        if (check) {  // expert output = dequantized input row: combine must return sum_k w_k * x
          y.resize(d.handle.rows() * hidden);
          for (std::size_t r = 0; r < d.handle.rows(); ++r)
            for (std::size_t j = 0; j < hidden; ++j)
              y[r * hidden + j] = bf16(static_cast<float>(d.x[r * hidden + j]) * d.scales[r * (hidden / 128) + j / 128]);
        }
        c.barrier();
        const double tc = c.now();
        const auto out = moe_combine(c, y, d.handle);
        s.t_combine = c.now() - tc;
        s.t_dispatch -= s.t0;
        s.sent = moe_dispatch_wire_bytes(d.handle, me);
        s.csent = moe_combine_wire_bytes(d.handle, me);
        for (std::size_t q = 0; q < d.handle.recv_per_rank.size(); ++q)
          if (static_cast<int>(q) != me) {
            s.recvd += d.handle.recv_per_rank[q] * d.handle.payload_bytes;
            s.crecvd += d.handle.sent_tokens[q].size() * hidden * sizeof(bf16);
          }
        s.rows = d.handle.rows();
        if (check) {
          long bad = 0;
          for (std::size_t tk = 0; tk < tokens; ++tk)
            for (std::size_t j = 0; j < hidden; j += 97) {
              float want = 0;
              for (std::size_t k = 0; k < top_k; ++k) want += w[tk * top_k + k] * static_cast<float>(x[tk * hidden + j]);
              const float got = static_cast<float>(out[tk * hidden + j]);
              if (std::abs(got - want) > 0.02f * std::abs(want) + 1e-3f) ++bad;
            }
          wrong += bad;
        }
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-perf moe: %s\n", e.what());
    return 1;
  }
  std::printf(
      "# tessel-perf moe: emulated, %d ranks, %zu tokens x %zu hidden per rank, top-%zu of %d experts, FP8 dispatch (E4M3 + "
      "scale/128), BF16 combine, %s payloads (simulated time)\n",
      ranks, tokens, hidden, top_k, experts, check ? "real" : "timing-only");
  std::printf("# link limit: per-card port bandwidth %.1f GB/s; bound = max over ranks of max(sent, received) / port bandwidth\n", port_bw / 1e9);
  std::printf("#%4s %9s %12s %12s %10s %9s %9s %8s\n", "iter", "phase", "wire MB/rank", "max MB/rank", "time (us)", "GB/s", "of link", "of bound");
  for (int it = 0; it < iters; ++it) {
    const auto& v = st[static_cast<std::size_t>(it)];
    for (int ph = 0; ph < 2; ++ph) {
      double tmax = 0, sum = 0, peak = 0;
      for (const auto& s : v) {
        tmax = std::max(tmax, ph == 0 ? s.t_dispatch : s.t_combine);
        const double snd = static_cast<double>(ph == 0 ? s.sent : s.csent), rcv = static_cast<double>(ph == 0 ? s.recvd : s.crecvd);
        sum += snd;
        peak = std::max({peak, snd, rcv});
      }
      const double mean = sum / static_cast<double>(v.size());
      const double bw = tmax > 0 ? mean / tmax : 0;
      std::printf(" %4d %9s %12.2f %12.2f %10.2f %9.2f %8.1f%% %7.1f%%\n", it, ph == 0 ? "dispatch" : "combine", mean / 1e6, peak / 1e6, tmax * 1e6,
                  bw / 1e9, 100 * bw / port_bw, tmax > 0 ? 100 * (peak / port_bw) / tmax : 0);
    }
  }
  if (check) std::printf("# combine check: %ld wrong\n", wrong.load());
  return wrong ? 1 : 0;
#else
  moe_usage("the emulated transport is not available in this build");
#endif
}
