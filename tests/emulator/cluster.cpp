#include <catch2/catch.hpp>

#include <cstring>
#include <atomic>
#include <numeric>
#include <thread>
#include <tessel/emulator/cluster.hpp>
#include "error_match.hpp"

namespace tessel_test_emulator_cluster {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;
using namespace tessel::emu;

namespace {
cluster_config small(std::size_t cards) {
  cluster_config c;
  c.cards_per_supernode = cards;
  c.card.memory_bytes = 256 << 20;
  return c;
}
}  // namespace

TEST_CASE("put moves real bytes and the time comes from the fabric", "[emulator][cluster]") {
  auto cfg = small(4);
  cluster cl(cfg, 1);
  const std::size_t n = 1 << 20;
  auto* a = static_cast<unsigned char*>(cl[0].allocate(n));
  auto* b = static_cast<unsigned char*>(cl[2].allocate(n));
  for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<unsigned char>(i * 7);
  std::memset(b, 0, n);
  auto c = cl.put(0, a, 2, b, n);
  CHECK(std::memcmp(a, b, n) != 0);  // nothing moved before the wait
  c.wait();
  CHECK(std::memcmp(a, b, n) == 0);
  CHECK(cl.clock(0) == Approx(cfg.direct_latency() + n / cfg.card_bandwidth()).epsilon(0.01));
  CHECK(cl.clock(2) == 0);  // one-sided: the target's clock moves only if it waits
  cl.wait(c, 2);
  CHECK(cl.clock(2) == Approx(cl.clock(0)));
}

TEST_CASE("get reads from the peer", "[emulator][cluster]") {
  auto cfg = small(3);
  cluster cl(cfg, 1);
  auto* remote = cl[1].allocate_n<int>(1000);
  auto* local = cl[0].allocate_n<int>(1000);
  std::iota(remote, remote + 1000, 5);
  auto c = cl.get(0, local, 1, remote, 4000);
  c.wait();
  CHECK(local[999] == 1004);
  CHECK(cl.clock(0) == Approx(2 * cfg.direct_latency() + 4000 / cfg.card_bandwidth()).epsilon(0.01));
}

TEST_CASE("send/recv match in order and start when both sides posted", "[emulator][cluster]") {
  auto cfg = small(2);
  cluster cl(cfg, 1);
  auto* s = cl[0].allocate_n<double>(4096);
  auto* r = cl[1].allocate_n<double>(8192);
  for (int i = 0; i < 4096; ++i) s[i] = i * 0.5;
  // the receiver is busy until 1 ms: the transfer starts then
  cl[1].charge(kernel_cost{400e9 - 5e-6 * 400e9, 0, math_precision::bf16});
  const double t1 = cl.clock(1);
  auto a = cl.send(0, 1, s, 2048 * sizeof(double), 9);
  auto b = cl.send(0, 1, s + 2048, 2048 * sizeof(double), 9);
  auto ra = cl.recv(1, 0, r, 2048 * sizeof(double), 9);
  auto rb = cl.recv(1, 0, r + 4096, 2048 * sizeof(double), 9);
  cl.wait_all({ra, rb});
  CHECK(r[2047] == 2047 * 0.5);
  CHECK(r[4096] == 2048 * 0.5);
  CHECK(cl.completion_time(ra) >= t1 + cfg.direct_latency());
  CHECK(cl.clock(1) == Approx(cl.completion_time(rb)));
  a.wait();
  b.wait();
  CHECK(cl.clock(0) == Approx(cl.completion_time(b)));
}

TEST_CASE("data plane errors are typed and name the card", "[emulator][cluster]") {
  auto cfg = small(3);
  cfg.faults.op_timeout = 20e-6;
  cluster cl(cfg, 1);
  auto* p0 = cl[0].allocate(4096);
  auto* p1 = cl[1].allocate(4096);
  CHECK_THROWS_AS(cl.put(0, p0, 3, p1, 16), invalid_card_error);    // bad card index
  CHECK_THROWS_AS(cl.put(0, p0, 2, p1, 16), invalid_card_error);    // p1 is not card 2's
  CHECK_THROWS_AS(cl.put(0, p0, 1, p1, 8192), invalid_card_error);  // past the allocation
  CHECK_THROWS_MATCHES(cl.put(0, nullptr, 1, p1, 8), emu::emulator_error, is_error(errc::invalid_argument, "emulator", "null pointer"));
  CHECK_THROWS_MATCHES(cl.at(99), emu::invalid_card_error, is_error(errc::out_of_range, "emulator", "invalid card index"));
  // size mismatch between send and recv
  auto s = cl.send(0, 1, p0, 100);
  auto r = cl.recv(1, 0, p1, 200);
  CHECK_THROWS_MATCHES(s.wait(), emu::emulator_error, is_error(errc::invalid_argument, "emulator", "matched a recv"));
  CHECK_THROWS_MATCHES(r.wait(), emu::emulator_error, is_error(errc::invalid_argument, "emulator", "matched a recv"));
  // a recv nobody sends to ends at the simulated timeout, naming the peer
  auto lonely = cl.recv(1, 2, p1, 64, 77);
  try {
    lonely.wait();
    FAIL("expected timeout_error");
  } catch (const timeout_error& e) {
    CHECK(e.card == 2);
    CHECK(e.at == Approx(cl.completion_time(lonely)));
  }
  CHECK(cl.clock(1) >= 20e-6);
  // capacity
  CHECK_THROWS_AS(cl[2].allocate(std::size_t{1} << 30), capacity_error);
}

TEST_CASE("hot swap: memory is lost and the card rejoins empty", "[emulator][cluster][faults]") {
  auto cfg = small(4);
  cluster cl(cfg, 1);
  std::vector<failure_notice> seen;
  cl.on_failure([&](const failure_notice& n) { seen.push_back(n); });
  auto* old = cl[3].allocate(1 << 20);
  auto* src = cl[0].allocate(1 << 20);
  cl.schedule({50e-6, fault_kind::hot_swap, 3, 0, 200e-6});
  // a transfer in flight when the card dies fails with card_failed_error naming it
  auto big = cl.put(0, src, 3, old, 1 << 20);
  cl[0].advance_to(49e-6);
  auto doomed = cl.put(0, src, 3, old, 1 << 20);
  big.wait();  // finished before the fault
  try {
    doomed.wait();
    FAIL("expected card_failed_error");
  } catch (const card_failed_error& e) {
    CHECK(e.card == 3);
    CHECK(e.at <= 50e-6 + cl.net().detection_bound());
  }
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].card == 3);
  CHECK(cl.failed(3));
  // compute on the card during the outage fails
  cl[3].advance_to(100e-6);
  CHECK_THROWS_AS(cl[3].charge(kernel_cost{}), card_failed_error);
  // after the swap: empty, old pointers are gone, new allocations work
  cl.net().run_until(300e-6);
  CHECK_FALSE(cl.failed(3));
  CHECK(cl[3].used() == 0);
  CHECK(cl[3].incarnation() == 1);
  CHECK_THROWS_AS(cl.put(0, src, 3, old, 16), invalid_card_error);
  CHECK_THROWS_AS(cl[3].deallocate(old), invalid_card_error);
  cl[3].advance_to(300e-6);
  auto* fresh = cl[3].allocate(1 << 20);
  cl[0].advance_to(300e-6);
  auto ok = cl.put(0, src, 3, fresh, 1 << 20);
  CHECK_NOTHROW(ok.wait());
}

TEST_CASE("timing-only clusters move no payload", "[emulator][cluster]") {
  auto cfg = small(8);
  cfg.timing_only = true;
  cfg.card.memory_bytes = std::size_t{64} << 30;
  cluster cl(cfg, 1);
  void* a = cl[0].allocate(std::size_t{32} << 30);  // no host memory behind it
  void* b = cl[1].allocate(std::size_t{32} << 30);
  auto c = cl.put(0, a, 1, b, std::size_t{1} << 30);
  auto d = cl.put(2, nullptr, 3, nullptr, std::size_t{1} << 30);
  c.wait();
  d.wait();
  CHECK(cl.clock(0) == Approx(cfg.direct_latency() + (1ull << 30) / cfg.card_bandwidth()).epsilon(0.01));
  CHECK(cl.clock(2) == Approx(cl.clock(0)));
}

TEST_CASE("several host threads drive their own cards at once with exact timing", "[emulator][cluster][threads]") {
  auto cfg = small(4);
  cluster cl(cfg, 2);
  std::vector<int*> in(4), out(4);
  for (std::size_t r = 0; r < 4; ++r) {
    in[r] = cl[r].allocate_n<int>(1024);
    out[r] = cl[r].allocate_n<int>(1024);
  }
  struct fill {
    int* p;
    int v;
    void operator()(block_ctx& ctx) const {
      for (std::size_t i = ctx.block_linear() * 256; i < (ctx.block_linear() + 1) * 256; ++i) p[i] = v;
    }
  };
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> t0(4), done(4);
    for (std::size_t r = 0; r < 4; ++r) t0[r] = cl.clock(r);
    std::vector<std::thread> ts;
    std::atomic<int> errors{0};
    for (std::size_t r = 0; r < 4; ++r) cl.attach(r);
    for (std::size_t r = 0; r < 4; ++r)
      ts.emplace_back([&, r] {
        try {
          cluster::driver_scope scope(cl, r, cluster::adopt);
          // card r computes for (r + 1) x 10 us, then passes 4 KiB around the ring, twice
          cl[r].launch(grid{4}, fill{in[r], static_cast<int>(r) + 100}, kernel_cost{(r + 1) * 10e-6 * cfg.card.peak_fp32, 0, math_precision::f32});
          for (int k = 0; k < 2; ++k) {
            auto s = cl.send(r, (r + 1) % 4, in[r], 4096, 1);
            auto v = cl.recv(r, (r + 3) % 4, out[r], 4096, 1);
            v.wait();
            s.wait();
          }
          done[r] = cl.clock(r);
        } catch (const std::exception& e) {
          WARN(e.what());
          errors++;
        }
      });
    for (auto& t : ts) t.join();
    REQUIRE(errors.load() == 0);
    for (std::size_t r = 0; r < 4; ++r) CHECK(out[r][1023] == static_cast<int>((r + 3) % 4) + 100);
    // closed form: step 1 starts when both neighbours finished computing; the slowest card (3)
    // gates its neighbours, and the second step chains behind the first
    const double hop = cfg.direct_latency() + 4096 / cfg.card_bandwidth(), L = cfg.card.launch_overhead;
    std::vector<double> ready(4), step1(4), step2(4);
    for (std::size_t r = 0; r < 4; ++r) ready[r] = t0[r] + (r + 1) * 10e-6 + L;
    for (std::size_t r = 0; r < 4; ++r) step1[r] = std::max(ready[r], ready[(r + 3) % 4]) + hop;  // recv from r-1
    std::vector<double> c1(4);
    for (std::size_t r = 0; r < 4; ++r) c1[r] = std::max(step1[r], std::max(ready[r], ready[(r + 1) % 4]) + hop);  // + own send
    for (std::size_t r = 0; r < 4; ++r) step2[r] = std::max(c1[r], c1[(r + 3) % 4]) + hop;
    for (std::size_t r = 0; r < 4; ++r) {
      double c2 = std::max(step2[r], std::max(c1[r], c1[(r + 1) % 4]) + hop);
      CHECK(done[r] == Approx(c2).epsilon(1e-9));
    }
  }
}

TEST_CASE("a threaded recv nobody answers times out once every other driver is blocked", "[emulator][cluster][threads]") {
  auto cfg = small(3);
  cfg.faults.op_timeout = 30e-6;
  cluster cl(cfg, 1);
  cl.set_allow_host_buffers(true);
  std::vector<char> buf(64);
  std::atomic<int> timeouts{0};
  std::vector<std::thread> ts;
  for (std::size_t r = 0; r < 3; ++r) cl.attach(r);
  for (std::size_t r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      cluster::driver_scope scope(cl, r, cluster::adopt);
      try {
        cl.recv(r, (r + 1) % 3, buf.data(), 8, 5).wait();  // everyone receives, nobody sends
      } catch (const timeout_error& e) {
        if (e.card == (r + 1) % 3) timeouts++;
      }
    });
  for (auto& t : ts) t.join();
  CHECK(timeouts.load() == 3);
}

TEST_CASE("abort ends pending transfers and refuses new ones", "[emulator][cluster]") {
  auto cfg = small(2);
  cluster cl(cfg, 1);
  auto* a = cl[0].allocate(1 << 20);
  auto* b = cl[1].allocate(1 << 20);
  auto r = cl.recv(1, 0, b, 64);
  auto p = cl.put(0, a, 1, b, 1 << 20);
  cl.abort("test abort");
  CHECK(cl.aborted());
  CHECK_THROWS_AS(r.wait(), fault_error);
  CHECK_THROWS_WITH(p.wait(), Catch::Contains("test abort"));
  CHECK_THROWS_AS(cl.send(0, 1, a, 64), fault_error);
  cl.drain();  // the model still finishes what was in flight
}
}  // namespace tessel_test_emulator_cluster
