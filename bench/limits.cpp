// bench_limits: the machine's own limits (bench/common/limits.hpp) as Google Benchmark counters:
// peak FP32 FMA (AVX-512, AVX2), peak BF16 dot, STREAM copy/triad, on 1 and 2 threads.
// `bench_limits --tessel_write_limits[=PATH]` measures them once and writes the cache the profiler
// reads (default: tessel::profiler::limits_path(), ~/.cache/tessel/limits.json), then exits.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <tessel/device/profiler.hpp>

#include "common/limits.hpp"

namespace {
using namespace tessel_bench;

void peak(benchmark::State& state, peak_kind k, double flops_per_iter) {
  const unsigned threads = unsigned(state.range(0));
  constexpr std::uint64_t iters = 2'000'000;
  if (measure_peak(k, 1, 1) == 0.0) {
    state.SkipWithError("ISA not compiled in (build with -march=native on a machine that has it)");
    return;
  }
  double best = 0;
  for (auto _ : state) best = std::max(best, measure_peak(k, threads, iters));
  state.counters["flops"] = benchmark::Counter(flops_per_iter * double(iters) * threads * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["best_gflops"] = best;
  state.counters["of_limit"] = best / std::max(1e-9, k == peak_kind::bf16_dot ? peak_bf16_gflops(threads) : peak_fp32_gflops(threads));
}

void stream(benchmark::State& state, stream_kind k) {
  const unsigned threads = unsigned(state.range(0));
  stream_arrays::get();
  double best = 0;
  for (auto _ : state) best = std::max(best, measure_stream(k, threads));
  const double bytes = double(stream_arrays::n) * sizeof(double) * (k == stream_kind::copy ? 2 : 3);
  state.counters["bytes"] = benchmark::Counter(bytes * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["best_gbs"] = best;
  state.counters["of_limit"] = best / (k == stream_kind::copy ? stream_copy_gbs(threads) : stream_triad_gbs(threads));
}
}  // namespace

BENCHMARK_CAPTURE(peak, fp32_fma_avx512, peak_kind::fp32_fma_avx512, 16 * 16 * 2)
    ->Name("limits/fp32_fma/avx512")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(peak, fp32_fma_avx2, peak_kind::fp32_fma_avx2, 16 * 8 * 2)
    ->Name("limits/fp32_fma/avx2")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(peak, bf16_dot, peak_kind::bf16_dot, 16 * 64)
    ->Name("limits/bf16_dot/avx512bf16")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(stream, copy, stream_kind::copy)
    ->Name("limits/stream_copy/3x128MiB")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(stream, triad, stream_kind::triad)
    ->Name("limits/stream_triad/3x128MiB")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

namespace {
// Writes the measured limits to `path` in the profiler's format; returns the exit code.
int write_limits_cache(std::string path) {
  if (path.empty()) path = tessel::profiler::limits_path();
  if (path.empty()) {
    std::fprintf(stderr, "bench_limits: no cache path: set TESSEL_LIMITS or HOME, or pass --tessel_write_limits=PATH\n");
    return 2;
  }
  const auto& l = limits();
  std::vector<double> fp32, bf16, copy, triad;
  for (unsigned t = 1; t <= 2; ++t) {
    fp32.push_back(peak_fp32_gflops(t));
    bf16.push_back(l.bf16_dot[limit_index(t)]);
    copy.push_back(stream_copy_gbs(t));
    triad.push_back(stream_triad_gbs(t));
  }
  try {
    const auto dir = std::filesystem::path(path).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir);
    tessel::profiler::write_limits(path, fp32, bf16, copy, triad);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_limits: %s\n", e.what());
    return 1;
  }
  std::printf("limits written to %s: FP32 %.1f/%.1f GFLOP/s, BF16 dot %.1f/%.1f GFLOP/s, STREAM triad %.1f/%.1f GB/s (1/2 threads)\n", path.c_str(),
              fp32[0], fp32[1], bf16[0], bf16[1], triad[0], triad[1]);
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  constexpr const char* flag = "--tessel_write_limits";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], flag, std::strlen(flag)) == 0) {
      const char* rest = argv[i] + std::strlen(flag);
      if (*rest != 0 && *rest != '=') continue;
      return write_limits_cache(*rest == '=' ? rest + 1 : "");
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
