// The collectives on the emulated UBL128 cluster: the same canonical bits as every other transport
// (all algorithms, two super-nodes so hierarchical runs for real), 128 cards, simulated time that
// advances, and card failures injected at seeded random simulated times: every rank ends (no
// hang), each survivor either has the correct result or a typed comm_error.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <memory>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>

#include "reference/collectives_ref.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_emulated {

using namespace tessel;

namespace {
emu::cluster_config small_cluster(std::size_t per_node, std::size_t nodes) {
  emu::cluster_config cfg;
  cfg.cards_per_supernode = per_node;
  cfg.scaleout.supernodes = nodes;
  cfg.card.memory_bytes = std::size_t{1} << 30;
  return cfg;
}

template <class T>
std::vector<std::string> check_on_cluster(emu::cluster& cl, std::size_t count, reduce_op op, std::uint64_t seed) {
  const int n = static_cast<int>(cl.size());
  const auto want = tessel_ref::reduce_vec<T>(seed, n, count, op);
  std::mutex mu;
  std::vector<std::string> errs;
  emulated_world(cl).run([&](emulated_transport t) {
    communicator c(std::move(t));
    const auto in = tessel_ref::gen_vec<T>(seed, c.rank(), count, op);
    for (algorithm a :
         {algorithm::automatic, algorithm::ring, algorithm::direct, algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical}) {
      std::vector<T> out(count);
      const double t0 = c.now();
      c.all_reduce(in.data(), out.data(), count, dtype_of<T>, op, {a});
      const std::size_t bad = tessel_ref::count_wrong(out.data(), want.data(), count);
      std::lock_guard lk(mu);
      if (bad)
        errs.push_back(std::string(algorithm_name(a)) + " " + std::string(dtype_name(dtype_of<T>)) + " count " + std::to_string(count) + ": " +
                       std::to_string(bad) + " wrong on rank " + std::to_string(c.rank()));
      if (count > 0 && n > 1 && !(c.now() > t0)) errs.push_back("simulated clock did not advance");
    }
  });
  return errs;
}
// The canonical sum (rank order) over a set of ranks' inputs.
std::vector<float> expected_over(const std::vector<int>& ranks, std::uint64_t seed, std::size_t count) {
  std::vector<float> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = tessel_ref::gen<float>(seed, ranks[0], i, reduce_op::sum);
    for (std::size_t k = 1; k < ranks.size(); ++k) acc += tessel_ref::gen<float>(seed, ranks[k], i, reduce_op::sum);
    out[i] = acc;
  }
  return out;
}
}  // namespace

TEST_CASE("emulated: all_reduce equals the canonical reduction bitwise (8 cards in 2 super-nodes)", "[collectives][emulated]") {
  emu::cluster cl(small_cluster(4, 2), 1);
  std::vector<std::string> errs;
  for (std::size_t count : {0, 1, 7, 53327}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::min, reduce_op::avg}) {
      for (auto& e : check_on_cluster<float>(cl, count, op, 11 + count)) errs.push_back(e);
      for (auto& e : check_on_cluster<bf16>(cl, count, op, 12 + count)) errs.push_back(e);
    }
    for (auto& e : check_on_cluster<std::int32_t>(cl, count, reduce_op::prod, 13)) errs.push_back(e);
  }
  for (auto& e : errs) FAIL_CHECK(e);
}

TEST_CASE("emulated: 128 cards all_reduce and all_gather", "[collectives][emulated]") {
  emu::cluster cl(small_cluster(128, 1), 1);
  const std::size_t count = 1000;
  const auto want = tessel_ref::reduce_vec<float>(21, 128, count, reduce_op::sum);
  std::atomic<int> bad{0};
  emulated_world(cl).run([&](emulated_transport t) {
    communicator c(std::move(t));
    const auto in = tessel_ref::gen_vec<float>(21, c.rank(), count, reduce_op::sum);
    std::vector<float> out(count);
    c.all_reduce(in.data(), out.data(), count, dtype::f32, reduce_op::sum);
    bad += static_cast<int>(tessel_ref::count_wrong(out.data(), want.data(), count));
    std::vector<float> g(8 * 128);
    c.all_gather(in.data(), g.data(), 8, dtype::f32);
    for (int q = 0; q < 128; ++q) {
      const auto v = tessel_ref::gen_vec<float>(21, q, 8, reduce_op::sum);
      bad += static_cast<int>(tessel_ref::count_wrong(g.data() + q * 8, v.data(), 8));
    }
  });
  CHECK(bad == 0);
}

TEST_CASE("emulated: a card failing at a random simulated time gives survivors typed errors, never a hang, and shrink recovers",
          "[collectives][emulated][faults]") {
  std::mt19937_64 rng(4242);
  int trials = 0, errors = 0, wrong = 0, not_recovered = 0, recovered = 0, late_split = 0;
  const auto t_start = std::chrono::steady_clock::now();
  for (int trial = 0; trial < 1000; ++trial) {
    const std::size_t n = 3 + rng() % 4;  // 3..6 cards
    auto cfg = small_cluster(n, 1);
    cfg.faults.op_timeout = 200e-6;
    const std::size_t victim = rng() % n;
    const double at = static_cast<double>(rng() % 40) * 1e-6;  // 0..40 us: before, during or after
    cfg.faults.seed = trial;
    emu::cluster cl(cfg, 1);
    cl.schedule(emu::fault{at, emu::fault_kind::card_down, victim, 0, 0});
    const std::size_t count = 20000 + rng() % 20000;
    const std::uint64_t seed = rng();
    const algorithm a = std::array{algorithm::direct, algorithm::ring, algorithm::tree, algorithm::halving_doubling}[rng() % 4];
    const auto want = tessel_ref::reduce_vec<float>(seed, static_cast<int>(n), count, reduce_op::sum);
    std::atomic<int> errs{0}, bad{0}, unrecovered{0}, late{0}, shrunk_ok{0};
    emulated_world(cl).run([&](emulated_transport t) {
      communicator c(std::move(t));
      const int me = c.rank();
      const bool survivor = static_cast<std::size_t>(me) != victim;
      const auto in = tessel_ref::gen_vec<float>(seed, me, count, reduce_op::sum);
      std::vector<float> out(count);
      try {
        c.all_reduce(in.data(), out.data(), count, dtype::f32, reduce_op::sum, {a});
        if (survivor && tessel_ref::count_wrong(out.data(), want.data(), count)) ++bad;
      } catch (const comm_error&) {
        if (survivor) ++errs;
      } catch (const std::exception&) {
        if (survivor) ++bad;  // an untyped error is a failure
      }
      // ULFM-style recovery: every rank shrinks (a rank whose card failed is refused) and the
      // shrunk world computes again, checked against the fold over its members in rank order.
      // The world agreed on may still hold the victim when its failure comes later in simulated
      // time: then that collective fails (typed) and the ranks shrink again. A barrier ends each
      // attempt, so a member fails it unless every member finished the attempt's collectives.
      std::unique_ptr<communicator> cur;  // (not std::optional: GCC 12 -Wmaybe-uninitialized false positive)
      try {
        cur = std::make_unique<communicator>(c.shrink());
      } catch (const comm_error&) {
        if (survivor) ++unrecovered;
        return;  // this rank's card failed: it is not in the shrunk world
      }
      // Without ULFM's agree, a failure after the world was agreed can end an attempt on some
      // members and not on others; recovery is required when the victim was already excluded.
      const bool must = cur->size() == static_cast<int>(n) - 1;
      for (int attempt = 0; attempt < 4; ++attempt) {
        try {
          const int m = cur->size();
          std::vector<int> members(static_cast<std::size_t>(m));
          cur->all_gather(&me, members.data(), 1, dtype::i32);
          std::vector<float> out2(count);
          cur->all_reduce(in.data(), out2.data(), count, dtype::f32, reduce_op::sum, {a});
          cur->barrier();
          if (!survivor) return;  // the victim may pass when it fails after the world's last message
          if (std::find(members.begin(), members.end(), static_cast<int>(victim)) == members.end() && m != static_cast<int>(n) - 1)
            ++bad;  // a survivor went missing
          if (tessel_ref::count_wrong(out2.data(), expected_over(members, seed, count).data(), count)) ++bad;
          ++shrunk_ok;
          return;
        } catch (const comm_error&) {
        } catch (const std::exception&) {
          if (survivor) ++bad;
          return;
        }
        try {
          auto next = std::make_unique<communicator>(cur->shrink());
          cur = std::move(next);
        } catch (const comm_error&) {
          if (survivor) ++(must ? unrecovered : late);
          return;
        }
      }
      if (survivor) ++(must ? unrecovered : late);
    });
    ++trials;
    errors += errs;
    wrong += bad;
    not_recovered += unrecovered;
    recovered += shrunk_ok;
    late_split += late;
    if (unrecovered)
      UNSCOPED_INFO("trial " << trial << ": " << unrecovered << " survivors did not recover (n " << n << ", victim " << victim << ", at " << at
                             << ")");
    if (std::chrono::steady_clock::now() - t_start > std::chrono::seconds(40)) break;  // keep CI fast on 2 cores
  }
  INFO("trials " << trials << ", survivor errors " << errors << ", survivors recovered by shrink " << recovered
                 << ", survivors split by a failure after the shrink " << late_split);
  CHECK(wrong == 0);
  CHECK(not_recovered == 0);
  CHECK(recovered > 0);
  CHECK(errors > 0);
  CHECK(trials >= 100);
}

TEST_CASE("emulated: the automatic algorithm is the fastest in simulated time (16 cards, 8 B to 16 MiB)", "[collectives][emulated]") {
  // Timing-only cluster: the schedules run on sizes alone, and simulated time is deterministic.
  auto cfg = small_cluster(16, 1);
  cfg.timing_only = true;
  emu::cluster cl(cfg, 1);
  enum class op_kind { all_reduce, all_gather, reduce_scatter, broadcast, reduce };
  const char* const names[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"};
  const std::vector<algorithm> algos = {algorithm::automatic, algorithm::ring, algorithm::direct, algorithm::halving_doubling, algorithm::tree};
  const std::vector<std::size_t> sizes = {8, 4096, 65536, std::size_t{1} << 20, std::size_t{16} << 20};
  std::mutex mu;
  std::vector<std::string> errs;
  emulated_world(cl).run([&](emulated_transport t) {
    communicator c(std::move(t));
    for (op_kind k : {op_kind::all_reduce, op_kind::all_gather, op_kind::reduce_scatter, op_kind::broadcast, op_kind::reduce})
      for (std::size_t bytes : sizes) {
        const std::size_t count = bytes / 4;
        std::vector<double> took;
        for (algorithm a : algos) {
          c.barrier();
          const double t0 = c.now();
          switch (k) {
            case op_kind::all_reduce: c.all_reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum, {a}); break;
            case op_kind::all_gather: c.all_gather(nullptr, nullptr, count / 16, dtype::f32, {a}); break;
            case op_kind::reduce_scatter: c.reduce_scatter(nullptr, nullptr, count / 16, dtype::f32, reduce_op::sum, {a}); break;
            case op_kind::broadcast: c.broadcast(nullptr, nullptr, count, dtype::f32, 0, {a}); break;
            case op_kind::reduce: c.reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum, 0, {a}); break;
          }
          c.barrier();
          took.push_back(c.now() - t0);
        }
        const double best = *std::min_element(took.begin() + 1, took.end());
        if (c.rank() == 0 && took[0] > best * 1.02) {
          std::lock_guard lk(mu);
          errs.push_back(std::string(names[static_cast<int>(k)]) + " at " + std::to_string(bytes) + " B: automatic took " +
                         std::to_string(took[0] * 1e6) + " us, the best algorithm " + std::to_string(best * 1e6) + " us");
        }
      }
  });
  for (auto& e : errs) FAIL_CHECK(e);
}

TEST_CASE("emulated: ring algorithms pipeline their segments along the chain (16 cards cost little more than 4)", "[collectives][emulated]") {
  // A chain of n ranks moving S segments takes about (S + n - 1) segment times when it pipelines
  // and about (n - 1) * S when each hop waits for the whole message. 8 MiB in 512 KiB segments, 16
  // cards over 4: broadcast (S = 16) ~30/18 = 1.7, all-reduce (a reduce chain then a broadcast
  // chain, ~2S + n - 1) ~47/35 = 1.3 when pipelined; both ~5 when serial.
  auto time_on = [](std::size_t cards) {
    auto cfg = small_cluster(cards, 1);
    cfg.timing_only = true;
    emu::cluster cl(cfg, 1);
    std::vector<double> t(2);
    comm_options opt;
    opt.segment_bytes = std::size_t{512} << 10;
    emulated_world(cl).run([&](emulated_transport tp) {
      communicator c(std::move(tp), opt);
      const std::size_t count = (std::size_t{8} << 20) / 4;
      for (int k = 0; k < 2; ++k) {
        c.barrier();
        const double t0 = c.now();
        if (k == 0)
          c.all_reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum, {algorithm::ring});
        else
          c.broadcast(nullptr, nullptr, count, dtype::f32, 0, {algorithm::ring});
        c.barrier();
        if (c.rank() == 0) t[k] = c.now() - t0;
      }
    });
    return t;
  };
  const auto t4 = time_on(4), t16 = time_on(16);
  INFO("all_reduce ring 4 cards " << t4[0] * 1e6 << " us, 16 cards " << t16[0] * 1e6 << " us; broadcast ring " << t4[1] * 1e6 << " / " << t16[1] * 1e6
                                  << " us");
  CHECK(t16[0] < 2.0 * t4[0]);
  CHECK(t16[1] < 2.0 * t4[1]);
  CHECK(t16[0] > t4[0]);  // a longer chain still costs its extra hops
}

// On a modelled fabric the ring keeps several segments' receives posted on every hop
// (ar_ring_posted): many small segments, in and out of place, 8-bit-wider accumulators (bf16) and
// a count that leaves a short last segment must still give the canonical rank-order bits.
TEST_CASE("emulated: ring all_reduce over many posted segments equals the canonical reduction bitwise", "[collectives][emulated]") {
  auto cfg = small_cluster(6, 1);
  emu::cluster cl(cfg, 1);
  comm_options opt;
  opt.segment_bytes = 256;  // 64 f32 / 128 bf16 elements: dozens of segments in flight
  std::mutex mu;
  std::vector<std::string> errs;
  for (std::size_t count : {std::size_t{1}, std::size_t{64}, std::size_t{5000}}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::avg}) {
      const auto want_f = tessel_ref::reduce_vec<float>(21 + count, 6, count, op);
      const auto want_b = tessel_ref::reduce_vec<bf16>(22 + count, 6, count, op);
      emulated_world(cl).run([&](emulated_transport t) {
        communicator c(std::move(t), opt);
        auto in_f = tessel_ref::gen_vec<float>(21 + count, c.rank(), count, op);
        auto in_b = tessel_ref::gen_vec<bf16>(22 + count, c.rank(), count, op);
        std::vector<float> out_f(count);
        std::vector<bf16> out_b(count);
        c.all_reduce(in_f.data(), out_f.data(), count, dtype::f32, op, {algorithm::ring});
        c.all_reduce(in_b.data(), out_b.data(), count, dtype::bf16, op, {algorithm::ring});
        const std::size_t bad_f = tessel_ref::count_wrong(out_f.data(), want_f.data(), count);
        const std::size_t bad_b = tessel_ref::count_wrong(out_b.data(), want_b.data(), count);
        c.all_reduce(in_f.data(), in_f.data(), count, dtype::f32, op, {algorithm::ring});  // in place
        c.all_reduce(in_b.data(), in_b.data(), count, dtype::bf16, op, {algorithm::ring});
        const std::size_t bad_fi = tessel_ref::count_wrong(in_f.data(), want_f.data(), count);
        const std::size_t bad_bi = tessel_ref::count_wrong(in_b.data(), want_b.data(), count);
        std::lock_guard lk(mu);
        if (bad_f + bad_b + bad_fi + bad_bi)
          errs.push_back("count " + std::to_string(count) + " op " + std::string(reduce_op_name(op)) + " rank " + std::to_string(c.rank()) +
                         ": wrong f32 " + std::to_string(bad_f) + ", bf16 " + std::to_string(bad_b) + ", in place f32 " + std::to_string(bad_fi) +
                         ", bf16 " + std::to_string(bad_bi));
      });
    }
  }
  for (auto& e : errs) FAIL_CHECK(e);
  CHECK(errs.empty());
}

// The latency of a hop overlaps the previous segments' transfers: on 8 cards, 64 MiB in 512 KiB
// segments, the ring's bus bandwidth is within the chain's own limit. A canonical-order chain sends
// 2·S per card where the bound counts 2·S·(n-1)/n, so its best is (n-1)/n of the bound less the
// pipeline's fill of 2(n-1) hops over S/segment segments: 0.875 · 128/142 = 0.79 here. With one
// segment in flight per hop it was 0.875 · 1.31/(1.31 + 0.55) = 0.62 (the latency, 0.55 us, paid
// in turn with each 1.31 us segment).
TEST_CASE("emulated: the ring all_reduce keeps segments in flight (the hop latency is not paid per segment)", "[collectives][emulated]") {
  auto cfg = small_cluster(8, 1);
  cfg.timing_only = true;
  emu::cluster cl(cfg, 1);
  comm_options opt;
  opt.segment_bytes = std::size_t{512} << 10;
  const std::size_t bytes = std::size_t{64} << 20, count = bytes / 4;
  double t = 0;
  emulated_world(cl).run([&](emulated_transport tp) {
    communicator c(std::move(tp), opt);
    c.barrier();
    const double t0 = c.now();
    c.all_reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum, {algorithm::ring});
    c.barrier();
    if (c.rank() == 0) t = c.now() - t0;
  });
  const double n = 8, busbw = 2 * (n - 1) / n * double(bytes) / t, bound = cfg.card_bandwidth();
  INFO("ring all_reduce of 64 MiB on 8 cards: " << t * 1e6 << " us, bus " << busbw / 1e9 << " GB/s of a " << bound / 1e9 << " GB/s bound");
  CHECK(busbw > 0.72 * bound);
}

TEST_CASE("emulated: revoke ends every pending transfer at once, and agree returns every live rank's words without waiting for a dead one",
          "[collectives][emulated][faults]") {
  auto cfg = small_cluster(4, 1);
  cfg.faults.op_timeout = 10e-3;
  {
    // ranks 0 and 1 wait on each other's sends that never come; rank 2 revokes at 1 us
    emu::cluster cl(cfg, 1);
    std::mutex mu;
    std::vector<std::string> errs;
    std::vector<double> ended(4, -1);
    std::vector<std::vector<std::uint64_t>> got(4);
    emulated_world(cl).run([&](emulated_transport t) {
      const int me = t.rank();
      auto fail = [&](const std::string& e) {
        std::lock_guard lk(mu);
        errs.push_back("rank " + std::to_string(me) + ": " + e);
      };
      if (me < 2) {
        std::uint64_t x = 0;
        try {
          t.recv_into(1 - me, 5, std::as_writable_bytes(std::span(&x, 1)));
          fail("the receive returned");
        } catch (const comm_revoked_error&) { ended[std::size_t(me)] = t.now(); } catch (const std::exception& e) {
          fail(std::string("untyped or wrong error: ") + e.what());
        }
      } else if (me == 2) {
        t.cluster().at(t.card()).advance_to(1e-6);
        t.revoke(-1);
        try {
          const std::uint64_t x = 1;
          auto r = t.isend(0, 6, std::as_bytes(std::span(&x, 1)));
          fail("a post after the revoke was accepted");
        } catch (const comm_revoked_error&) {}
      }
      const std::uint64_t mine[2] = {std::uint64_t(me) * 10, 7};
      const auto a = t.agree(mine);
      std::lock_guard lk(mu);
      if (a.members != std::vector<int>{0, 1, 2, 3}) errs.push_back("rank " + std::to_string(me) + ": members differ");
      for (int r = 0; r < 4; ++r)
        if (a.values[std::size_t(r)] != std::vector<std::uint64_t>{std::uint64_t(r) * 10, 7})
          errs.push_back("rank " + std::to_string(me) + ": words differ");
      got[std::size_t(me)] = {std::uint64_t(a.at * 1e12)};
    });
    CHECK(errs.empty());
    for (const auto& e : errs) UNSCOPED_INFO(e);
    // the revoke reached the waiting ranks a direct latency after rank 2's clock (or refused a
    // receive posted after it), not at the 10 ms timeout
    for (int r = 0; r < 2; ++r) {
      CHECK(ended[std::size_t(r)] >= 0);
      CHECK(ended[std::size_t(r)] <= (1e-6 + cfg.direct_latency()) * (1 + 1e-9));
    }
    for (int r = 1; r < 4; ++r) CHECK(got[std::size_t(r)] == got[0]);  // one agreement time for all
  }
  {
    // card 3 is dead from the start: its rank's agree fails, the others' completes without it
    emu::cluster cl(cfg, 1);
    cl.schedule({0, emu::fault_kind::card_down, 3, 0, 0});
    std::mutex mu;
    int dead_refused = 0, agreed = 0;
    emulated_world(cl).run([&](emulated_transport t) {
      const std::uint64_t mine = std::uint64_t(t.rank());
      try {
        const auto a = t.agree(std::span(&mine, 1));
        std::lock_guard lk(mu);
        if (a.members == std::vector<int>{0, 1, 2} && a.values[3].empty() && a.values[2] == std::vector<std::uint64_t>{2}) ++agreed;
      } catch (const peer_failed_error&) {
        std::lock_guard lk(mu);
        if (t.rank() == 3) ++dead_refused;
      }
    });
    CHECK(dead_refused == 1);
    CHECK(agreed == 3);
  }
}

}  // namespace tessel_test_collectives_emulated
