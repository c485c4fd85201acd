// Verifiable-data tests of every collective (nccl-tests style); the checks are in verifiable.hpp.
// Coverage note: counts {0, 1, 7, 53327} run the full matrix here; 2^20 runs the full matrix in
// communicator_exhaustive.cpp (label exhaustive) and a subset here (f32/bf16/e4m3/i32, sum and max,
// ranks 2/3/8) to keep the default suite fast.
#include "verifiable.hpp"

#include <map>
#include <set>

#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/device/profiler.hpp>
#include <tessel/emulator.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_communicator {

TEST_CASE("all_reduce: every dtype x op x algorithm x in/out-of-place x count x ranks", "[collectives][all_reduce]") { all_reduce_matrix(counts); }

TEST_CASE("reduce_scatter: every dtype x op x algorithm x in/out-of-place x count x ranks", "[collectives][reduce_scatter]") {
  reduce_scatter_matrix(counts, false);
}

TEST_CASE("reduce: every dtype x op x algorithm x root x in/out-of-place x count x ranks", "[collectives][reduce]") { reduce_matrix(counts); }

TEST_CASE("broadcast, all_gather, gather, scatter, all_to_all(v), send/recv: every dtype x count x ranks", "[collectives][movement]") {
  movement_matrix(counts);
}

TEST_CASE("2^20 elements: all_reduce and reduce_scatter on a subset", "[collectives][large]") {
  checked_guard guard;
  constexpr std::size_t big = std::size_t{1} << 20;
  for (int n : {2, 3, 8}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::max}) {
      check_all_reduce<float>(n, op, big, 5000);
      check_all_reduce<bf16>(n, op, big, 5001);
    }
    check_all_reduce<e4m3>(n, reduce_op::sum, big, 5002);
    check_all_reduce<std::int32_t>(n, reduce_op::sum, big, 5003);
    check_reduce_scatter<float>(n, reduce_op::sum, big / static_cast<std::size_t>(n), 5004);
  }
  check_movement<float>(3, big, 5005);
}

TEST_CASE("all_reduce larger than the last-level cache: the streaming-store path gives the same bits", "[collectives][large]") {
  // The shared-address direct all_reduce writes f32/f64 sums with streaming stores once all ranks'
  // inputs and outputs (2·n·S) exceed the last-level cache; the size here is just past that, odd,
  // so blocks are unequal and the copies have unaligned heads and tails.
  checked_guard guard;
  const std::size_t llc = detail::last_level_cache_bytes();
  if (llc > (std::size_t{64} << 20)) {
    WARN("last-level cache of " << llc << " bytes: the streaming path needs more memory than this test uses");
  } else {
    const std::size_t count = llc / 4 / sizeof(float) + 4099;
    const auto want = tessel_ref::reduce_vec<float>(6000, 2, count, reduce_op::sum);
    auto errs = on_ranks(2, [&](communicator& c, std::vector<std::string>& e) {
      const auto in = tessel_ref::gen_vec<float>(6000, c.rank(), count, reduce_op::sum);
      std::vector<float> out(count + 1);  // +1: an output not 64-byte aligned
      c.all_reduce(in.data(), out.data() + 1, count, dtype::f32, reduce_op::sum);
      expect_bits(e, out.data() + 1, want.data(), count, label<float>("all_reduce", 2, reduce_op::sum, count, algorithm::automatic, false, c.rank()));
      std::vector<float> buf = in;
      c.all_reduce(buf.data(), buf.data(), count, dtype::f32, reduce_op::sum);
      expect_bits(e, buf.data(), want.data(), count, label<float>("all_reduce", 2, reduce_op::sum, count, algorithm::automatic, true, c.rank()));
    });
    for (auto& s : errs) FAIL_CHECK(s);
  }
  // every size past the streaming threshold (forced down): f32/f64 sums take the fused streaming
  // pass, the rest ordinary stores; every dtype, op, count, rank count and in/out-of-place gives
  // the canonical bits
  struct force_streaming {
    force_streaming() { detail::ar_stream_above = 1; }
    ~force_streaming() { detail::ar_stream_above = 0; }
  } forced;
  for (int n : {2, 3, 5})
    for_each_type([&]<class T>(T) {
      for (reduce_op op : ops)
        for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{53327}}) {
          const auto want = tessel_ref::reduce_vec<T>(7000 + static_cast<std::uint64_t>(n), n, count, op);
          auto errs = on_ranks(n, [&](communicator& c, std::vector<std::string>& e) {
            const auto in = tessel_ref::gen_vec<T>(7000 + static_cast<std::uint64_t>(n), c.rank(), count, op);
            std::vector<T> out(count + 1);
            c.all_reduce(in.data(), out.data() + 1, count, dtype_of<T>, op, {algorithm::direct});
            expect_bits(e, out.data() + 1, want.data(), count, label<T>("all_reduce streaming", n, op, count, algorithm::direct, false, c.rank()));
            std::vector<T> buf = in;
            c.all_reduce(buf.data(), buf.data(), count, dtype_of<T>, op, {algorithm::direct});
            expect_bits(e, buf.data(), want.data(), count, label<T>("all_reduce streaming", n, op, count, algorithm::direct, true, c.rank()));
          });
          for (auto& s : errs) FAIL_CHECK(s);
        }
    });
}

TEST_CASE("the profiler records every collective on every rank, on the threads and emulated transports", "[collectives][profiler]") {
  using key = std::pair<std::string, std::string>;  // (transport, op)
  {
    profiler::session s;
    threads_world::run(3, [&](threads_transport t) {
      communicator c(std::move(t));
      std::vector<float> a(7, 1.0f), b(7), g(21);
      c.all_reduce(a.data(), b.data(), 7, dtype::f32, reduce_op::sum);
      c.all_gather(a.data(), g.data(), 7, dtype::f32);
      c.barrier();
      c.all_reduce_async(a.data(), b.data(), 7, dtype::f32, reduce_op::sum).wait();
    });
    emu::cluster_config cfg;
    cfg.cards_per_supernode = 4;
    cfg.card.memory_bytes = std::size_t{64} << 20;
    emu::cluster cl(cfg, 1);
    emulated_world(cl).run([&](emulated_transport t) {
      communicator c(std::move(t));
      std::vector<float> a(1000, 1.0f), b(1000);
      c.all_reduce(a.data(), b.data(), a.size(), dtype::f32, reduce_op::sum);
    });
  }
  const auto rs = profiler::collectives();
  std::map<key, std::set<int>> ranks;
  std::map<key, int> calls;
  for (const auto& r : rs) {
    const key k{r.transport, r.op};
    ranks[k].insert(r.rank);
    calls[k]++;
    CHECK(r.seconds >= 0);
    if (k == key{"threads", "all_reduce"}) {
      CHECK(r.bytes == 28);
      CHECK(r.ranks == 3);
      CHECK(std::string(r.algorithm) == "direct");  // 3 ranks, no super-nodes: direct
    }
    if (k == key{"threads", "all_gather"}) CHECK(r.bytes == 84);
    if (k == key{"threads", "barrier"}) CHECK(std::string(r.algorithm) == "dissemination");
    if (k == key{"emulated", "all_reduce"}) {
      CHECK(r.bytes == 4000);
      CHECK(r.ranks == 4);
      CHECK(std::string(r.algorithm) == "direct");  // a modelled fabric's small size: direct
      CHECK(r.transport_seconds > 0);               // simulated time of the fabric
    }
  }
  CHECK(rs.size() == 6 + 3 + 3 + 4);
  CHECK(calls[key{"threads", "all_reduce"}] == 6);  // blocking and asynchronous
  CHECK(calls[key{"threads", "all_gather"}] == 3);
  CHECK(calls[key{"threads", "barrier"}] == 3);
  CHECK(calls[key{"emulated", "all_reduce"}] == 4);
  CHECK(ranks[key{"threads", "all_reduce"}] == std::set<int>{0, 1, 2});
  CHECK(ranks[key{"emulated", "all_reduce"}] == std::set<int>{0, 1, 2, 3});
  const auto sum = profiler::summary();
  CHECK(sum.collective_calls == rs.size());
  REQUIRE_FALSE(sum.collectives.empty());
  for (std::size_t i = 1; i < sum.collectives.size(); ++i) CHECK(sum.collectives[i - 1].seconds >= sum.collectives[i].seconds);
}

}  // namespace tessel_test_collectives_communicator
