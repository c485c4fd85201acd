// bench_norm: the memory-bound layer operators at sizes far above the cache, on 1 and 2 threads:
// RMSNorm / LayerNorm forward and backward, softmax forward and backward, SwiGLU forward, RoPE
// forward (with and without a rope_table), and the fused cross-entropy (loss + gradient) at
// vocabulary 128 Ki.
//
// Bytes each operator must move (what is counted; weights/statistics are negligible):
//   rmsnorm|layernorm fwd f32 [8192 x 8192]:  read x 4 + write y 4                          = 8 B/elem
//   rmsnorm|layernorm fwd bf16 (bf16 -> bf16): read 2 + write 2                             = 4 B/elem
//   rmsnorm|layernorm bwd f32:                read dy 4 + h 4 + write dx 4                  = 12 B/elem
//   softmax fwd f32 [8192 x 8192]:            read 4 + write 4                              = 8 B/elem
//   softmax bwd f32:                          read dy 4 + y 4 + write dx 4                  = 12 B/elem
//   swiglu fwd f32 (64 Mi):                   read a 4 + b 4 + write y 4                    = 12 B/elem
//   rope fwd f32 [8192 x 8192], head_dim 128: read 4 + write 4 (in place)                   = 8 B/elem
//     (positions t mod 4096: 8192 tokens of two 4096-token sequences; table=0 computes each
//     token's 64 cos/sin pairs in double, table=1 reads them from a rope_table of 2 MiB)
//   cross_entropy f32 [256 x 131072]:         read logits 4 + write dlogits 4              = 8 B/elem
//   cross_entropy in place:                   read 4 + write 4 (same buffer)               = 8 B/elem
// These are the bytes the kernels move: each input row is read from memory once (its later passes
// run from L1/L2), outputs above 16 MiB are written with non-temporal stores (no read for
// ownership), and the per-column weights (32 KiB) and per-row statistics stay in cache. The bf16
// benchmarks run on real bf16 data: reinterpreted f32 words would contain NaNs and subnormals.
// Counters: bytes (rate), triad_GBs (STREAM triad on the same thread count, measured in passes
// paired with the operator's repetitions) and of_limit = rate / triad_GBs (STREAM counts 24 B per
// triad element and no write-allocate traffic, so a kernel that writes with
// non-temporal stores can exceed 1.0).
#include <tessel/device/host_device.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/norm.hpp>
#include <tessel/ops/rope.hpp>
#include <tessel/ops/softmax.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <random>

#include "common/limits.hpp"

namespace {
using namespace tessel_bench;
using tessel::bf16;
using tessel::tensor;

constexpr std::size_t R = 8192, C = 8192, N = R * C;
constexpr std::size_t ce_rows = 256, ce_vocab = 131072;

struct buffers {
  huge_buffer<float> a, b, c, d, w, bias, mean, rstd;
  huge_buffer<bf16> a16, c16;  // real bf16 data (halves of f32 words would hold NaNs and subnormals)
  huge_buffer<std::int64_t> labels;
  buffers() : a(N, 2), b(N, 2), c(N, 2), d(N, 2), w(C, 1), bias(C, 1), mean(R, 1), rstd(R, 1), a16(N, 2), c16(N, 2), labels(ce_rows, 1) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t i = 0; i < N; i += 1) a[i] = float(i % 977) * 1e-3f - 0.4f;
    for (std::size_t i = 0; i < N; i += 1) b[i] = float(i % 613) * 1e-3f - 0.3f;
    for (std::size_t i = 0; i < N; i += 1) a16[i] = bf16(a[i]);
    for (std::size_t i = 0; i < C; ++i) w[i] = 1.0f + nd(rng) * 0.1f;
    for (std::size_t r = 0; r < ce_rows; ++r) labels[r] = std::int64_t((r * 7919) % ce_vocab);
  }
  static buffers& get() {
    static buffers s;
    return s;
  }
};

tessel::host_device& device(unsigned threads) {
  static tessel::host_device d1(1), d2(2);
  return threads >= 2 ? d2 : d1;
}

// Each timed repetition of the operator is followed by one STREAM triad pass on the same thread
// count (untimed for the operator), and of_limit divides the operator's mean rate by the mean
// triad rate of those paired passes: this VM's memory bandwidth drifts minute to minute (2-thread
// triad ~45-85 GB/s), so a triad measured once at start-up would not describe the same machine.
template <class F>
void run(benchmark::State& state, double bytes_per_iter, F&& f) {
  const unsigned threads = unsigned(state.range(0));
  buffers::get();
  auto& dev = device(threads);
  measure_stream(stream_kind::triad, threads);  // warm the STREAM arrays
  f(dev);                                       // warm (scratch arenas, page tables)
  double total = 0, triad_inv = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    f(dev);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total += s;
    triad_inv += 1.0 / measure_stream(stream_kind::triad, threads);
  }
  const double iters = double(state.iterations());
  const double rate = bytes_per_iter * iters / total * 1e-9, triad = iters / triad_inv;
  state.counters["bytes"] = benchmark::Counter(bytes_per_iter * iters, benchmark::Counter::kIsRate);
  state.counters["triad_GBs"] = triad;
  state.counters["of_limit"] = rate / triad;
}

tensor<const float, 2> cin(const huge_buffer<float>& b) { return tensor<const float, 2>(b.data(), R, C); }
tensor<float, 2> out(const huge_buffer<float>& b) { return tensor<float, 2>(b.data(), R, C); }
tensor<const bf16, 2> cin16(const huge_buffer<bf16>& b) { return tensor<const bf16, 2>(b.data(), R, C); }
tensor<bf16, 2> out16(huge_buffer<bf16>& b) { return tensor<bf16, 2>(b.data(), R, C); }
std::span<const float> cs(const huge_buffer<float>& b, std::size_t n) { return {b.data(), n}; }
std::span<float> ms(const huge_buffer<float>& b, std::size_t n) { return {b.data(), n}; }

void rmsnorm_fwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 8.0 * N, [&](auto& dev) { tessel::rmsnorm_forward(dev, cin(b.a), cs(b.w, C), out(b.c), ms(b.rstd, R)); });
}
void rmsnorm_fwd_bf16(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 4.0 * N, [&](auto& dev) { tessel::rmsnorm_forward(dev, cin16(b.a16), cs(b.w, C), out16(b.c16), ms(b.rstd, R)); });
}
void layernorm_fwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 8.0 * N, [&](auto& dev) { tessel::layernorm_forward(dev, cin(b.a), cs(b.w, C), cs(b.bias, C), out(b.c), ms(b.mean, R), ms(b.rstd, R)); });
}
void layernorm_fwd_bf16(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 4.0 * N,
      [&](auto& dev) { tessel::layernorm_forward(dev, cin16(b.a16), cs(b.w, C), cs(b.bias, C), out16(b.c16), ms(b.mean, R), ms(b.rstd, R)); });
}
void rmsnorm_bwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  tessel::rmsnorm_forward(device(1), cin(b.a), cs(b.w, C), out(b.c), ms(b.rstd, R));
  run(st, 12.0 * N, [&](auto& dev) { tessel::rmsnorm_backward(dev, cin(b.b), cin(b.a), cs(b.w, C), cs(b.rstd, R), out(b.d), ms(b.bias, C)); });
}
void layernorm_bwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  std::vector<float> dw(C), db(C);
  tessel::layernorm_forward(device(1), cin(b.a), cs(b.w, C), cs(b.bias, C), out(b.c), ms(b.mean, R), ms(b.rstd, R));
  run(st, 12.0 * N, [&](auto& dev) {
    tessel::layernorm_backward(dev, cin(b.b), cin(b.a), cs(b.w, C), cs(b.mean, R), cs(b.rstd, R), out(b.d), std::span<float>(dw),
                               std::span<float>(db));
  });
}
void softmax_fwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 8.0 * N, [&](auto& dev) { tessel::softmax_forward(dev, cin(b.a), out(b.c)); });
}
void softmax_bwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  tessel::softmax_forward(device(1), cin(b.a), out(b.c));
  run(st, 12.0 * N, [&](auto& dev) { tessel::softmax_backward(dev, cin(b.b), cin(b.c), out(b.d)); });
}
void swiglu_fwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  run(st, 12.0 * N, [&](auto& dev) { tessel::swiglu_forward(dev, cs(b.a, N), cs(b.b, N), ms(b.c, N)); });
}
void rope_fwd_f32(benchmark::State& st) {
  auto& b = buffers::get();
  constexpr std::size_t hd = 128;
  std::vector<std::int64_t> pos(R);
  for (std::size_t t = 0; t < R; ++t) pos[t] = std::int64_t(t % 4096);
  tessel::rope_table tab(hd, {});
  tab.cover(pos);
  tessel::rope_options o;
  if (st.range(1) != 0) o.table = &tab;
  run(st, 8.0 * N, [&](auto& dev) { tessel::rope_forward(dev, out(b.c), hd, pos, o); });
}
void cross_entropy_f32(benchmark::State& st) {
  auto& b = buffers::get();
  const bool in_place = st.range(1) != 0;
  tensor<const float, 2> z(b.a.data(), ce_rows, ce_vocab);
  tensor<float, 2> g(in_place ? b.a.data() : b.c.data(), ce_rows, ce_vocab);
  std::span<const std::int64_t> lab(b.labels.data(), ce_rows);
  run(st, 8.0 * ce_rows * ce_vocab, [&](auto& dev) { benchmark::DoNotOptimize(tessel::cross_entropy(dev, z, lab, g).loss); });
}

}  // namespace

#define TESSEL_NORM_BENCH(fn, name) BENCHMARK(fn)->Name(name)->ArgName("threads")->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond)
TESSEL_NORM_BENCH(rmsnorm_fwd_f32, "rmsnorm_fwd/tessel/f32/8192x8192");
TESSEL_NORM_BENCH(rmsnorm_fwd_bf16, "rmsnorm_fwd/tessel/bf16/8192x8192");
TESSEL_NORM_BENCH(rmsnorm_bwd_f32, "rmsnorm_bwd/tessel/f32/8192x8192");
TESSEL_NORM_BENCH(layernorm_fwd_f32, "layernorm_fwd/tessel/f32/8192x8192");
TESSEL_NORM_BENCH(layernorm_fwd_bf16, "layernorm_fwd/tessel/bf16/8192x8192");
TESSEL_NORM_BENCH(layernorm_bwd_f32, "layernorm_bwd/tessel/f32/8192x8192");
TESSEL_NORM_BENCH(softmax_fwd_f32, "softmax_fwd/tessel/f32/8192x8192");
TESSEL_NORM_BENCH(softmax_bwd_f32, "softmax_bwd/tessel/f32/8192x8192");
TESSEL_NORM_BENCH(swiglu_fwd_f32, "swiglu_fwd/tessel/f32/64M");
BENCHMARK(rope_fwd_f32)
    ->Name("rope_fwd/tessel/f32/8192x8192/hd128")
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->ArgNames({"threads", "table"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cross_entropy_f32)
    ->Name("cross_entropy/tessel/f32/256x131072")
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->ArgNames({"threads", "in_place"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
