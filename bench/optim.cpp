// bench_optim: fused optimizer steps over 64 Mi parameters (far above the cache) on 1 and 2 threads,
// with a straightforward Eigen-expression AdamW as the peer in the same run.
//
// Bytes each step must move (per parameter; every stream read once and written once):
//   adamw bf16_master (bf16 grad): read g 2 + master 4 + m 4 + v 4, write bf16 p 2 + master 4 + m 4 + v 4 = 28 B
//   adamw f32 (f32 grad):          read g 4 + p 4 + m 4 + v 4,      write p 4 + m 4 + v 4               = 28 B
//   adamw bf16_master + clip:      28 B + 2 B (the gradient pre-pass for the global norm / inf check) = 30 B
//   adamw bf16_master + stochastic rounding of the bf16 copy: 28 B
//   adamw bf16_remainder:          read g 2 + p 2 + rem 2 + m 4 + v 4, write p 2 + rem 2 + m 4 + v 4 = 26 B
//   lion f32:                      read g 4 + p 4 + m 4, write p 4 + m 4                                = 20 B
// Counters: bytes (rate) and of_limit = bytes rate / STREAM triad on the same thread count
// (bench/common/limits.hpp). Run with --benchmark_repetitions=3 for min/median.
#include <benchmark/benchmark.h>

// tessel first: arch/target.hpp must be the first to include the intrinsic headers (GCC 12 warning).
#include <tessel/device/host_device.hpp>
#include <tessel/ops/optim.hpp>

#include <Eigen/Core>
#include <chrono>
#include <random>

#include "common/limits.hpp"

namespace {
using namespace tessel_bench;
using tessel::bf16;

constexpr std::size_t n_params = std::size_t(64) << 20;
constexpr unsigned n_tensors = 8;  // multi-tensor apply: one launch over 8 tensors of mixed sizes

struct buffers {
  huge_buffer<std::uint16_t> p, g16;
  huge_buffer<float> master, m, v, g32;
  buffers() : p(n_params, 2), g16(n_params, 2), master(n_params, 2), m(n_params, 2), v(n_params, 2), g32(n_params, 2) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t i = 0; i < n_params; i += 97) {  // sparse fill: values matter little, speed of setup does
      master[i] = nd(rng);
      g32[i] = nd(rng) * 1e-2f;
      g16[i] = bf16(g32[i]).bits();
    }
  }
  static buffers& get() {
    static buffers b;
    return b;
  }
  // Tensor k of n_tensors: sizes grow geometrically-ish but sum to n_params.
  static std::pair<std::size_t, std::size_t> range(unsigned k) {
    static const std::vector<std::size_t> cuts = [] {
      std::vector<double> w(n_tensors);
      double s = 0;
      for (unsigned i = 0; i < n_tensors; ++i) s += (w[i] = 1.0 + i);
      std::vector<std::size_t> c(n_tensors + 1, 0);
      double acc = 0;
      for (unsigned i = 0; i < n_tensors; ++i) {
        acc += w[i];
        c[i + 1] = i + 1 == n_tensors ? n_params : std::size_t(double(n_params) * acc / s) / 64 * 64 + 13 * i;
      }
      return c;
    }();
    return {cuts[k], cuts[k + 1]};
  }
};

tessel::host_device& device(unsigned threads) {
  static tessel::host_device d1(1), d2(2);
  return threads >= 2 ? d2 : d1;
}

void report(benchmark::State& state, double bytes_per_param, double seconds, unsigned threads) {
  const double bytes = bytes_per_param * double(n_params) * double(state.iterations());
  state.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kIsRate);
  state.counters["of_limit"] = bytes / seconds * 1e-9 / stream_triad_gbs(threads);
}

template <class F>
double timed(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void adamw_tessel_bf16_master(benchmark::State& state) {
  const unsigned threads = unsigned(state.range(0));
  const bool clip = state.range(1) == 1, sr = state.range(1) == 2;
  auto& b = buffers::get();
  (void)stream_triad_gbs(threads);
  auto& dev = device(threads);
  std::vector<tessel::optim_tensor<float, bf16>> ts(n_tensors);
  for (unsigned k = 0; k < n_tensors; ++k) {
    auto [lo, hi] = buffers::range(k);
    const std::size_t n = hi - lo;
    ts[k].param_bf16 = std::span<bf16>(reinterpret_cast<bf16*>(b.p.data() + lo), n);
    ts[k].master = std::span<float>(b.master.data() + lo, n);
    ts[k].grad = std::span<const bf16>(reinterpret_cast<const bf16*>(b.g16.data() + lo), n);
    ts[k].m = std::span<float>(b.m.data() + lo, n);
    ts[k].v = std::span<float>(b.v.data() + lo, n);
  }
  tessel::step_options o;
  o.storage = tessel::param_storage::bf16_master;
  o.check_finite = clip;
  o.max_grad_norm = clip ? 1.0f : 0.0f;
  if (sr) o.round = tessel::rounding::stochastic;
  tessel::adamw_params h;
  std::uint64_t step = 1;
  double total = 0;
  for (auto _ : state) {
    const double s = timed([&] { tessel::adamw_step(dev, std::span<const tessel::optim_tensor<float, bf16>>(ts), h, step++, o); });
    state.SetIterationTime(s);
    total += s;
  }
  report(state, clip ? 30 : 28, total, threads);
}

void adamw_tessel_bf16_remainder(benchmark::State& state) {
  const unsigned threads = unsigned(state.range(0));
  auto& b = buffers::get();
  (void)stream_triad_gbs(threads);
  auto& dev = device(threads);
  // the remainder half of each master lives in the low half-words of the g32 buffer (unused here)
  auto* rem = reinterpret_cast<std::uint16_t*>(b.g32.data());
  std::vector<tessel::optim_tensor<float, bf16>> ts(n_tensors);
  for (unsigned k = 0; k < n_tensors; ++k) {
    auto [lo, hi] = buffers::range(k);
    const std::size_t n = hi - lo;
    ts[k].param_bf16 = std::span<bf16>(reinterpret_cast<bf16*>(b.p.data() + lo), n);
    ts[k].remainder = std::span<std::uint16_t>(rem + lo, n);
    ts[k].grad = std::span<const bf16>(reinterpret_cast<const bf16*>(b.g16.data() + lo), n);
    ts[k].m = std::span<float>(b.m.data() + lo, n);
    ts[k].v = std::span<float>(b.v.data() + lo, n);
  }
  tessel::step_options o;
  o.storage = tessel::param_storage::bf16_remainder;
  o.check_finite = false;
  tessel::adamw_params h;
  std::uint64_t step = 1;
  double total = 0;
  for (auto _ : state) {
    const double s = timed([&] { tessel::adamw_step(dev, std::span<const tessel::optim_tensor<float, bf16>>(ts), h, step++, o); });
    state.SetIterationTime(s);
    total += s;
  }
  report(state, 26, total, threads);
}

void adamw_tessel_f32(benchmark::State& state) {
  const unsigned threads = unsigned(state.range(0));
  auto& b = buffers::get();
  (void)stream_triad_gbs(threads);
  auto& dev = device(threads);
  std::vector<tessel::optim_tensor<float, float>> ts(n_tensors);
  for (unsigned k = 0; k < n_tensors; ++k) {
    auto [lo, hi] = buffers::range(k);
    const std::size_t n = hi - lo;
    ts[k].param = std::span<float>(b.master.data() + lo, n);
    ts[k].grad = std::span<const float>(b.g32.data() + lo, n);
    ts[k].m = std::span<float>(b.m.data() + lo, n);
    ts[k].v = std::span<float>(b.v.data() + lo, n);
  }
  tessel::step_options o;
  o.check_finite = false;
  tessel::adamw_params h;
  std::uint64_t step = 1;
  double total = 0;
  for (auto _ : state) {
    const double s = timed([&] { tessel::adamw_step(dev, std::span<const tessel::optim_tensor<float, float>>(ts), h, step++, o); });
    state.SetIterationTime(s);
    total += s;
  }
  report(state, 28, total, threads);
}

void lion_tessel_f32(benchmark::State& state) {
  const unsigned threads = unsigned(state.range(0));
  auto& b = buffers::get();
  (void)stream_triad_gbs(threads);
  auto& dev = device(threads);
  std::vector<tessel::optim_tensor<float, float>> ts(n_tensors);
  for (unsigned k = 0; k < n_tensors; ++k) {
    auto [lo, hi] = buffers::range(k);
    const std::size_t n = hi - lo;
    ts[k].param = std::span<float>(b.master.data() + lo, n);
    ts[k].grad = std::span<const float>(b.g32.data() + lo, n);
    ts[k].m = std::span<float>(b.m.data() + lo, n);
  }
  tessel::step_options o;
  o.check_finite = false;
  tessel::lion_params h;
  double total = 0;
  for (auto _ : state) {
    const double s = timed([&] { tessel::lion_step(dev, std::span<const tessel::optim_tensor<float, float>>(ts), h, 1, o); });
    state.SetIterationTime(s);
    total += s;
  }
  report(state, 20, total, threads);
}

// The same AdamW update (bf16 grads and params, f32 master and moments) as Eigen array expressions,
// one expression per state array, the parameter range split across std::threads.
void adamw_eigen_bf16_master(benchmark::State& state) {
  const unsigned threads = unsigned(state.range(0));
  auto& b = buffers::get();
  (void)stream_triad_gbs(threads);
  tessel::adamw_params h;
  std::uint64_t step = 1;
  double total = 0;
  for (auto _ : state) {
    const auto r = tessel::make_adamw_rule(h, step++);
    const double s = run_threads(threads, [&](unsigned t) {
      const std::size_t lo = n_params * t / threads, hi = n_params * (t + 1) / threads;
      const Eigen::Index n = Eigen::Index(hi - lo);
      using bfarr = Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1>;
      Eigen::Map<const bfarr> g(reinterpret_cast<const Eigen::bfloat16*>(b.g16.data() + lo), n);
      Eigen::Map<bfarr> p(reinterpret_cast<Eigen::bfloat16*>(b.p.data() + lo), n);
      Eigen::Map<Eigen::ArrayXf> w(b.master.data() + lo, n), m(b.m.data() + lo, n), v(b.v.data() + lo, n);
      m = r.b1 * m + r.omb1 * g.cast<float>();
      v = r.b2 * v + r.omb2 * g.cast<float>().square();
      w = w * r.decay + r.neg_step * m / (v.sqrt() * r.inv_sqrt_bc2 + r.eps);
      p = w.cast<Eigen::bfloat16>();
    });
    state.SetIterationTime(s);
    total += s;
  }
  report(state, 28, total, threads);
}

}  // namespace

BENCHMARK(adamw_tessel_bf16_master)
    ->Name("adamw/tessel/bf16_master/64M")
    ->ArgsProduct({{1, 2}, {0}})
    ->ArgNames({"threads", "mode"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(adamw_tessel_bf16_master)
    ->Name("adamw/tessel/bf16_master_clip/64M")
    ->ArgsProduct({{1, 2}, {1}})
    ->ArgNames({"threads", "mode"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(adamw_tessel_bf16_master)
    ->Name("adamw/tessel/bf16_master_sr/64M")
    ->ArgsProduct({{1, 2}, {2}})
    ->ArgNames({"threads", "mode"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(adamw_tessel_bf16_remainder)
    ->Name("adamw/tessel/bf16_remainder/64M")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(adamw_eigen_bf16_master)
    ->Name("adamw/eigen/bf16_master/64M")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(adamw_tessel_f32)->Name("adamw/tessel/f32/64M")->ArgName("threads")->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(lion_tessel_f32)->Name("lion/tessel/f32/64M")->ArgName("threads")->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
