// The model-parallel layers under MPI (4 processes): the layouts of tests/dist/layout_run.hpp
// (dp x tp with ZeRO-1, tp x pp, dp x pp) and the expert-parallel MoE block run over
// MPI_COMM_WORLD, and each process runs the same layout on 4 threads of its own; its rank's losses,
// parameters and gradients must be the same bits (the collectives' fixed reduction order holds on
// every transport). At the end, asynchronous incremental checkpoints across the processes. Only
// CHECK is used: a REQUIRE that stops one rank early would leave its peers
// waiting.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

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

// Asynchronous, incremental checkpoints across processes: each rank's writing thread and world
// rank 0's manifest meet only through the (shared) file system. dp 2 x tp 2, ZeRO-1: a full save
// then two deltas, and the chain loads back onto the same layout to the live state's bits.
TEST_CASE("mpi: asynchronous incremental checkpoints load back to the live state", "[mpi][dist][checkpoint]") {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  REQUIRE(size == 4);
  long long id = ::getpid();
  MPI_Bcast(&id, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);  // one directory for all ranks
  const auto root = std::filesystem::temp_directory_path() / ("mpi_ckpt_" + std::to_string(id));
  const auto path = tessel_test::layout_run_checkpoint(false);
  constexpr std::size_t B = tessel_test::layout_run_batch, S = tessel_test::layout_run_seq;
  std::vector<bool> deltas;
  std::map<std::string, std::vector<float>> live, back;
  std::vector<float> live_m, back_m;
  auto build = [&](auto& fn) {
    dist::process_groups grp(mpi_transport(MPI_COMM_WORLD), {.dp = 2, .tp = 2, .zero_stage = 1});
    host_device dv(1);
    dist::tp_decoder_lm<host_device> m(dv, tessel_test::layout_run_llama(), grp.tp());
    dist::pipeline pipe(m, {.micro_batches = 1});
    dist::data_parallel dp(pipe, grp.dp(), {.bucket_bytes = 4 << 10, .zero_stage = 1});
    nn::load_options lo;
    lo.allow_unexpected = true;
    m.load(path, lo);
    fn(grp, m, dp);
  };
  auto snapshot = [](auto& m, auto& dp, std::map<std::string, std::vector<float>>& vals, std::vector<float>& moments) {
    for (auto& p : m.params()) vals[p.name].assign(p.value.data(), p.value.data() + p.numel);
    const auto mv = dp.shard_moments();
    moments.assign(mv.first.begin(), mv.first.end());
    moments.insert(moments.end(), mv.second.begin(), mv.second.end());
  };
  auto train = [&](auto& grp, auto& m, auto& dp) {
    dist::checkpointer ck({.incremental = true, .delta_block = 64});
    nn::adamw_config h;
    h.hyper.lr = 1e-3f;
    const std::size_t b = B / 2, off = std::size_t(grp.coords().dp) * b * S;
    for (std::uint64_t step = 1; step <= 3; ++step) {
      const auto data = tessel_test::make_batch(300 + step, B, S, 37);
      dp.forward_backward(std::span(data.ids).subspan(off, b * S), std::span(data.targets).subspan(off, b * S), b, S);
      dp.adamw(h, step);
      deltas.push_back(ck.save(root / ("c" + std::to_string(step)), dp, grp.world(), {.step = step}).wait().delta);
    }
    snapshot(m, dp, live, live_m);
  };
  auto load = [&](auto&, auto& m, auto& dp) {
    CHECK(dist::load_checkpoint(root / "c3", dp).step == 3);
    snapshot(m, dp, back, back_m);
  };
  build(train);
  build(load);
  CHECK(deltas == std::vector<bool>{false, true, true});
  CHECK(live.size() == back.size());
  std::size_t differ = 0;
  for (const auto& [k, v] : live) differ += back[k] != v;
  CHECK(differ == 0);
  CHECK(live_m == back_m);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(root);
  tessel_test::layout_run_cleanup();
}
