// bench_limits: the machine's own limits (bench/common/limits.hpp) as Google Benchmark counters:
// peak FP32 FMA (AVX-512, AVX2), peak BF16 dot, STREAM copy/triad, on 1 and 2 threads.
#include <benchmark/benchmark.h>

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
  state.counters["flops"] = benchmark::Counter(flops_per_iter * double(iters) * threads * double(state.iterations()),
                                               benchmark::Counter::kIsRate);
  state.counters["best_gflops"] = best;
  state.counters["of_limit"] = best / std::max(1e-9, k == peak_kind::bf16_dot ? peak_bf16_gflops(threads)
                                                                                : peak_fp32_gflops(threads));
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
    ->Name("limits/fp32_fma/avx512")->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(peak, fp32_fma_avx2, peak_kind::fp32_fma_avx2, 16 * 8 * 2)
    ->Name("limits/fp32_fma/avx2")->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(peak, bf16_dot, peak_kind::bf16_dot, 16 * 64)
    ->Name("limits/bf16_dot/avx512bf16")->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(stream, copy, stream_kind::copy)
    ->Name("limits/stream_copy/3x128MiB")->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(stream, triad, stream_kind::triad)
    ->Name("limits/stream_triad/3x128MiB")->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
