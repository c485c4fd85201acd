// bench_conv: conv2d forward on ResNet-50's 3x3 layers (64 channels at 56x56, 128 at 28x28, 256 at
// 14x14, 512 at 7x7; stride 1, pad 1), a 1x1 (256 -> 64 at 56x56) and the 7x7 stride-2 stem
// (3 -> 64 at 224x224), batch 1 and 8, f32 and bf16 inputs (f32 output), NHWC; the 3x3 layers on 1
// and 2 threads (argument `threads`), the others on 2. Then the bench U-Net's 3x3 layers as the graph
// executor runs them (NCHW, batch 1, 1 and 2 threads: 96 -> 32 and 32 -> 32 at 128x128, 192 -> 64 and
// 64 -> 64 at 64x64, 128 -> 128 at 32x32), argument `nchw` = 1.
// Impls: tessel (the implicit GEMM), tessel_prepacked (the same with the filter packed once, untimed), onednn (oneDNN's convolution; its preferred weight layout is
// reordered once outside the timing, which favours it), gemm (tessel's own GEMM on the implicit
// GEMM's M x N x K = N·OH·OW x O x C·KH·KW with a materialised, untimed im2col A: the rate the
// conv is held to). Counters: flops (rate, 2·M·N·K), of_limit against the measured peak.
// Then pooling (pool2d/...): ResNet's 3x3 stride-2 pad-1 max pool after the stem (64 channels at
// 112x112, batch 1 and 8, NCHW as the ONNX ResNet runs it and NHWC) and the U-Net's 2x2 stride-2
// max pools (32 channels at 128x128, 64 at 64x64, NCHW), f32 and bf16, 1 and 2 threads, tessel
// against oneDNN's pooling; a pool is a stream, so its counters are bytes (x read and y written
// once) and of_limit against the measured STREAM copy bandwidth.
#include <tessel/device/host_device.hpp>
#include <tessel/ops/conv.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/pool.hpp>

#include <benchmark/benchmark.h>

#include <array>
#include <random>
#include <string>
#include <vector>

#include "common/limits.hpp"

#if defined(TESSEL_HAVE_ONEDNN)
#include <dnnl.hpp>
extern "C" void omp_set_num_threads(int) __attribute__((weak));
#endif

using namespace tessel;

namespace {

// one device per thread count, kept across cases (its workers and scratch stay warm)
host_device& dev(unsigned threads) {
  static host_device d1(1), d2(2);
  return threads == 1 ? d1 : d2;
}

template <class T>
tessel_bench::huge_buffer<T> random_buffer(std::size_t n, unsigned seed) {
  tessel_bench::huge_buffer<T> b(n, 2);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) b[i] = T(d(g));
  return b;
}

struct conv_case {
  std::size_t n, c, hw, k, kh, stride, pad;
  unsigned threads;
  bool nchw;
};
conv_case from(const benchmark::State& st) {
  return {std::size_t(st.range(0)), std::size_t(st.range(1)), std::size_t(st.range(2)), std::size_t(st.range(3)), std::size_t(st.range(4)),
          std::size_t(st.range(5)), std::size_t(st.range(6)), unsigned(st.range(7)),    st.range(8) != 0};
}
conv2d_params params_of(const conv_case& c) {
  conv2d_params p;
  p.stride_h = p.stride_w = c.stride;
  p.pad_top = p.pad_left = p.pad_bottom = p.pad_right = c.pad;
  p.layout = c.nchw ? conv_layout::nchw : conv_layout::nhwc;
  return p;
}
std::size_t out_hw(const conv_case& c) { return (c.hw + 2 * c.pad - c.kh) / c.stride + 1; }

template <class T>
double peak(unsigned th) {
  return std::is_same_v<T, float> ? tessel_bench::peak_fp32_gflops(th) : tessel_bench::peak_bf16_gflops(th);
}
void set_flops(benchmark::State& st, double flops, double peak_gflops) {
  st.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["of_limit"] = benchmark::Counter(flops / 1e9 / peak_gflops, benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void conv_tessel(benchmark::State& st) {
  const auto c = from(st);
  const std::size_t o = out_hw(c);
  const image_dims xd{c.n, c.c, c.hw, c.hw}, yd{c.n, c.k, o, o};
  const filter_dims fd{c.k, c.c, c.kh, c.kh};
  auto x = random_buffer<T>(xd.size(), 1), w = random_buffer<T>(fd.size(), 2);
  tessel_bench::huge_buffer<float> y(yd.size(), 2);
  const auto p = params_of(c);
  for (auto _ : st) {
    conv2d(dev(c.threads), image<const T>{x.data(), xd}, filter<const T>{w.data(), fd}, {}, image<float>{y.data(), yd}, p);
    benchmark::ClobberMemory();
  }
  set_flops(st, conv2d_cost<T, float>(xd, fd, p).flops, peak<T>(c.threads));
}

// tessel with the filter packed once outside the timing (conv2d_packed_filter), as the oneDNN run
// reorders its weights once: the inference setting, where weights do not change between calls.
template <class T>
void conv_tessel_prepacked(benchmark::State& st) {
  const auto c = from(st);
  const std::size_t o = out_hw(c);
  const image_dims xd{c.n, c.c, c.hw, c.hw}, yd{c.n, c.k, o, o};
  const filter_dims fd{c.k, c.c, c.kh, c.kh};
  auto x = random_buffer<T>(xd.size(), 1), w = random_buffer<T>(fd.size(), 2);
  tessel_bench::huge_buffer<float> y(yd.size(), 2);
  const auto p = params_of(c);
  const conv2d_packed_filter<T, host_device> pw(dev(c.threads), filter<const T>{w.data(), fd}, 1);
  for (auto _ : st) {
    conv2d(dev(c.threads), image<const T>{x.data(), xd}, pw, {}, image<float>{y.data(), yd}, p);
    benchmark::ClobberMemory();
  }
  set_flops(st, conv2d_cost<T, float>(xd, fd, p).flops, peak<T>(c.threads));
}

// tessel's GEMM on the implicit GEMM's shape: A (M,K) is an im2col of x built once, untimed.
template <class T>
void conv_gemm(benchmark::State& st) {
  const auto c = from(st);
  const std::size_t o = out_hw(c), M = c.n * o * o, N = c.k, K = c.c * c.kh * c.kh;
  auto A = random_buffer<T>(M * K, 1), B = random_buffer<T>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  for (auto _ : st) {
    gemm(dev(c.threads), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * double(M) * double(N) * double(K), peak<T>(c.threads));
}

#if defined(TESSEL_HAVE_ONEDNN)
template <class T>
void conv_onednn(benchmark::State& st) {
  using namespace dnnl;
  const auto c = from(st);
  const std::size_t o = out_hw(c);
  if (omp_set_num_threads) omp_set_num_threads(int(c.threads));
  constexpr auto DT = std::is_same_v<T, float> ? memory::data_type::f32 : memory::data_type::bf16;
  const auto d = [](std::size_t v) { return static_cast<memory::dim>(v); };
  engine eng(engine::kind::cpu, 0);
  stream s(eng);
  auto x = random_buffer<T>(c.n * c.c * c.hw * c.hw, 1), w = random_buffer<T>(c.k * c.c * c.kh * c.kh, 2);
  tessel_bench::huge_buffer<float> y(c.n * c.k * o * o, 2);
  const auto tag = c.nchw ? memory::format_tag::nchw : memory::format_tag::nhwc;
  const memory::desc src_md({d(c.n), d(c.c), d(c.hw), d(c.hw)}, DT, tag);
  const memory::desc dst_md({d(c.n), d(c.k), d(o), d(o)}, memory::data_type::f32, tag);
  const memory::desc w_plain({d(c.k), d(c.c), d(c.kh), d(c.kh)}, DT, memory::format_tag::oihw);
  const memory::desc w_any({d(c.k), d(c.c), d(c.kh), d(c.kh)}, DT, memory::format_tag::any);
  const convolution_forward::desc desc(prop_kind::forward_inference, algorithm::convolution_direct, src_md, w_any, dst_md, {d(c.stride), d(c.stride)},
                                       {d(c.pad), d(c.pad)}, {d(c.pad), d(c.pad)});
  const convolution_forward::primitive_desc pd(desc, eng);
  memory src_m(src_md, eng, x.data()), dst_m(dst_md, eng, y.data()), w_user(w_plain, eng, w.data()), w_m(pd.weights_desc(), eng);
  reorder(w_user, w_m).execute(s, w_user, w_m);
  s.wait();
  convolution_forward prim(pd);
  st.SetLabel(pd.impl_info_str());
  for (auto _ : st) {
    prim.execute(s, {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, w_m}, {DNNL_ARG_DST, dst_m}});
    s.wait();
  }
  set_flops(st, 2.0 * double(c.n * o * o) * double(c.k) * double(c.c * c.kh * c.kh), peak<T>(c.threads));
}
#endif

// (n, c, hw, k, kh, stride, pad, threads, nchw)
void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "c", "hw", "k", "kh", "stride", "pad", "threads", "nchw"});
  for (long n : {1, 8}) {
    for (long th : {1, 2})
      for (auto [ch, hw] : {std::pair<long, long>{64, 56}, {128, 28}, {256, 14}, {512, 7}}) b->Args({n, ch, hw, ch, 3, 1, 1, th, 0});
    b->Args({n, 256, 56, 64, 1, 1, 0, 2, 0});                         // 1x1
    b->Args({n, 3, 224, 64, 7, 2, 3, 2, 0});                          // the stem
    for (long th : {1, 2}) b->Args({n, 3, 224, 64, 7, 2, 3, th, 1});  // the stem in NCHW (the ONNX ResNet's)
  }
  for (long th : {1, 2})  // the bench U-Net (tools/torch/onnx_models.py, w = 32) as the executor runs it
    for (auto [ci, hw, co] : {std::array<long, 3>{96, 128, 32}, {32, 128, 32}, {192, 64, 64}, {64, 64, 64}, {128, 32, 128}})
      b->Args({1, ci, hw, co, 3, 1, 1, th, 1});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

// ---- pooling ----
struct pool_case {
  std::size_t n, c, hw, k, stride, pad;
  unsigned threads;
  bool nchw;
};
pool_case pool_from(const benchmark::State& st) {
  return {std::size_t(st.range(0)), std::size_t(st.range(1)), std::size_t(st.range(2)), std::size_t(st.range(3)),
          std::size_t(st.range(4)), std::size_t(st.range(5)), unsigned(st.range(6)),    st.range(7) != 0};
}
pool2d_params pool_params_of(const pool_case& c) {
  pool2d_params p;
  p.kernel_h = p.kernel_w = c.k;
  p.stride_h = p.stride_w = c.stride;
  p.pad_top = p.pad_left = p.pad_bottom = p.pad_right = c.pad;
  p.layout = c.nchw ? conv_layout::nchw : conv_layout::nhwc;
  return p;
}
template <class T>
void set_bytes(benchmark::State& st, const image_dims& x, const image_dims& y, unsigned threads) {
  const double bytes = double(x.size() + y.size()) * sizeof(T);
  st.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["of_limit"] = benchmark::Counter(bytes / 1e9 / tessel_bench::stream_copy_gbs(threads), benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void pool_tessel(benchmark::State& st) {
  const auto c = pool_from(st);
  const auto p = pool_params_of(c);
  const image_dims xd{c.n, c.c, c.hw, c.hw}, yd = pool2d_output(xd, p);
  auto x = random_buffer<T>(xd.size(), 1);
  tessel_bench::huge_buffer<T> y(yd.size(), 2);
  for (auto _ : st) {
    max_pool2d(dev(c.threads), image<const T>{x.data(), xd}, image<T>{y.data(), yd}, p);
    benchmark::ClobberMemory();
  }
  set_bytes<T>(st, xd, yd, c.threads);
}

#if defined(TESSEL_HAVE_ONEDNN)
template <class T>
void pool_onednn(benchmark::State& st) {
  using namespace dnnl;
  const auto c = pool_from(st);
  const auto p = pool_params_of(c);
  const image_dims xd{c.n, c.c, c.hw, c.hw}, yd = pool2d_output(xd, p);
  if (omp_set_num_threads) omp_set_num_threads(int(c.threads));
  constexpr auto DT = std::is_same_v<T, float> ? memory::data_type::f32 : memory::data_type::bf16;
  const auto d = [](std::size_t v) { return static_cast<memory::dim>(v); };
  engine eng(engine::kind::cpu, 0);
  stream s(eng);
  auto x = random_buffer<T>(xd.size(), 1);
  tessel_bench::huge_buffer<T> y(yd.size(), 2);
  const auto tag = c.nchw ? memory::format_tag::nchw : memory::format_tag::nhwc;
  const memory::desc src_md({d(xd.n), d(xd.c), d(xd.h), d(xd.w)}, DT, tag), dst_md({d(yd.n), d(yd.c), d(yd.h), d(yd.w)}, DT, tag);
  const pooling_v2_forward::desc desc(prop_kind::forward_inference, algorithm::pooling_max, src_md, dst_md, {d(c.stride), d(c.stride)},
                                      {d(c.k), d(c.k)}, {0, 0}, {d(c.pad), d(c.pad)}, {d(c.pad), d(c.pad)});
  const pooling_v2_forward::primitive_desc pd(desc, eng);
  memory src_m(src_md, eng, x.data()), dst_m(dst_md, eng, y.data());
  pooling_v2_forward prim(pd);
  st.SetLabel(pd.impl_info_str());
  for (auto _ : st) {
    prim.execute(s, {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_DST, dst_m}});
    s.wait();
  }
  set_bytes<T>(st, xd, yd, c.threads);
}
#endif

// (n, c, hw, k, stride, pad, threads, nchw)
void pool_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "c", "hw", "k", "stride", "pad", "threads", "nchw"});
  for (long th : {1, 2}) {
    for (long n : {1, 8})
      for (long nchw : {1, 0}) b->Args({n, 64, 112, 3, 2, 1, th, nchw});  // ResNet's max pool
    b->Args({1, 32, 128, 2, 2, 0, th, 1});                                // the bench U-Net's
    b->Args({1, 64, 64, 2, 2, 0, th, 1});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(conv_tessel<float>)->Name("conv2d/tessel/f32")->Apply(shapes);
BENCHMARK(conv_tessel_prepacked<float>)->Name("conv2d/tessel_prepacked/f32")->Apply(shapes);
BENCHMARK(conv_gemm<float>)->Name("conv2d/gemm/f32")->Apply(shapes);
BENCHMARK(conv_tessel<bf16>)->Name("conv2d/tessel/bf16")->Apply(shapes);
BENCHMARK(conv_tessel_prepacked<bf16>)->Name("conv2d/tessel_prepacked/bf16")->Apply(shapes);
BENCHMARK(conv_gemm<bf16>)->Name("conv2d/gemm/bf16")->Apply(shapes);
#if defined(TESSEL_HAVE_ONEDNN)
BENCHMARK(conv_onednn<float>)->Name("conv2d/onednn/f32")->Apply(shapes);
BENCHMARK(conv_onednn<bf16>)->Name("conv2d/onednn/bf16")->Apply(shapes);
#endif
BENCHMARK(pool_tessel<float>)->Name("pool2d/tessel/f32")->Apply(pool_shapes);
BENCHMARK(pool_tessel<bf16>)->Name("pool2d/tessel/bf16")->Apply(pool_shapes);
#if defined(TESSEL_HAVE_ONEDNN)
BENCHMARK(pool_onednn<float>)->Name("pool2d/onednn/f32")->Apply(pool_shapes);
BENCHMARK(pool_onednn<bf16>)->Name("pool2d/onednn/bf16")->Apply(pool_shapes);
#endif

BENCHMARK_MAIN();
