// The threads transport's failure semantics: a rank that stops mid-collective (seeded fault
// injection at a random transport operation, 1000 trials) never hangs its peers: each survivor
// either completed with the correct result or got a typed comm_error, all of them get one by the
// next collective, and shrink() gives a communicator of the survivors that computes correctly.
// Also abort() from another thread, timeouts of a hung peer, and async handles.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <tessel/collectives.hpp>

#include "reference/collectives_ref.hpp"
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_threads {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;
using namespace std::chrono_literals;

namespace {
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

TEST_CASE("threads: a rank stopping at a random point never hangs survivors, and shrink recovers (1000 seeded trials)",
          "[collectives][threads][faults]") {
  std::mt19937_64 rng(20261129);
  const algorithm algos[] = {algorithm::ring, algorithm::direct, algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical};
  int errors_seen = 0, completions_seen = 0, trials_with_wrong = 0, hangs = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 7);  // 2..8
    const int victim = static_cast<int>(rng() % static_cast<std::uint64_t>(n));
    const std::int64_t fail_at = static_cast<std::int64_t>(rng() % 24);
    const algorithm a = algos[rng() % 5];
    const std::size_t count = 1 + rng() % 3000;
    const std::uint64_t seed = rng();
    threads_world w(n, 5s);
    w.fail_after(victim, fail_at);
    std::mutex mu;
    std::vector<std::string> problems;
    std::atomic<int> errs{0}, oks{0};
    const auto t0 = std::chrono::steady_clock::now();
    w.run([&](threads_transport t) {
      const int r = t.rank();
      comm_options o;
      if (n % 2 == 0) o.node_size = 2;
      communicator c(t, o);
      const auto in = tessel_ref::gen_vec<float>(seed, r, count, reduce_op::sum);
      std::vector<float> out(count);
      bool failed = false;
      try {
        c.all_reduce(in.data(), out.data(), count, dtype::f32, reduce_op::sum, {a});
      } catch (const rank_stopped_error&) {
        return;  // the victim: its thread ends here
      } catch (const comm_error&) {
        failed = true;
        ++errs;
      }
      if (r == victim) {  // the injection point was past this collective: stop now
        t.stop();
        return;
      }
      if (!failed) {
        ++oks;
        std::vector<int> all(static_cast<std::size_t>(n));
        for (int q = 0; q < n; ++q) all[static_cast<std::size_t>(q)] = q;
        const auto want = expected_over(all, seed, count);
        if (tessel_ref::count_wrong(out.data(), want.data(), count)) {
          std::lock_guard lk(mu);
          problems.push_back("completed with a wrong result");
        }
        // the failure must surface by the next collective at the latest
        try {
          c.barrier();
          std::lock_guard lk(mu);
          problems.push_back("barrier after a failure succeeded");
        } catch (const comm_error&) {}
      }
      // ULFM-style recovery: the survivors shrink and compute again
      communicator s = c.shrink();
      std::vector<int> survivors;
      for (int q = 0; q < n; ++q)
        if (q != victim) survivors.push_back(q);
      if (s.size() != n - 1) {
        std::lock_guard lk(mu);
        problems.push_back("shrunk size " + std::to_string(s.size()));
        return;
      }
      std::vector<float> out2(count);
      s.all_reduce(in.data(), out2.data(), count, dtype::f32, reduce_op::sum, {a});
      const auto want2 = expected_over(survivors, seed, count);
      if (tessel_ref::count_wrong(out2.data(), want2.data(), count)) {
        std::lock_guard lk(mu);
        problems.push_back("shrunk communicator gave a wrong result");
      }
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (secs > 4.0) ++hangs;
    errors_seen += errs;
    completions_seen += oks;
    if (!problems.empty()) {
      ++trials_with_wrong;
      FAIL_CHECK("trial " << trial << " n=" << n << " victim=" << victim << " fail_at=" << fail_at << " algo=" << algorithm_name(a) << ": "
                          << problems.front());
    }
  }
  CHECK(hangs == 0);
  CHECK(trials_with_wrong == 0);
  CHECK(errors_seen > 500);  // most injections land inside the collective
  INFO("survivor errors " << errors_seen << ", survivor completions " << completions_seen);
  CHECK(completions_seen >= 0);
}

TEST_CASE("threads: abort() from another thread releases every waiter", "[collectives][threads][faults]") {
  threads_world w(4, 30s);
  std::atomic<int> aborted{0};
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    w.abort();
  });
  const auto t0 = std::chrono::steady_clock::now();
  w.run([&](threads_transport t) {
    communicator c(std::move(t));
    if (c.rank() == 0) return;  // rank 0 never joins: the others would wait forever
    std::vector<float> x(16, 1.0f);
    try {
      c.all_reduce(x.data(), x.data(), x.size(), dtype::f32, reduce_op::sum);
    } catch (const comm_aborted_error&) { ++aborted; }
  });
  killer.join();
  CHECK(aborted == 3);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("threads: a hung peer gives comm_timeout_error within the timeout", "[collectives][threads][faults]") {
  threads_world w(3, 200ms);
  std::atomic<int> timeouts{0}, others{0};
  const auto t0 = std::chrono::steady_clock::now();
  w.run([&](threads_transport t) {
    communicator c(std::move(t));
    if (c.rank() == 2) {
      std::this_thread::sleep_for(600ms);  // alive but silent
      return;
    }
    std::vector<double> x(8, 1.0);
    try {
      c.all_reduce(x.data(), x.data(), x.size(), dtype::f64, reduce_op::sum, {algorithm::direct});
    } catch (const comm_timeout_error&) { ++timeouts; } catch (const comm_error&) {
      ++others;  // released by the first rank's revoke
    }
  });
  CHECK(timeouts >= 1);
  CHECK(timeouts + others == 2);
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
}

TEST_CASE("threads: async collectives overlap and complete in order, and errors come out of wait()", "[collectives][threads][async]") {
  std::mutex mu;
  std::vector<std::string> problems;
  threads_world::run(4, [&](threads_transport t) {
    communicator c(std::move(t));
    const std::size_t count = 100000;
    const auto a = tessel_ref::gen_vec<float>(1, c.rank(), count, reduce_op::sum);
    const auto b = tessel_ref::gen_vec<bf16>(2, c.rank(), count, reduce_op::sum);
    std::vector<float> oa(count);
    std::vector<bf16> ob(count);
    std::vector<float> g(count * 4);
    request h1 = c.all_reduce_async(a.data(), oa.data(), count, dtype::f32, reduce_op::sum, {algorithm::ring});
    request h2 = c.all_reduce_async(b.data(), ob.data(), count, dtype::bf16, reduce_op::sum);
    request h3 = c.all_gather_async(a.data(), g.data(), count, dtype::f32);
    while (!h3.test()) std::this_thread::yield();  // in-order: h3 done implies h1 and h2 done
    const bool in_order = h1.test() && h2.test();
    h1.wait();
    h2.wait();
    h3.wait();
    c.barrier();  // a blocking call after async ones keeps the order
    const auto wa = tessel_ref::reduce_vec<float>(1, 4, count, reduce_op::sum);
    const auto wb = tessel_ref::reduce_vec<bf16>(2, 4, count, reduce_op::sum);
    std::lock_guard lk(mu);
    if (!in_order) problems.push_back("async completed out of order");
    if (tessel_ref::count_wrong(oa.data(), wa.data(), count)) problems.push_back("async f32 wrong");
    if (tessel_ref::count_wrong(ob.data(), wb.data(), count)) problems.push_back("async bf16 wrong");
    for (int q = 0; q < 4; ++q) {
      const auto v = tessel_ref::gen_vec<float>(1, q, count, reduce_op::sum);
      if (tessel_ref::count_wrong(g.data() + count * static_cast<std::size_t>(q), v.data(), count)) problems.push_back("async all_gather wrong");
    }
  });
  for (auto& p : problems) FAIL_CHECK(p);
  // an error inside an async collective surfaces from wait()
  int typed = 0;
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    std::vector<float> x(4);
    request h = c.all_reduce_async(x.data(), x.data(), 4, dtype::i4x2, reduce_op::sum);
    try {
      h.wait();
    } catch (const comm_error& e) {
      if (e.code() != errc::invalid_argument) throw;
      std::lock_guard lk(mu);
      ++typed;
    }
  });
  CHECK(typed == 2);
}

TEST_CASE("threads: a send whose receiver's consumer throws part-way fails the sender's wait", "[collectives][threads][faults]") {
  // The shared-address all_reduce relies on this: a peer's receive of our address message ending
  // means it finished writing its block into our output, unless its wait says otherwise.
  std::atomic<int> sender_errors{0}, receiver_errors{0};
  threads_world::run(2, [&](threads_transport t) {
    std::vector<std::byte> buf(64);
    if (t.rank() == 0) {
      auto req = t.isend(1, 7, buf);
      try {
        t.wait(req);
      } catch (const peer_failed_error& e) {
        if (e.peer == 1) ++sender_errors;
      }
      // a message rejected unread (wrong size) is not a failure of the sender's side
      auto req2 = t.isend(1, 8, buf);
      t.wait(req2);
    } else {
      try {
        t.recv(0, 7, buf.size(), [&](std::span<const std::byte>, std::size_t) { throw std::runtime_error("half-way"); });
      } catch (const std::runtime_error&) { ++receiver_errors; }
      CHECK_THROWS_MATCHES(t.recv_into(0, 8, std::span<std::byte>(buf.data(), 32)), comm_error,
                           is_error(errc::invalid_argument, "comm", "threads_transport"));
    }
  });
  CHECK(sender_errors == 1);
  CHECK(receiver_errors == 1);
}

TEST_CASE("threads: waits spin for a bounded time only, and any spin setting gives the same results", "[collectives][threads]") {
  CHECK_THROWS_MATCHES(threads_world(2).set_spin(std::chrono::nanoseconds(-1)), comm_error, is_error(errc::invalid_argument, "comm", "spin time"));
  const std::size_t count = 40000;
  const auto want = expected_over({0, 1, 2}, 77, count);
  for (auto spin : {std::chrono::nanoseconds(0), std::chrono::nanoseconds(20000), std::chrono::nanoseconds(2000000)}) {
    threads_world w(3, 10s);
    w.set_spin(spin);
    std::atomic<int> wrong{0};
    w.run([&](threads_transport t) {
      communicator c(std::move(t));
      const auto in = tessel_ref::gen_vec<float>(77, c.rank(), count, reduce_op::sum);
      for (algorithm a : {algorithm::direct, algorithm::ring}) {
        std::vector<float> out(count);
        for (int rep = 0; rep < 3; ++rep) c.all_reduce(in.data(), out.data(), count, dtype::f32, reduce_op::sum, {a});
        wrong += tessel_ref::count_wrong(out.data(), want.data(), count) != 0;
      }
    });
    CHECK(wrong == 0);
  }
  // a peer that is late by far more than the spin time: the waiter sleeps and still completes
  threads_world w(2, 10s);
  w.set_spin(std::chrono::microseconds(5));
  std::atomic<int> wrong{0};
  w.run([&](threads_transport t) {
    communicator c(std::move(t));
    if (c.rank() == 1) std::this_thread::sleep_for(20ms);
    const auto in = tessel_ref::gen_vec<float>(78, c.rank(), count, reduce_op::sum);
    std::vector<float> out(count);
    c.all_reduce(in.data(), out.data(), count, dtype::f32, reduce_op::sum);
    wrong += tessel_ref::count_wrong(out.data(), expected_over({0, 1}, 78, count).data(), count) != 0;
  });
  CHECK(wrong == 0);
}

}  // namespace tessel_test_collectives_threads
