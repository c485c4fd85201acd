// The model-parallel layers over the emulated UBL128 cluster: the same layouts as on threads, the
// same bits. The communicator's collectives reduce in a fixed rank order whatever the transport,
// and group_transport carries each group's messages on any transport, so a layout's losses and
// final parameters (dp x tp with ZeRO-1, tp x pp, dp x pp; tests/dist/layout_run.hpp) and the
// expert-parallel MoE block's outputs and gradients must equal the threads transport's bitwise.
// (The MPI transport runs the same layouts in tests/mpi/dist.cpp.)
#include <catch2/catch.hpp>

#include <array>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "dist/layout_run.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_transports {

using namespace tessel;

namespace {

template <class Runner>
std::vector<tessel_test::layout_run_rank> run_all(const tessel_test::layout_run_spec& sp, const std::filesystem::path& path, Runner runner) {
  std::vector<tessel_test::layout_run_rank> out(std::size_t(sp.world()));
  std::mutex mu;
  runner([&](auto t) {
    const auto r = std::size_t(t.rank());
    auto res = tessel_test::layout_run(std::move(t), sp, path);
    std::lock_guard lk(mu);
    out[r] = std::move(res);
  });
  return out;
}

}  // namespace

TEST_CASE("model-parallel layouts give the same bits on the emulated cluster as on threads", "[dist][emulated]") {
  for (const auto& sp : tessel_test::layout_run_specs()) {
    const auto path = tessel_test::layout_run_checkpoint(sp.ep > 1);
    INFO(sp.name());
    const auto threads = run_all(sp, path, [&](auto f) { threads_world::run(sp.world(), f); });
    const auto emulated = run_all(sp, path, [&](auto f) { emulated_world::run_default(sp.world(), f, false); });
    for (std::size_t r = 0; r < threads.size(); ++r) {
      INFO("rank " << r);
      CHECK(threads[r].losses.size() == tessel_test::layout_run_steps);
      CHECK(tessel_test::layout_run_diff(threads[r], emulated[r]).empty());
    }
  }
  tessel_test::layout_run_cleanup();
}

TEST_CASE("expert parallel MoE gives the same bits on the emulated cluster as on threads", "[dist][expert_parallel][emulated]") {
  std::vector<std::vector<float>> a(4), b(4);
  std::mutex mu;
  threads_world::run(4, [&](threads_transport t) {
    const auto r = std::size_t(t.rank());
    auto v = tessel_test::ep_block_run(std::move(t));
    std::lock_guard lk(mu);
    a[r] = std::move(v);
  });
  emulated_world::run_default(
      4,
      [&](emulated_transport t) {
        const auto r = std::size_t(t.rank());
        auto v = tessel_test::ep_block_run(std::move(t));
        std::lock_guard lk(mu);
        b[r] = std::move(v);
      },
      false);
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r);
    REQUIRE(a[r].size() == b[r].size());
    CHECK(std::memcmp(a[r].data(), b[r].data(), a[r].size() * sizeof(float)) == 0);
  }
}

}  // namespace tessel_test_dist_transports
