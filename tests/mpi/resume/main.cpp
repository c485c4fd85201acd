// A training job that survives a dead rank by restart (issue 20, the MPI path): data parallel over
// MPI_COMM_WORLD, two checkpoint tiers (every step, deltas, 2 kept; every 3 steps, full, 1 kept),
// and dist::resume at start. run.sh kills a rank once (it exits abruptly right after a step's save
// began) and relaunches the job through tools/mpirun-resume; the final parameters and moments must
// be the bits of a run that was never interrupted.
//   mpi_resume_demo <dir> <steps> [--die-at <step>]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/mpi.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "dist/layout_run.hpp"

int main(int argc, char** argv) {
  using namespace tessel;
  namespace fs = std::filesystem;
  MPI_Init(&argc, &argv);
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <dir> <steps> [--die-at <step>]\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const fs::path dir = argv[1];
  const std::uint64_t steps = std::strtoull(argv[2], nullptr, 10);
  const std::uint64_t die_at = argc >= 5 && std::strcmp(argv[3], "--die-at") == 0 ? std::strtoull(argv[4], nullptr, 10) : 0;
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {
    dist::process_groups grp(mpi_transport(MPI_COMM_WORLD), {.dp = size});
    host_device dv(1);
    nn::decoder_lm<host_device> m(dv, tessel_test::layout_run_llama());
    m.init(3, 0.1);
    dist::data_parallel dp(m, grp.dp(), {.bucket_bytes = 16 << 10});
    const std::vector<dist::checkpoint_tier> tiers = {
        {.dir = dir / "fast", .every = 1, .keep = 2, .options = {.incremental = true, .delta_block = 64}},
        {.dir = dir / "slow", .every = 3, .keep = 1}};
    dist::tiered_checkpointer tc(tiers);
    fs::path from;
    const auto st = dist::resume(tiers, dp, grp.world(), &from);
    std::uint64_t step = st ? st->step : 0;
    if (rank == 0) {
      if (st)
        std::printf("resumed from step %llu (%s)\n", static_cast<unsigned long long>(step), from.c_str());
      else
        std::printf("fresh start\n");
      std::fflush(stdout);
    }
    nn::adamw_config h;
    h.hyper.lr = 1e-3f;
    constexpr std::size_t B = 4, S = 6;
    const std::size_t b = B / std::size_t(size), off = std::size_t(rank) * b * S;
    while (step < steps) {
      ++step;
      const auto data = tessel_test::make_batch(400 + step, B, S, 37);  // the data position is the step
      dp.forward_backward(std::span(data.ids).subspan(off, b * S), std::span(data.targets).subspan(off, b * S), b, S);
      dp.adamw(h, step);
      tc.save(step, dp, grp.world(), {.extra = {{"loader", std::to_string(step)}}});
      if (step == die_at && rank == size - 1 && !fs::exists(dir / "died")) {
        std::ofstream(dir / "died") << "rank " << rank << " died at step " << step << "\n";
        std::_Exit(7);  // abruptly: its save may be in flight
      }
    }
    tc.wait(grp.world());
    // every rank's replica is the same: rank 0 reports a hash of its values and moments
    if (rank == 0) {
      dist::ckpt::content_hash hsh;
      for (auto& p : m.params())
        for (const auto* buf : {&p.value, &p.m, &p.v}) hsh.add(std::as_bytes(std::span<const float>(buf->data(), buf->size())));
      std::ofstream(dir / "final.txt") << dist::ckpt::hex(hsh.value()) << "\n";
      std::printf("final state %s after step %llu\n", dist::ckpt::hex(hsh.value()).c_str(), static_cast<unsigned long long>(step));
    }
  }
  MPI_Finalize();
  return 0;
}
