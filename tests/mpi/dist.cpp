// The model-parallel layers under MPI (4 processes): the layouts of tests/dist/layout_run.hpp
// (dp x tp with ZeRO-1, tp x pp, dp x pp) and the expert-parallel MoE block run over
// MPI_COMM_WORLD, and each process runs the same layout on 4 threads of its own; its rank's losses,
// parameters and gradients must be the same bits (the collectives' fixed reduction order holds on
// every transport). Only CHECK is used: a REQUIRE that stops one rank early would leave its peers
// waiting.
#include <catch2/catch.hpp>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/mpi.hpp>

#include "dist/layout_run.hpp"

using namespace tessel;

TEST_CASE("mpi: model-parallel layouts give the same bits as on threads", "[mpi][dist]") {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  REQUIRE(size == 4);  // every rank agrees, so no rank waits on another
  for (const auto& sp : tessel_test::layout_run_specs()) {
    const auto path = tessel_test::layout_run_checkpoint(sp.ep > 1);
    INFO(sp.name() << ", rank " << rank);
    const auto mine = tessel_test::layout_run(mpi_transport(MPI_COMM_WORLD), sp, path);
    std::vector<tessel_test::layout_run_rank> threads(4);
    std::mutex mu;
    threads_world::run(4, [&](threads_transport t) {
      const auto r = std::size_t(t.rank());
      auto res = tessel_test::layout_run(std::move(t), sp, path);
      std::lock_guard lk(mu);
      threads[r] = std::move(res);
    });
    CHECK(tessel_test::layout_run_diff(mine, threads[std::size_t(rank)]).empty());
  }
  tessel_test::layout_run_cleanup();
  const auto ep = tessel_test::ep_block_run(mpi_transport(MPI_COMM_WORLD));
  std::vector<std::vector<float>> ref(4);
  std::mutex mu;
  threads_world::run(4, [&](threads_transport t) {
    const auto r = std::size_t(t.rank());
    auto v = tessel_test::ep_block_run(std::move(t));
    std::lock_guard lk(mu);
    ref[r] = std::move(v);
  });
  const auto& want = ref[std::size_t(rank)];
  CHECK(ep.size() == want.size());
  CHECK((ep.size() == want.size() && std::memcmp(ep.data(), want.data(), ep.size() * sizeof(float)) == 0));
}
