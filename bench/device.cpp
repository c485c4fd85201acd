// host_device launch overhead: an empty tile program on a grid of one block per worker, so every
// worker wakes, runs and reports back (target: under 5 us on 2 workers).
#include <benchmark/benchmark.h>

#include <tessel/device.hpp>

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
}  // namespace

BENCHMARK(launch_empty)->Name("launch/tessel/empty")->ArgsProduct({{1, 2}, {1, 2, 64}})->ArgNames({"workers", "blocks"})->UseRealTime();
BENCHMARK(pool_alloc)->Name("alloc/tessel/64MiB")->UseRealTime();

BENCHMARK_MAIN();
