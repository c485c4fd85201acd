// 33: the same collectives on the emulated UBL128 cluster. 16 cards all-reduce 64 MiB; time is the
// emulator's (simulated), and busbw is compared with the per-card port bandwidth. The cluster is
// timing-only here (no payloads), which is how tessel-perf measures 128 cards and 1 GiB.
#include <cstdio>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>

int main() {
  using namespace tessel;
  emu::cluster_config cfg;
  cfg.cards_per_supernode = 16;
  cfg.timing_only = true;
  emu::cluster cl(cfg, 1);
  const std::size_t bytes = std::size_t{64} << 20, count = bytes / 4;
  comm_options opt;
  opt.segment_bytes = bytes;
  emulated_world(cl).run([&](emulated_transport t) {
    communicator comm(std::move(t), opt);
    comm.barrier();
    const double t0 = comm.now();
    comm.all_reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum);  // timing-only: no buffers
    comm.barrier();
    const double secs = comm.now() - t0;
    if (comm.rank() == 0) {
      const double busbw = static_cast<double>(bytes) / secs * 2.0 * 15 / 16;
      std::printf("16 cards, all_reduce 64 MiB: %.1f us simulated, busbw %.1f GB/s = %.0f%% of the %.0f GB/s per-card ports\n",
                  secs * 1e6, busbw / 1e9, 100 * busbw / cfg.card_bandwidth(), cfg.card_bandwidth() / 1e9);
    }
  });
}
