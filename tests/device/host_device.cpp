// host_device and executor: every block runs once, exceptions reach the caller, nested and
// concurrent launches, shared executors, the caching pool, and typed errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <tessel/device.hpp>
#include "error_match.hpp"

namespace tessel_test_device_host_device {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

TEST_CASE("host_device models the device concept", "[device][concept]") {
  STATIC_REQUIRE(device<host_device>);
  STATIC_REQUIRE(tile_program<detail::empty_program>);
  host_device d(2);
  REQUIRE(d.capabilities().workers == 2);
  REQUIRE(d.capabilities().name == "host");
  d.synchronize();
  auto e = d.record();
  e.wait();
  REQUIRE(e.ready());
}

TEST_CASE("every block of a 3-D grid runs exactly once", "[device][launch]") {
  host_device d(2);
  for (grid g : {grid{1}, grid{7}, grid{3, 5}, grid{2, 3, 4}, grid{0, 5}, grid{129, 1, 2}}) {
    std::vector<std::atomic<int>> hits(g.empty() ? 1 : g.size());
    std::atomic<int> bad{0};  // Catch2 assertions are not thread-safe: workers only count, the test thread checks
    d.launch(g, [&](block_ctx& ctx) {
      auto i = ctx.block_index3();
      if (!(ctx.dims() == g)) bad++;
      if (i[0] + g.x * (i[1] + g.y * i[2]) != ctx.block_linear()) bad++;
      if (ctx.worker_id() >= ctx.num_workers()) bad++;
      hits[ctx.block_linear()]++;
    });
    REQUIRE(bad.load() == 0);
    if (!g.empty())
      for (auto& h : hits) REQUIRE(h.load() == 1);
  }
}

TEST_CASE("exceptions thrown by a program reach launch", "[device][errors]") {
  host_device d(2);
  REQUIRE_THROWS_WITH(d.launch(grid{64},
                               [](block_ctx& ctx) {
                                 if (ctx.block_linear() == 17) throw std::runtime_error("block 17 failed");
                               }),
                      "block 17 failed");
  // the device still works afterwards
  std::atomic<int> n{0};
  d.launch(grid{10}, [&](block_ctx&) { n++; });
  REQUIRE(n == 10);
}

TEST_CASE("nested launches run inline, and concurrent launches from many threads", "[device][launch]") {
  host_device d(2);
  std::atomic<int> n{0};
  d.launch(grid{4}, [&](block_ctx&) { d.launch(grid{3}, [&](block_ctx&) { n++; }); });
  REQUIRE(n == 12);
  n = 0;
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t)
    ts.emplace_back([&] {
      for (int r = 0; r < 50; ++r) d.launch(grid{5}, [&](block_ctx&) { n++; });
    });
  for (auto& t : ts) t.join();
  REQUIRE(n == 6 * 50 * 5);
}

TEST_CASE("several devices share one executor (one pool, separate memory)", "[device][executor]") {
  executor pool(2);
  host_device a(pool), b(pool);
  std::atomic<int> n{0};
  std::thread t([&] {
    for (int i = 0; i < 100; ++i) a.launch(grid{3}, [&](block_ctx&) { n++; });
  });
  for (int i = 0; i < 100; ++i) b.launch(grid{2}, [&](block_ctx&) { n++; });
  t.join();
  REQUIRE(n == 500);
  void* p = a.allocate(100);
  REQUIRE_THROWS_MATCHES(b.deallocate(p), device_error, is_error(errc::invalid_argument, "device", "deallocate"));
  a.deallocate(p);
  REQUIRE_THROWS_MATCHES(executor(0), device_error, is_error(errc::invalid_argument, "device", "at least one thread"));
}

TEST_CASE("per-worker scratch persists across launches", "[device][scratch]") {
  host_device d(1);
  void* first = nullptr;
  d.launch(grid{1}, [&](block_ctx& ctx) { first = ctx.scratch().allocate(1000); });
  void* second = nullptr;
  d.launch(grid{1}, [&](block_ctx& ctx) { second = ctx.scratch().allocate(1000); });
  REQUIRE(first == second);  // same worker, same arena, rewound
}

TEST_CASE("a launch one worker would run anyway runs on the calling thread, nested scratch intact", "[device][launch][scratch]") {
  const auto me = std::this_thread::get_id();
  auto threads_of = [&](host_device& d, std::size_t blocks) {
    std::vector<std::thread::id> ids(blocks);
    d.launch(grid{blocks}, [&](block_ctx& ctx) { ids[ctx.block_linear()] = std::this_thread::get_id(); });
    return ids;
  };
  host_device one(1), two(2);
  for (auto id : threads_of(one, 7)) CHECK(id == me);  // a 1-worker device: every block here
  CHECK(threads_of(two, 1)[0] == me);                  // a single block
  // several blocks: the calling thread takes blocks beside the pool's one worker. Blocks on the
  // worker wait (at most 10 s) until the caller has run one: a caller that only waited fails here.
  {
    std::atomic<bool> caller_ran{false};
    std::vector<std::thread::id> ids(8);
    two.launch(grid{8}, [&](block_ctx& ctx) {
      ids[ctx.block_linear()] = std::this_thread::get_id();
      if (std::this_thread::get_id() == me) {
        caller_ran = true;
        return;
      }
      const auto t0 = std::chrono::steady_clock::now();
      while (!caller_ran && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) std::this_thread::yield();
    });
    CHECK(caller_ran);
    std::vector<std::thread::id> distinct(ids);
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    CHECK(distinct.size() <= 2);  // 2 threads: the caller and one pool worker
  }
  // a nested launch's scratch lies above the enclosing block's: the outer block's bytes survive it
  for (host_device* d : {&one, &two}) {
    bool intact = false;
    d->launch(grid{1}, [&](block_ctx& ctx) {
      auto* mine = ctx.scratch().allocate_array<unsigned char>(4096);
      std::fill_n(mine, 4096, 0xA5);
      d->launch(grid{3}, [&](block_ctx& inner) { std::fill_n(inner.scratch().allocate_array<unsigned char>(8192), 8192, 0x5A); });
      intact = std::all_of(mine, mine + 4096, [](unsigned char c) { return c == 0xA5; });
    });
    CHECK(intact);
  }
  // a block's exception reaches the caller and leaves the calling thread's launches working
  REQUIRE_THROWS_WITH(one.launch(grid{4},
                                 [](block_ctx& ctx) {
                                   if (ctx.block_linear() == 2) throw std::runtime_error("block 2 failed");
                                 }),
                      "block 2 failed");
  void* a = nullptr;
  void* b = nullptr;
  one.launch(grid{1}, [&](block_ctx& ctx) { a = ctx.scratch().allocate(100); });
  one.launch(grid{1}, [&](block_ctx& ctx) { b = ctx.scratch().allocate(100); });
  CHECK(a == b);  // the calling thread's arena, rewound for each launch
}

TEST_CASE("caching pool reuses blocks, huge-page aligns big ones, counts the saving", "[device][memory]") {
  host_device d(1);
  const std::size_t big = 5u << 20;
  void* p = d.allocate(big);
  REQUIRE(reinterpret_cast<std::uintptr_t>(p) % (2u << 20) == 0);
  d.deallocate(p);
  for (int i = 0; i < 10; ++i) {
    void* q = d.allocate(big);
    REQUIRE(q == p);
    d.deallocate(q);
  }
  auto s = d.memory();
  REQUIRE(s.pool_hits == 10);
  REQUIRE(s.requested_total == 11 * big);
  REQUIRE(s.peak_reserved == 6u << 20);  // one 2 MiB-rounded block served all 11 requests
  REQUIRE(s.in_use == 0);
  void* small = d.allocate(100);
  REQUIRE(reinterpret_cast<std::uintptr_t>(small) % 64 == 0);
  d.deallocate(small);
  d.trim();
  REQUIRE(d.memory().reserved == 0);
  REQUIRE_THROWS_MATCHES(d.deallocate(reinterpret_cast<void*>(0x1000)), device_error, is_error(errc::invalid_argument, "device", "deallocate"));
  REQUIRE_THROWS_MATCHES(d.allocate_n<double>(SIZE_MAX / 4), device_error, is_error(errc::overflow, "device", "allocation"));
  REQUIRE_THROWS_MATCHES(d.copy(nullptr, small, 4), device_error, is_error(errc::invalid_argument, "device", "null pointer"));
  int x = 5, y = 0;
  d.copy(&x, &y, sizeof x);
  REQUIRE(y == 5);
}

TEST_CASE("grid size overflow is a typed error", "[device][errors]") {
  host_device d(1);
  REQUIRE_THROWS_MATCHES(d.launch(grid{SIZE_MAX, 2}, [](block_ctx&) {}), tile_error, is_error(errc::overflow, "tile", "too many blocks"));
}
}  // namespace tessel_test_device_host_device
