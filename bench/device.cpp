// host_device launch overhead: an empty tile program on a grid of one block per worker, so every
// worker wakes, runs and reports back (target: under 5 us on 2 workers). The profiler's cost: the
// same tiny launch through the executor directly (no hooks), through host_device with the
// profiler off (its hook: one relaxed load and a branch) and on, timed apart and paired. The
// memory planner's cost over n tensors.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <vector>

#include <tessel/device.hpp>

#include "common/paired.hpp"

namespace {
void launch_empty(benchmark::State& st) {
  const unsigned workers = static_cast<unsigned>(st.range(0));
  const std::size_t blocks = static_cast<std::size_t>(st.range(1));
  tessel::host_device d(workers);
  for (auto _ : st) d.launch(tessel::grid{blocks}, [](tessel::block_ctx&) {});
  st.counters["launches"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
}
// Memory: allocate/free a 64 MiB buffer through the caching pool (a hit after the first time).
void pool_alloc(benchmark::State& st) {
  tessel::host_device d(1);
  const std::size_t bytes = std::size_t(64) << 20;
  for (auto _ : st) {
    void* p = d.allocate(bytes);
    benchmark::DoNotOptimize(p);
    d.deallocate(p);
  }
  const auto m = d.memory();
  st.counters["requested_MiB"] = double(m.requested_total) / (1 << 20);
  st.counters["peak_reserved_MiB"] = double(m.peak_reserved) / (1 << 20);
}

// A tiny costed program: one add per block, so the launch itself is what is timed.
struct tiny_program {
  std::atomic<std::size_t>* sink;
  static constexpr const char* name = "bench::tiny";
  void operator()(tessel::block_ctx& ctx) const { sink->fetch_add(ctx.block_linear(), std::memory_order_relaxed); }
  tessel::kernel_cost cost(const tessel::grid& g) const { return {double(g.size()), 8.0 * double(g.size()), tessel::math_precision::f32}; }
};
enum class hooks { none, off, on };
// Records are kept in memory; the session restarts every this many launches so memory stays flat.
constexpr std::size_t on_batch = std::size_t{1} << 16;

void launch_tiny(benchmark::State& st, hooks h) {
  const unsigned workers = static_cast<unsigned>(st.range(0));
  tessel::host_device d(workers);
  std::atomic<std::size_t> sink{0};
  const tessel::grid g{workers};
  const tiny_program p{&sink};
  std::size_t n = 0;
  if (h == hooks::on) tessel::profiler::start();
  for (auto _ : st) {
    if (h == hooks::none)
      d.exec().run(g, p);
    else
      d.launch(g, p);
    if (h == hooks::on && ++n % on_batch == 0) {
      st.PauseTiming();
      tessel::profiler::stop();
      tessel::profiler::start();
      st.ResumeTiming();
    }
  }
  if (h == hooks::on) tessel::profiler::stop();
  st.counters["launches"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
}

// The three alternated in one timed loop (batches of `batch` launches, the order rotating), so the
// machine's drift falls on all alike: off_vs_none and on_vs_none are time ratios (1 = no cost).
// "on" starts and stops an in-memory session around each batch, which it pays for.
void launch_tiny_paired(benchmark::State& st) {
  const unsigned workers = static_cast<unsigned>(st.range(0));
  constexpr int batch = 1024;
  tessel::host_device d(workers);
  std::atomic<std::size_t> sink{0};
  const tessel::grid g{workers};
  const tiny_program p{&sink};
  std::vector<std::function<void()>> calls = {
      [&] {
        for (int i = 0; i < batch; ++i) d.exec().run(g, p);
      },
      [&] {
        for (int i = 0; i < batch; ++i) d.launch(g, p);
      },
      [&] {
        tessel::profiler::start();
        for (int i = 0; i < batch; ++i) d.launch(g, p);
        tessel::profiler::stop();
      },
  };
  tessel_bench::rotated_totals r;
  for (auto _ : st)
    r = tessel_bench::run_rotated(
        calls, std::chrono::microseconds(0), [](std::size_t it, auto&, double wall) { return it < 30 || wall < 1.0; }, [](std::size_t, double) {});
  st.counters["off_vs_none"] = r.seconds[1] / r.seconds[0];
  st.counters["on_vs_none"] = r.seconds[2] / r.seconds[0];
  st.counters["off_vs_none_fastest"] = r.fastest[1] / r.fastest[0];
  st.counters["on_vs_none_fastest"] = r.fastest[2] / r.fastest[0];
  st.counters["us_per_launch_none"] = r.seconds[0] / double(r.iterations * batch) * 1e6;
}

// The same tiny launch made from inside a worker, where the executor runs it inline (no wake-up,
// tens of ns): here a hook's cost would not hide behind the microseconds of waking the pool.
// Each iteration is one outer launch whose block makes `inline_launches` tiny launches.
constexpr int inline_launches = 4096;
template <class Launch>
void inline_batch(tessel::host_device& d, Launch&& launch) {
  d.exec().run(tessel::grid{1}, [&](tessel::block_ctx&) {
    for (int i = 0; i < inline_launches; ++i) launch();
  });
}

void launch_tiny_inline(benchmark::State& st, hooks h) {
  tessel::host_device d(1);
  std::atomic<std::size_t> sink{0};
  const tessel::grid g{1};
  const tiny_program p{&sink};
  for (auto _ : st) {
    if (h == hooks::none) {
      inline_batch(d, [&] { d.exec().run(g, p); });
    } else if (h == hooks::off) {
      inline_batch(d, [&] { d.launch(g, p); });
    } else {
      st.PauseTiming();
      tessel::profiler::start();
      st.ResumeTiming();
      inline_batch(d, [&] { d.launch(g, p); });
      st.PauseTiming();
      tessel::profiler::stop();
      st.ResumeTiming();
    }
  }
  st.counters["ns_per_launch"] =
      benchmark::Counter(double(inline_launches) * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// none, off and on alternated (rotating order) inside one worker block, each batch timed on its
// own, so no pool wake-up falls into the comparison: the ratios of their totals and fastest batches.
void launch_tiny_inline_paired(benchmark::State& st) {
  tessel::host_device d(1);
  std::atomic<std::size_t> sink{0};
  const tessel::grid g{1};
  const tiny_program p{&sink};
  std::vector<std::function<void()>> calls = {
      [&] {
        for (int i = 0; i < inline_launches; ++i) d.exec().run(g, p);
      },
      [&] {
        for (int i = 0; i < inline_launches; ++i) d.launch(g, p);
      },
      [&] {
        tessel::profiler::start();
        for (int i = 0; i < inline_launches; ++i) d.launch(g, p);
        tessel::profiler::stop();
      },
  };
  tessel_bench::rotated_totals r;
  for (auto _ : st)
    d.exec().run(tessel::grid{1}, [&](tessel::block_ctx&) {
      r = tessel_bench::run_rotated(
          calls, std::chrono::microseconds(0), [](std::size_t it, auto&, double wall) { return it < 200 || wall < 1.0; }, [](std::size_t, double) {});
    });
  const double n = double(r.iterations) * inline_launches;
  st.counters["off_vs_none"] = r.seconds[1] / r.seconds[0];
  st.counters["on_vs_none"] = r.seconds[2] / r.seconds[0];
  st.counters["off_vs_none_fastest"] = r.fastest[1] / r.fastest[0];
  st.counters["on_vs_none_fastest"] = r.fastest[2] / r.fastest[0];
  st.counters["ns_none"] = r.seconds[0] / n * 1e9;
  st.counters["ns_off"] = r.seconds[1] / n * 1e9;
  st.counters["ns_on"] = r.seconds[2] / n * 1e9;
}

// plan_memory over n tensors: `short` lifetimes of 1-6 ops at random sizes up to 1 MB (a graph's
// inference), or a `training` pattern where every forward tensor is saved until its mirror in
// backward (nested lifetimes) beside short-lived gradients, sizes from a few layer shapes.
std::vector<tessel::tensor_life> plan_workload(std::size_t n, bool training) {
  std::mt19937_64 rng(n);
  std::vector<tessel::tensor_life> t(n);
  const std::size_t shapes[] = {std::size_t{4} << 20, std::size_t{1} << 20, std::size_t{11} << 20, std::size_t{32} << 20};
  for (std::size_t i = 0; i < n; ++i) {
    t[i].first = i;
    if (!training) {
      t[i].bytes = 1 + rng() % 1000000;
      t[i].last = i + rng() % 6;
    } else {
      t[i].bytes = shapes[(i / 3) % 4];
      t[i].last = i < n / 2 && i % 3 != 2 ? n - 1 - i : i + 1;  // saved, or a gradient used once
    }
  }
  return t;
}

void memory_plan_bench(benchmark::State& st, bool training) {
  const auto t = plan_workload(static_cast<std::size_t>(st.range(0)), training);
  tessel::memory_plan p;
  for (auto _ : st) {
    p = tessel::plan_memory(t);
    benchmark::DoNotOptimize(p.arena_bytes);
  }
  st.counters["tensors"] = benchmark::Counter(double(t.size()), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["vs_lower_bound"] = p.vs_lower_bound();
  st.counters["vs_unplanned"] = p.vs_unplanned();
}
}  // namespace

BENCHMARK_CAPTURE(memory_plan_bench, short, false)
    ->Name("memory_plan/tessel/short")
    ->ArgName("tensors")
    ->RangeMultiplier(10)
    ->Range(1000, 100000)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(memory_plan_bench, training, true)
    ->Name("memory_plan/tessel/training")
    ->ArgName("tensors")
    ->RangeMultiplier(10)
    ->Range(1000, 100000)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(launch_tiny_inline, none, hooks::none)->Name("launch/tessel/tiny_inline/profiler_hooks:none")->UseRealTime();
BENCHMARK_CAPTURE(launch_tiny_inline, off, hooks::off)->Name("launch/tessel/tiny_inline/profiler:off")->UseRealTime();
BENCHMARK_CAPTURE(launch_tiny_inline, on, hooks::on)->Name("launch/tessel/tiny_inline/profiler:on")->UseRealTime();
BENCHMARK(launch_tiny_inline_paired)->Name("launch/tessel/tiny_inline/profiler_paired")->Iterations(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(launch_tiny, none, hooks::none)->Name("launch/tessel/tiny/profiler_hooks:none")->ArgName("workers")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK_CAPTURE(launch_tiny, off, hooks::off)->Name("launch/tessel/tiny/profiler:off")->ArgName("workers")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK_CAPTURE(launch_tiny, on, hooks::on)->Name("launch/tessel/tiny/profiler:on")->ArgName("workers")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(launch_tiny_paired)
    ->Name("launch/tessel/tiny/profiler_paired")
    ->ArgName("workers")
    ->Arg(1)
    ->Arg(2)
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(launch_empty)->Name("launch/tessel/empty")->ArgsProduct({{1, 2}, {1, 2, 64}})->ArgNames({"workers", "blocks"})->UseRealTime();
BENCHMARK(pool_alloc)->Name("alloc/tessel/64MiB")->UseRealTime();

BENCHMARK_MAIN();
