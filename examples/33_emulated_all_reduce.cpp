// 33: the same collectives on the emulated UBL128 cluster. 16 cards all-reduce 256 KiB .. 64 MiB
// with the ring and the direct algorithms; time is the emulator's (simulated), busbw is set beside
// the closed form of emu::comm_model (what the planner prices with) and the per-card port
// bandwidth. The cluster is timing-only here (no payloads), which is how tessel-perf measures 128
// cards and 1 GiB. The table is also drawn as an SVG plot (argv[1], default
// 33_emulated_all_reduce.svg), written by the library (emu::line_plot).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/emulator/comm_model.hpp>
#include <tessel/emulator/plot.hpp>

#include "example_args.hpp"

int main(int argc, char** argv) {
  using namespace tessel;
  const example_args::positional args(argc, argv, "[plot.svg]", 1);
  const std::string plot_path = args.output(1, "plot", "33_emulated_all_reduce.svg");
  emu::cluster_config cfg;
  cfg.cards_per_supernode = 16;
  cfg.timing_only = true;
  const int n = 16;
  const double factor = 2.0 * (n - 1) / n;  // nccl-tests' all-reduce bus factor
  const emu::comm_model model(cfg);

  std::vector<double> sizes;
  for (std::size_t b = std::size_t{256} << 10; b <= (std::size_t{64} << 20); b *= 4) sizes.push_back(static_cast<double>(b));
  std::vector<double> closed;
  for (double b : sizes) closed.push_back(b / model.all_reduce(emu::group_shape::local(n), b) * factor / 1e9);

  std::printf("16 cards, all_reduce (f32, simulated time); per-card ports %.0f GB/s\n", cfg.card_bandwidth() / 1e9);
  std::printf("%12s %10s %12s %12s %14s\n", "size (B)", "algo", "time (us)", "busbw (GB/s)", "closed form");
  emu::plot_options po;
  po.title = "all_reduce on 16 emulated UBL128 cards";
  po.y_label = "busbw (GB/s)";
  emu::line_plot plot(po);
  double worst = 0;  // the direct algorithm against its closed form, relative
  for (algorithm algo : {algorithm::ring, algorithm::direct}) {
    std::vector<double> busbw;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t bytes = static_cast<std::size_t>(sizes[i]), count = bytes / 4;
      emu::cluster cl(cfg, 1);
      comm_options opt;
      if (algo == algorithm::direct) opt.segment_bytes = bytes;  // one message per peer (a ring pipelines by segments)
      // from the common start to the last rank's end (no closing barrier in the time)
      std::vector<double> start(n), end(n);
      emulated_world(cl).run([&](emulated_transport t) {
        communicator comm(std::move(t), opt);
        comm.barrier();
        start[static_cast<std::size_t>(comm.rank())] = comm.now();
        comm.all_reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum, {algo});  // timing-only: no buffers
        end[static_cast<std::size_t>(comm.rank())] = comm.now();
      });
      const double secs = *std::max_element(end.begin(), end.end()) - *std::max_element(start.begin(), start.end());
      busbw.push_back(static_cast<double>(bytes) / secs * factor / 1e9);
      std::printf("%12zu %10s %12.2f %12.1f %14.1f\n", bytes, std::string(algorithm_name(algo)).c_str(), secs * 1e6, busbw.back(), closed[i]);
    }
    plot.add(std::string(algorithm_name(algo)), sizes, busbw);
    if (algo == algorithm::direct)
      for (std::size_t i = 0; i < sizes.size(); ++i) worst = std::max(worst, std::abs(busbw[i] / closed[i] - 1));
  }
  plot.add("closed form (direct)", sizes, closed, true);
  plot.add("port bandwidth", {sizes.front(), sizes.back()}, {cfg.card_bandwidth() / 1e9, cfg.card_bandwidth() / 1e9}, true);
  plot.write(plot_path);
  std::printf("plot written to %s\ndirect vs closed form: at most %.3f%% apart\n", plot_path.c_str(), 100 * worst);
  return worst < 0.01 ? 0 : 1;  // the example runs as a test: the model and the emulator must agree
}
