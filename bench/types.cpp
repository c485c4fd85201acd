// bench_types: bulk number conversions at 64 MiB of float, on 1 and 2 threads (the span split
// across std::threads): float -> bf16 and back, -> e4m3 saturating and back, block-scaled e4m3
// quantize/dequantize, with Eigen's .cast<Eigen::bfloat16>() as the peer. Counters: bytes (read +
// written, as a rate) and of_limit = that rate / STREAM copy on the same thread count.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <random>
#include <vector>
#include <tessel/types.hpp>

#include "common/limits.hpp"

namespace {
using namespace tessel_bench;

constexpr std::size_t n_floats = (std::size_t(64) << 20) / sizeof(float);  // 64 MiB of float
constexpr std::size_t block = tessel::default_quant_block;

struct buffers {
  huge_buffer<float> f32, f32_out, scales;
  huge_buffer<tessel::bf16> bf16;
  huge_buffer<tessel::e4m3> e4m3;
  buffers() : f32(n_floats, 2), f32_out(n_floats, 2), scales(n_floats / block, 2), bf16(n_floats, 2), e4m3(n_floats, 2) {
    std::mt19937 g(1);
    std::normal_distribution<float> nd(0.0f, 50.0f);
    for (std::size_t i = 0; i < n_floats; ++i) f32[i] = nd(g);
    tessel::convert(std::span<const float>(f32.data(), n_floats), std::span<tessel::bf16>(bf16.data(), n_floats));
    tessel::convert(std::span<const float>(f32.data(), n_floats), std::span<tessel::e4m3>(e4m3.data(), n_floats), tessel::overflow::saturate);
  }
  static buffers& get() {
    static buffers b;
    return b;
  }
};

// Times `work(lo, hi)` over [0, n_floats) split into `threads` block-aligned parts; reports bytes
// (bytes_per_elem * n per iteration, as a rate) and of_limit vs STREAM copy.
template <class Work>
void run(benchmark::State& state, double bytes_per_elem, Work work) {
  const unsigned threads = unsigned(state.range(0));
  buffers::get();
  const double copy_gbs = stream_copy_gbs(threads);  // measured before the timed loop
  double total = 0;
  for (auto _ : state) {
    const double s = run_threads(threads, [&](unsigned t) {
      const std::size_t lo = n_floats / block * t / threads * block, hi = n_floats / block * (t + 1) / threads * block;
      work(lo, hi);
    });
    state.SetIterationTime(s);
    total += s;
  }
  const double bytes = bytes_per_elem * double(n_floats);
  state.counters["bytes"] = benchmark::Counter(bytes * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["of_limit"] = bytes * double(state.iterations()) / total * 1e-9 / copy_gbs;
}

template <class T>
std::span<T> sub(const huge_buffer<T>& b, std::size_t lo, std::size_t hi) {
  return std::span<T>(b.data() + lo, hi - lo);
}
template <class T>
std::span<const T> csub(const huge_buffer<T>& b, std::size_t lo, std::size_t hi) {
  return std::span<const T>(b.data() + lo, hi - lo);
}

void tessel_f32_bf16(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 4 + 2, [&](std::size_t lo, std::size_t hi) { tessel::convert(csub(b.f32, lo, hi), sub(b.bf16, lo, hi)); });
}
void eigen_f32_bf16(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 4 + 2, [&](std::size_t lo, std::size_t hi) {
    Eigen::Map<const Eigen::ArrayXf> src(b.f32.data() + lo, Eigen::Index(hi - lo));
    Eigen::Map<Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1>> dst(reinterpret_cast<Eigen::bfloat16*>(b.bf16.data()) + lo, Eigen::Index(hi - lo));
    dst = src.cast<Eigen::bfloat16>();
  });
}
void tessel_bf16_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 2 + 4, [&](std::size_t lo, std::size_t hi) { tessel::convert(csub(b.bf16, lo, hi), sub(b.f32_out, lo, hi)); });
}
void eigen_bf16_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 2 + 4, [&](std::size_t lo, std::size_t hi) {
    Eigen::Map<const Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1>> src(reinterpret_cast<const Eigen::bfloat16*>(b.bf16.data()) + lo,
                                                                           Eigen::Index(hi - lo));
    Eigen::Map<Eigen::ArrayXf> dst(b.f32_out.data() + lo, Eigen::Index(hi - lo));
    dst = src.cast<float>();
  });
}
void tessel_f32_e4m3_sat(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 4 + 1, [&](std::size_t lo, std::size_t hi) { tessel::convert(csub(b.f32, lo, hi), sub(b.e4m3, lo, hi), tessel::overflow::saturate); });
}
void tessel_e4m3_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 1 + 4, [&](std::size_t lo, std::size_t hi) { tessel::convert(csub(b.e4m3, lo, hi), sub(b.f32_out, lo, hi)); });
}
void tessel_quant_e4m3_block(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 4 + 1 + 4.0 / block, [&](std::size_t lo, std::size_t hi) {
    tessel::quantize_blocks(csub(b.f32, lo, hi), sub(b.e4m3, lo, hi), sub(b.scales, lo / block, hi / block), block);
  });
}
void tessel_dequant_e4m3_block(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 1 + 4 + 4.0 / block, [&](std::size_t lo, std::size_t hi) {
    tessel::dequantize_blocks(csub(b.e4m3, lo, hi), csub(b.scales, lo / block, hi / block), sub(b.f32_out, lo, hi), block);
  });
}

// In-cache (256 KiB of float, one thread): the kernels' own speed, where memory does not hide it.
template <bool Eigen_, bool ToBf16>
void in_cache(benchmark::State& state) {
  constexpr std::size_t n = (std::size_t(256) << 10) / sizeof(float);
  std::vector<float> f(n), back(n);
  std::vector<tessel::bf16> h(n);
  for (std::size_t i = 0; i < n; ++i) f[i] = float(int(i % 2001) - 1000) * 0.37f;
  tessel::convert(std::span<const float>(f), std::span<tessel::bf16>(h));
  Eigen::Map<Eigen::ArrayXf> ef(f.data(), Eigen::Index(n)), eb(back.data(), Eigen::Index(n));
  Eigen::Map<Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1>> eh(reinterpret_cast<Eigen::bfloat16*>(h.data()), Eigen::Index(n));
  for (auto _ : state) {
    if constexpr (Eigen_ && ToBf16) eh = ef.cast<Eigen::bfloat16>();
    if constexpr (Eigen_ && !ToBf16) eb = eh.cast<float>();
    if constexpr (!Eigen_ && ToBf16) tessel::convert(std::span<const float>(f), std::span<tessel::bf16>(h));
    if constexpr (!Eigen_ && !ToBf16) tessel::convert(std::span<const tessel::bf16>(h), std::span<float>(back));
    benchmark::ClobberMemory();
  }
  state.counters["bytes"] = benchmark::Counter(6.0 * double(n) * double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK_TEMPLATE(in_cache, false, true)->Name("convert/tessel/f32_bf16/256KiB/threads:1");
BENCHMARK_TEMPLATE(in_cache, true, true)->Name("convert/eigen/f32_bf16/256KiB/threads:1");
BENCHMARK_TEMPLATE(in_cache, false, false)->Name("convert/tessel/bf16_f32/256KiB/threads:1");
BENCHMARK_TEMPLATE(in_cache, true, false)->Name("convert/eigen/bf16_f32/256KiB/threads:1");

#define TESSEL_TYPES_BENCH(fn, name) BENCHMARK(fn)->Name(name)->ArgName("threads")->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond)
TESSEL_TYPES_BENCH(tessel_f32_bf16, "convert/tessel/f32_bf16/64MiB");
TESSEL_TYPES_BENCH(eigen_f32_bf16, "convert/eigen/f32_bf16/64MiB");
TESSEL_TYPES_BENCH(tessel_bf16_f32, "convert/tessel/bf16_f32/64MiB");
TESSEL_TYPES_BENCH(eigen_bf16_f32, "convert/eigen/bf16_f32/64MiB");
TESSEL_TYPES_BENCH(tessel_f32_e4m3_sat, "convert/tessel/f32_e4m3_saturate/64MiB");
TESSEL_TYPES_BENCH(tessel_e4m3_f32, "convert/tessel/e4m3_f32/64MiB");
TESSEL_TYPES_BENCH(tessel_quant_e4m3_block, "quantize/tessel/f32_e4m3_block128/64MiB");
TESSEL_TYPES_BENCH(tessel_dequant_e4m3_block, "dequantize/tessel/e4m3_f32_block128/64MiB");
}  // namespace

BENCHMARK_MAIN();
