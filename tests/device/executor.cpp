// The executor (shared worker pool): every block of every grid (0, 1, primes, 3-D) runs exactly
// once, on a worker id < size(), with that worker's own arena rewound per block; the calling
// thread is participant size() - 1 and runs blocks of its own launch; the first exception a block
// throws reaches run() with its type and message, and the pool still works; nested runs execute
// inline on the calling worker without clobbering its scratch, also a run into another executor
// from the calling thread's block; runs from many threads at once each complete exactly; sleeping
// workers wake; bad thread counts are errors.
// Workers only count (Catch2 assertions are not thread-safe); the test thread checks.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <tessel/device/executor.hpp>

namespace tessel_test_device_executor {

using namespace tessel;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {
struct custom_error : std::runtime_error {
  int block;
  explicit custom_error(int b) : std::runtime_error("block " + std::to_string(b) + " failed"), block(b) {}
};

const grid grids[] = {grid{0}, grid{1}, grid{2}, grid{7}, grid{3, 5}, grid{2, 3, 4}, grid{13, 1, 7}, grid{0, 4}, grid{97}, grid{1, 1, 31}};
}  // namespace

TEST_CASE("executor: every block runs exactly once, on a valid worker, for every grid and pool size", "[device][executor]") {
  for (unsigned threads : {1u, 2u, 3u}) {
    executor ex(threads);
    REQUIRE(ex.size() == threads);
    for (const grid& g : grids) {
      std::vector<std::atomic<int>> hits(g.size());
      std::atomic<int> bad{0};
      ex.run(g, [&](block_ctx& ctx) {
        if (ctx.worker_id() >= threads || ctx.num_workers() != threads || !(ctx.dims() == g)) ++bad;
        if (ctx.block_index3() != g.index_of(ctx.block_linear())) ++bad;
        ++hits[ctx.block_linear()];
      });
      REQUIRE(bad == 0);
      for (auto& h : hits) REQUIRE(h == 1);
    }
  }
}

TEST_CASE("executor: each worker keeps one arena, rewound for every block", "[device][executor][scratch]") {
  executor ex(2, 200us, 1 << 16);
  REQUIRE(ex.scratch_bytes() >= (1 << 16));
  std::vector<std::atomic<scratch_arena*>> arena_of(2);
  std::vector<std::atomic<char*>> first_of(2);
  std::atomic<int> bad{0};
  for (int launch = 0; launch < 20; ++launch) {
    ex.run(grid{40}, [&](block_ctx& ctx) {
      scratch_arena* mine = &ctx.scratch();
      scratch_arena* expected = nullptr;
      if (!arena_of[ctx.worker_id()].compare_exchange_strong(expected, mine) && expected != mine) ++bad;  // same worker, same arena
      // every block starts from a rewound arena: its first allocation is at the same address
      char* p = ctx.scratch().allocate_array<char>(1000);
      char* first = nullptr;
      if (!first_of[ctx.worker_id()].compare_exchange_strong(first, p) && first != p) ++bad;
      std::memset(p, int(ctx.block_linear()), 1000);
    });
  }
  REQUIRE(bad == 0);
  REQUIRE(arena_of[0].load() != arena_of[1].load());
}

TEST_CASE("executor: the calling thread runs blocks of its own launch as the last participant", "[device][executor]") {
  const auto me = std::this_thread::get_id();
  {  // one participant: no pool thread, every block on the caller
    executor ex(1);
    std::atomic<int> bad{0};
    ex.run(grid{9}, [&](block_ctx& ctx) {
      if (std::this_thread::get_id() != me || ctx.worker_id() != 0 || ctx.num_workers() != 1) ++bad;
    });
    REQUIRE(bad == 0);
  }
  executor ex(3);
  for (int trial = 0; trial < 5; ++trial) {
    // blocks on pool workers wait (at most 10 s) until the caller has run one of them
    std::atomic<bool> caller_ran{false};
    std::atomic<int> bad{0};
    ex.run(grid{12}, [&](block_ctx& ctx) {
      const bool mine = std::this_thread::get_id() == me;
      if (mine != (ctx.worker_id() == 2)) ++bad;  // the caller, and only it, is participant size() - 1
      if (mine) {
        caller_ran = true;
        return;
      }
      const auto t0 = std::chrono::steady_clock::now();
      while (!caller_ran && std::chrono::steady_clock::now() - t0 < 10s) std::this_thread::yield();
    });
    REQUIRE(caller_ran);
    REQUIRE(bad == 0);
  }
  // a block on the caller that runs another executor: that run's scratch lies above the block's
  executor other(1);
  std::atomic<int> bad{0}, inner{0};
  ex.run(grid{6}, [&](block_ctx& outer) {
    unsigned char* mine = outer.scratch().allocate_array<unsigned char>(4096);
    std::memset(mine, 0xA5, 4096);
    other.run(grid{3}, [&](block_ctx& ctx) {
      std::memset(ctx.scratch().allocate_array<unsigned char>(8192), 0x5A, 8192);
      ++inner;
    });
    for (int i = 0; i < 4096; ++i)
      if (mine[i] != 0xA5) ++bad;
  });
  REQUIRE(bad == 0);
  REQUIRE(inner == 18);
}

TEST_CASE("executor: the first exception reaches run() with its type and text, and the pool keeps working", "[device][executor][errors]") {
  executor ex(2);
  for (int trial = 0; trial < 20; ++trial) {
    const int fail_at = trial * 5;
    std::atomic<int> ran{0};
    bool caught = false;
    try {
      ex.run(grid{100}, [&](block_ctx& ctx) {
        ++ran;
        if (int(ctx.block_linear()) == fail_at) throw custom_error(fail_at);
      });
    } catch (const custom_error& e) {
      caught = true;
      REQUIRE(e.block == fail_at);
      REQUIRE(std::string(e.what()) == "block " + std::to_string(fail_at) + " failed");
    }
    REQUIRE(caught);
    REQUIRE(ran <= 100);
    std::atomic<int> n{0};
    ex.run(grid{10}, [&](block_ctx&) { ++n; });
    REQUIRE(n == 10);
  }
  // several blocks throwing: one of their exceptions comes out
  REQUIRE_THROWS_WITH(ex.run(grid{64},
                             [](block_ctx& ctx) {
                               if (ctx.block_linear() % 2) throw std::runtime_error("odd block");
                             }),
                      "odd block");
}

TEST_CASE("executor: nested runs execute inline on the calling worker and keep its scratch", "[device][executor]") {
  executor ex(2);
  std::atomic<int> inner_total{0}, bad{0};
  ex.run(grid{6}, [&](block_ctx& outer) {
    int* mine = outer.scratch().allocate_array<int>(64);
    for (int i = 0; i < 64; ++i) mine[i] = int(outer.block_linear());
    std::atomic<int> inner{0};
    ex.run(grid{5}, [&](block_ctx& ctx) {
      if (ctx.worker_id() != outer.worker_id()) ++bad;  // inline: the same worker
      if (&ctx.scratch() != &outer.scratch()) ++bad;
      float* f = ctx.scratch().allocate_array<float>(256);  // after the outer block's data
      for (int i = 0; i < 256; ++i) f[i] = -1.0f;
      ++inner;
    });
    if (inner != 5) ++bad;  // all inner blocks done when the nested run returns
    for (int i = 0; i < 64; ++i)
      if (mine[i] != int(outer.block_linear())) ++bad;
    inner_total += inner;
  });
  REQUIRE(bad == 0);
  REQUIRE(inner_total == 30);
  // an exception in a nested run propagates through the outer block to the caller
  REQUIRE_THROWS_WITH(ex.run(grid{3},
                             [&](block_ctx&) {
                               ex.run(grid{2}, [](block_ctx& c) {
                                 if (c.block_linear() == 1) throw std::invalid_argument("nested failure");
                               });
                             }),
                      Contains("nested failure"));
}

TEST_CASE("executor: runs from many threads at once, and into another executor from a worker", "[device][executor]") {
  executor ex(2), other(1);
  constexpr int T = 4, L = 25;
  std::vector<std::atomic<int>> per_thread(T);
  std::vector<std::thread> ts;
  for (int t = 0; t < T; ++t)
    ts.emplace_back([&, t] {
      for (int l = 0; l < L; ++l) {
        const grid g{std::size_t(1 + (t + l) % 9)};
        std::atomic<int> n{0};
        ex.run(g, [&](block_ctx&) { ++n; });
        if (n == int(g.size())) ++per_thread[t];  // each run complete when it returns
      }
    });
  for (auto& t : ts) t.join();
  for (auto& c : per_thread) REQUIRE(c == L);
  std::atomic<int> n{0};
  ex.run(grid{4}, [&](block_ctx&) { other.run(grid{3}, [&](block_ctx&) { ++n; }); });
  REQUIRE(n == 12);
}

TEST_CASE("executor: workers that went to sleep wake for new work (spin 0 and after idling)", "[device][executor]") {
  executor sleepy(2, 0us);
  for (int i = 0; i < 50; ++i) {
    std::atomic<int> n{0};
    sleepy.run(grid{3}, [&](block_ctx&) { ++n; });
    REQUIRE(n == 3);
  }
  executor ex(2, 50us);
  std::this_thread::sleep_for(5ms);  // past the spin: workers block
  std::atomic<int> n{0};
  ex.run(grid{8}, [&](block_ctx&) { ++n; });
  REQUIRE(n == 8);
}

TEST_CASE("executor: thread counts outside [1, 4096] are errors", "[device][executor][errors]") {
  REQUIRE_THROWS_WITH(executor(0), Contains("at least one thread"));
  REQUIRE_THROWS_WITH(executor(4097), Contains("4097"));
  REQUIRE_THROWS_AS(executor(0), std::exception);
}
}  // namespace tessel_test_device_executor
