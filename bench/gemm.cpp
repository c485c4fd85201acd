// GEMM benchmarks: tessel vs OpenBLAS cblas_sgemm, oneDNN 2.6 matmul (f32, bf16) and Eigen, on the
// square and transformer shapes, 1 and 2 threads; bf16, FP8 block-scaled, skinny (M=1/16) and
// fused-epilogue variants, grouped (MoE expert) GEMM. Counters: flops (rate) or bytes (rate), and of_limit against the
// machine limits of bench/common/limits.hpp.
// OpenBLAS reads OPENBLAS_CORETYPE at load time: run this binary once as is and once with
// OPENBLAS_CORETYPE=SkylakeX and compare against the faster.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <ctime>
#include <functional>
#include <thread>
#include <type_traits>
#include <memory>
#include <random>
#include <string>
#include <vector>

// tessel first: arch/target.hpp parses the intrinsic headers under a GCC 12 false-positive guard.
#include <tessel/device.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/gemm_grouped.hpp>

#include <Eigen/Core>

#include "common/limits.hpp"
#include "common/paired.hpp"
#include "../examples/fused_gemm_bias_gelu.hpp"  // example 03's user-written fused kernel

#if defined(TESSEL_HAVE_OPENBLAS)
#include <cblas.h>
#endif
#if defined(TESSEL_HAVE_ONEDNN)
#include <dnnl.hpp>
extern "C" void omp_set_num_threads(int) __attribute__((weak));
#endif

using namespace tessel;

namespace {

host_device& dev(unsigned threads) {
  static host_device d1(1), d2(2);
  return threads >= 2 ? d2 : d1;
}

template <class T>
tessel_bench::huge_buffer<T> random_buffer(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  tessel_bench::huge_buffer<T> b(n, 2);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (std::size_t i = 0; i < n; ++i) b[i] = T(d(g));
  return b;
}

// The same values in ordinary memory (std::vector: 4 KiB pages unless the kernel's THP mode is
// "always"), as most callers pass it; the huge-page buffers above are what tessel's devices allocate.
template <class T>
std::vector<T> random_vector(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<T> v(n);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (auto& x : v) x = T(d(g));
  return v;
}

double process_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

// CPU time of the whole process (all threads) over the timed loop. On a shared, oversubscribed
// machine wall time measures the load as much as the code; flops per CPU-second per thread
// (cpu_of_limit against the 1-thread peak) is the per-core efficiency while the code runs.
struct cpu_timer {
  double t0 = process_cpu_seconds();
  double seconds() const { return process_cpu_seconds() - t0; }
};

void set_flops(benchmark::State& st, double flops, double peak_gflops, const cpu_timer& ct, double peak1_gflops) {
  st.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["of_limit"] = benchmark::Counter(flops / 1e9 / peak_gflops, benchmark::Counter::kIsIterationInvariantRate);
  const double cpu = ct.seconds(), total = flops * double(st.iterations());
  if (cpu > 0) {
    st.counters["cpu_gflops"] = total / cpu / 1e9;
    st.counters["cpu_of_limit"] = total / cpu / 1e9 / peak1_gflops;
  }
}

// ---- f32 ----
// f32 operands in huge-page buffers (Huge, what tessel's devices allocate) or in ordinary 4 KiB-page
// std::vector memory (what most callers pass); the same values either way.
template <bool Huge>
auto f32_input(std::size_t n, unsigned seed) {
  if constexpr (Huge)
    return random_buffer<float>(n, seed);
  else
    return random_vector<float>(n, seed);
}
template <bool Huge>
auto f32_output(std::size_t n) {
  if constexpr (Huge)
    return tessel_bench::huge_buffer<float>(n, 2);
  else
    return std::vector<float>(n);
}

template <bool Huge>
void gemm_f32_tessel(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const unsigned th = static_cast<unsigned>(st.range(3));
  auto A = f32_input<Huge>(M * K, 1), B = f32_input<Huge>(K * N, 2);
  auto C = f32_output<Huge>(M * N);
  const cpu_timer ct;
  for (auto _ : st) {
    gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * M * N * K, tessel_bench::peak_fp32_gflops(th), ct, tessel_bench::peak_fp32_gflops(1));
}

#if defined(TESSEL_HAVE_OPENBLAS)
template <bool Huge>
void gemm_f32_openblas(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const int th = static_cast<int>(st.range(3));
  auto A = f32_input<Huge>(M * K, 1), B = f32_input<Huge>(K * N, 2);
  auto C = f32_output<Huge>(M * N);
  openblas_set_num_threads(th);
  st.SetLabel(openblas_get_corename());
  const cpu_timer ct;
  for (auto _ : st) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(N), int(K), 1.0f, A.data(), int(K), B.data(), int(N), 0.0f, C.data(), int(N));
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * M * N * K, tessel_bench::peak_fp32_gflops(th), ct, tessel_bench::peak_fp32_gflops(1));
}
#endif

void gemm_f32_eigen(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  auto A = random_buffer<float>(M * K, 1), B = random_buffer<float>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<Mat> a(A.data(), M, K), b(B.data(), K, N), c(C.data(), M, N);
  const cpu_timer ct;
  for (auto _ : st) {
    c.noalias() = a * b;
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * M * N * K, tessel_bench::peak_fp32_gflops(1), ct,
            tessel_bench::peak_fp32_gflops(1));  // Eigen is built without OpenMP: 1 thread
}

#if defined(TESSEL_HAVE_ONEDNN)
// A oneDNN matmul C (f32) = A·B over the caller's row-major buffers. Prepacked: B is reordered
// once, here, into the layout the primitive prefers (outside any timing, which favours oneDNN);
// otherwise the primitive takes B row-major, as tessel and OpenBLAS do, and packs it in each call.
template <dnnl::memory::data_type DT>
struct onednn_matmul {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream s{eng};
  dnnl::memory a_m, b_m, c_m;
  dnnl::matmul prim;
  onednn_matmul(std::size_t M, std::size_t N, std::size_t K, void* A, void* B, float* C, bool prepacked) {
    using namespace dnnl;
    using dims = memory::dims;
    const auto mi = static_cast<memory::dim>(M), ni = static_cast<memory::dim>(N), ki = static_cast<memory::dim>(K);
    const memory::desc a_md(dims{mi, ki}, DT, memory::format_tag::ab), b_md(dims{ki, ni}, DT, memory::format_tag::ab),
        b_any(dims{ki, ni}, DT, memory::format_tag::any), c_md(dims{mi, ni}, memory::data_type::f32, memory::format_tag::ab);
    const matmul::primitive_desc pd(matmul::desc(a_md, prepacked ? b_any : b_md, c_md), eng);
    a_m = memory(a_md, eng, A);
    c_m = memory(c_md, eng, C);
    memory b_plain(b_md, eng, B);
    if (prepacked) {
      b_m = memory(pd.weights_desc(), eng);
      reorder(b_plain, b_m).execute(s, b_plain, b_m);
      s.wait();
    } else {
      b_m = b_plain;
    }
    prim = matmul(pd);
  }
  void run() {
    prim.execute(s, {{DNNL_ARG_SRC, a_m}, {DNNL_ARG_WEIGHTS, b_m}, {DNNL_ARG_DST, c_m}});
    s.wait();
  }
};

template <dnnl::memory::data_type DT, class T>
void gemm_onednn(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const int th = static_cast<int>(st.range(3));
  if (omp_set_num_threads) omp_set_num_threads(th);
  auto A = random_buffer<T>(M * K, 1), B = random_buffer<T>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  onednn_matmul<DT> mm(M, N, K, A.data(), B.data(), C.data(), true);
  const cpu_timer ct;
  for (auto _ : st) mm.run();
  constexpr bool f32 = DT == dnnl::memory::data_type::f32;
  set_flops(st, 2.0 * M * N * K, f32 ? tessel_bench::peak_fp32_gflops(th) : tessel_bench::peak_bf16_gflops(th), ct,
            f32 ? tessel_bench::peak_fp32_gflops(1) : tessel_bench::peak_bf16_gflops(1));
}
#endif

// ---- bf16 ----
void gemm_bf16_tessel(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const unsigned th = static_cast<unsigned>(st.range(3));
  auto A = random_buffer<bf16>(M * K, 1), B = random_buffer<bf16>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  const cpu_timer ct;
  for (auto _ : st) {
    gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * M * N * K, tessel_bench::peak_bf16_gflops(th), ct, tessel_bench::peak_bf16_gflops(1));
}

// Fused epilogue: bias + GELU + cast to bf16, against the same GEMM writing bf16 plainly.
void gemm_bf16_fused_tessel(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const unsigned th = static_cast<unsigned>(st.range(3));
  const bool fused = st.range(4) != 0;
  auto A = random_buffer<bf16>(M * K, 1), B = random_buffer<bf16>(K * N, 2);
  auto bias = random_buffer<float>(N, 3);
  tessel_bench::huge_buffer<bf16> C(M * N, 2);
  const std::span<const float> bs(bias.data(), N);
  const cpu_timer ct;
  for (auto _ : st) {
    if (fused)
      gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N,
           epilogue::bias(bs) | epilogue::gelu | epilogue::cast<bf16>);
    else
      gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * M * N * K, tessel_bench::peak_bf16_gflops(th), ct, tessel_bench::peak_bf16_gflops(1));
}

// FP8 e4m3 with DeepSeek-V3 block scales (1x128 A, 128x128 B), f32 out.
void gemm_fp8_block_tessel(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const unsigned th = static_cast<unsigned>(st.range(3));
  auto A = random_buffer<e4m3>(M * K, 1, -4, 4), B = random_buffer<e4m3>(K * N, 2, -4, 4);
  const std::size_t kb = (K + 127) / 128, nb = (N + 127) / 128;
  auto sa = random_buffer<float>(M * kb, 3, 0.5f, 2.0f), sb = random_buffer<float>(kb * nb, 4, 0.5f, 2.0f);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  gemm_scales s;
  s.a_block = sa.data();
  s.b_block = sb.data();
  const cpu_timer ct;
  for (auto _ : st) {
    gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N, epilogue::chain<>{}, s);
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * M * N * K, tessel_bench::peak_bf16_gflops(th), ct, tessel_bench::peak_bf16_gflops(1));
}

// Skinny: M = 1 or 16 activations times (K,N) bf16 weights; bound by reading B once.
void gemm_skinny_tessel(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const unsigned th = static_cast<unsigned>(st.range(3));
  auto A = random_buffer<bf16>(M * K, 1), B = random_buffer<bf16>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  const cpu_timer ct;
  for (auto _ : st) {
    gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
    benchmark::ClobberMemory();
  }
  const double bytes = double(K) * N * sizeof(bf16);
  st.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  // of_limit: STREAM-bound time for reading B once divided by our time
  st.counters["of_limit"] = benchmark::Counter(bytes / 1e9 / tessel_bench::stream_copy_gbs(th), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["flops"] = benchmark::Counter(2.0 * M * N * K, benchmark::Counter::kIsIterationInvariantRate);
  const double cpu = ct.seconds();
  if (cpu > 0) st.counters["cpu_of_limit"] = bytes * double(st.iterations()) / cpu / 1e9 / tessel_bench::stream_copy_gbs(1);
}

// ---- paired: tessel and every peer alternated inside one timed loop ----
// The separate benchmarks above run each library for a second or more in turn; this machine's
// speed drifts by a few percent over that time, as much as the libraries differ. Here every
// iteration calls tessel and each peer once on the same huge-page operands, in an order that
// rotates from one iteration to the next, so drift reaches all of them alike, and reports the
// ratios of the summed times. gap_ms idles between calls (not timed) so that one library's
// spinning pool threads have gone to sleep before the next one starts. The benchmark's own
// time is tessel's (manual time). vs_X = time of X / time of tessel: above 1, tessel is faster.
// Run with OPENBLAS_CORETYPE=SkylakeX (OpenBLAS reads it when it loads).
template <bool Bf16>
void gemm_paired(benchmark::State& st) {
  using T = std::conditional_t<Bf16, bf16, float>;
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const unsigned th = static_cast<unsigned>(st.range(3));
  const auto gap = std::chrono::microseconds(st.range(4) * 1000);
  auto A = random_buffer<T>(M * K, 1), B = random_buffer<T>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  std::vector<std::function<void()>> calls;
  std::vector<std::string> names;
  calls.emplace_back([&] { gemm(dev(th), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N); });
  names.emplace_back("tessel");
#if defined(TESSEL_HAVE_OPENBLAS)
  if constexpr (!Bf16) {
    openblas_set_num_threads(static_cast<int>(th));
    calls.emplace_back([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(N), int(K), 1.0f, A.data(), int(K), B.data(), int(N), 0.0f, C.data(),
                  int(N));
    });
    names.emplace_back("openblas");
    st.SetLabel(std::string("openblas ") + openblas_get_corename());
  }
#endif
#if defined(TESSEL_HAVE_ONEDNN)
  if (omp_set_num_threads) omp_set_num_threads(static_cast<int>(th));
  constexpr auto DT = Bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  // prepacked (as gemm_onednn), and with B as the caller holds it, packed inside each call
  onednn_matmul<DT> packed(M, N, K, A.data(), B.data(), C.data(), true), plain(M, N, K, A.data(), B.data(), C.data(), false);
  calls.emplace_back([&] { packed.run(); });
  names.emplace_back("onednn");
  calls.emplace_back([&] { plain.run(); });
  names.emplace_back("onednn_plain_b");
#endif
  for (auto& c : calls) c();  // warm every library once (pools started, pages touched)
  const auto r = tessel_bench::run_rotated(
      calls, gap, [&](std::size_t, const std::vector<double>&, double) { return st.KeepRunning(); },
      [&](std::size_t, double mine) {
        benchmark::ClobberMemory();
        st.SetIterationTime(mine);
      });
  const std::size_t n = calls.size(), it = r.iterations;
  const std::vector<double>& total = r.seconds;
  const double flops = 2.0 * double(M) * double(N) * double(K) * double(it);
  double best_peer = 0;
  for (std::size_t j = 0; j < n; ++j) {
    st.counters[names[j] + "_gflops"] = flops / total[j] / 1e9;
    if (j > 0) {
      st.counters["vs_" + names[j]] = total[j] / total[0];
      best_peer = best_peer == 0 ? total[j] : std::min(best_peer, total[j]);
    }
  }
  if (best_peer > 0) st.counters["vs_best_peer"] = best_peer / total[0];
  st.counters["of_limit"] = flops / total[0] / 1e9 / (Bf16 ? tessel_bench::peak_bf16_gflops(th) : tessel_bench::peak_fp32_gflops(th));
}

void paired_shapes(benchmark::internal::Benchmark* b) {
  for (long th : {1, 2}) {
    b->Args({2048, 2048, 2048, th, th == 1 ? 0 : 200});
    b->Args({2048, 4096, 4096, th, th == 1 ? 0 : 200});
    b->Args({2048, 11008, 4096, th, th == 1 ? 0 : 200});
  }
  b->ArgNames({"M", "N", "K", "threads", "gap_ms"})->Unit(benchmark::kMillisecond)->UseManualTime()->Iterations(6);
}
void paired_bf16_shapes(benchmark::internal::Benchmark* b) {
  for (long th : {1, 2}) {
    b->Args({2048, 2048, 2048, th, th == 1 ? 0 : 200});
    b->Args({2048, 4096, 4096, th, th == 1 ? 0 : 200});
  }
  b->ArgNames({"M", "N", "K", "threads", "gap_ms"})->Unit(benchmark::kMillisecond)->UseManualTime()->Iterations(6);
}

// Runs `mine` and `other` alternately in one timed loop (the order flips every iteration, so
// drift and cache state fall on both alike); the iteration time is mine's. Returns both totals.
struct alternated {
  double mine = 0, other = 0;
  std::size_t iterations = 0;
};
template <class Mine, class Other>
alternated alternate(benchmark::State& st, Mine&& mine, Other&& other) {
  auto time = [](auto& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  mine();  // warm both once (pages touched, scratch grown)
  other();
  alternated r;
  for (auto _ : st) {
    double m = 0;
    if (r.iterations % 2 == 0) {
      m = time(mine);
      r.other += time(other);
    } else {
      r.other += time(other);
      m = time(mine);
    }
    r.mine += m;
    benchmark::ClobberMemory();
    st.SetIterationTime(m);
    ++r.iterations;
  }
  return r;
}

// Operands of the bf16 GEMM + bias + GELU + cast comparisons (args M, N, K, threads), and the
// library's fused call on them.
struct epilogue_case {
  std::size_t M, N, K;
  unsigned th;
  tessel_bench::huge_buffer<bf16> A, B;
  tessel_bench::huge_buffer<float> bias;
  tessel_bench::huge_buffer<bf16> C;
  explicit epilogue_case(const benchmark::State& st)
      : M(st.range(0)),
        N(st.range(1)),
        K(st.range(2)),
        th(static_cast<unsigned>(st.range(3))),
        A(random_buffer<bf16>(M * K, 1)),
        B(random_buffer<bf16>(K * N, 2)),
        bias(random_buffer<float>(N, 3)),
        C(M * N, 2) {}
  tensor<const bf16, 2> a() const { return tensor<const bf16, 2>(A.data(), M, K); }
  tensor<const bf16, 2> b() const { return tensor<const bf16, 2>(B.data(), K, N); }
  tensor<bf16, 2> c() { return tensor<bf16, 2>(C.data(), M, N); }
  std::span<const float> bs() const { return std::span<const float>(bias.data(), N); }
  void fused() { gemm(dev(th), a(), b(), c(), 1.0f, 0.0f, epilogue::bias(bs()) | epilogue::gelu | epilogue::cast<bf16>); }
  double flops(std::size_t iterations) const { return 2.0 * double(M) * double(N) * double(K) * double(iterations); }
};

// The user-written tile program of example 03 (GEMM + bias + GELU + cast, public primitives)
// against the library GEMM with the same epilogue, alternated in one timed loop; the
// benchmark's time is the user program's, vs_library = library time / user time (above 1: the
// user program is faster).
void gemm_user_vs_library(benchmark::State& st) {
  epilogue_case e(st);
  const auto r = alternate(
      st, [&] { example::gemm_bias_gelu_launch(dev(e.th), e.a(), e.b(), e.c(), e.bs()); }, [&] { e.fused(); });
  const double flops = e.flops(r.iterations);
  st.counters["user_gflops"] = flops / r.mine / 1e9;
  st.counters["library_gflops"] = flops / r.other / 1e9;
  st.counters["vs_library"] = r.other / r.mine;
}

// The library GEMM with the fused bias + GELU + cast epilogue against the same GEMM storing
// bf16 without it, alternated in one loop: epilogue_cost = fused time / plain time - 1 (the
// issue's bound is 0.03). The separate gemm_bf16_epilogue/tessel runs drift by as much.
void gemm_fused_vs_plain(benchmark::State& st) {
  epilogue_case e(st);
  const auto r = alternate(
      st, [&] { e.fused(); }, [&] { gemm(dev(e.th), e.a(), e.b(), e.c(), 1.0f, 0.0f); });
  const double flops = e.flops(r.iterations);
  st.counters["fused_gflops"] = flops / r.mine / 1e9;
  st.counters["plain_gflops"] = flops / r.other / 1e9;
  st.counters["epilogue_cost"] = r.mine / r.other - 1.0;
}

// The direct path for tiny products against the packed path on the same shape, alternated in one
// loop (1 thread, the calling thread), with OpenBLAS beside them for f32: the measurement behind
// detail::gemm_tune().direct_max_macs{,_pair}. vs_packed = packed time / direct time (above 1, direct is
// faster); vs_openblas likewise. Each timed call repeats the product to about 10^5 multiply-adds so
// the clock's own cost stays out of the ratio. Args: M, N, K, transposes (0 NN, 1 NT, 2 TN, 3 TT), bf16.
void gemm_direct_vs_packed(benchmark::State& st) {
  const std::size_t M = st.range(0), N = st.range(1), K = st.range(2);
  const bool ta = st.range(3) >= 2, tb = st.range(3) % 2 == 1, is_bf16 = st.range(4) != 0;
  const std::size_t reps = std::max<std::size_t>(1, std::size_t(1e5 / double(M * N * K)));
  const std::size_t lda = ta ? M : K, ldb = tb ? K : N;
  const transpose oa = ta ? transpose::yes : transpose::none, ob = tb ? transpose::yes : transpose::none;
  auto Af = random_buffer<float>(M * K, 1), Bf = random_buffer<float>(K * N, 2);
  auto Ah = random_buffer<bf16>(M * K, 1), Bh = random_buffer<bf16>(K * N, 2);
  tessel_bench::huge_buffer<float> C(M * N, 2);
  auto& tune = tessel::detail::gemm_tune();
  const auto saved = tune;
  auto with = [&](double threshold) {
    return [&, threshold] {
      tune.direct_max_macs = tune.direct_max_macs_pair = threshold;
      for (std::size_t r = 0; r < reps; ++r) {
        if (is_bf16)
          gemm(dev(1), oa, ob, M, N, K, 1.0f, Ah.data(), lda, Bh.data(), ldb, 0.0f, C.data(), N);
        else
          gemm(dev(1), oa, ob, M, N, K, 1.0f, Af.data(), lda, Bf.data(), ldb, 0.0f, C.data(), N);
      }
      tune = saved;
    };
  };
  std::vector<std::function<void()>> calls{with(1e300), with(0)};
  std::vector<std::string> names{"direct", "packed"};
#if defined(TESSEL_HAVE_OPENBLAS)
  if (!is_bf16) {
    openblas_set_num_threads(1);
    calls.emplace_back([&] {
      for (std::size_t r = 0; r < reps; ++r)
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(M), int(N), int(K), 1.0f, Af.data(), int(lda),
                    Bf.data(), int(ldb), 0.0f, C.data(), int(N));
    });
    names.emplace_back("openblas");
  }
#endif
  for (auto& c : calls) c();
  const auto r = tessel_bench::run_rotated(
      calls, std::chrono::microseconds(0), [&](std::size_t, const std::vector<double>&, double) { return st.KeepRunning(); },
      [&](std::size_t, double mine) { st.SetIterationTime(mine); });
  const double flops = 2.0 * double(M * N * K) * double(reps) * double(r.iterations);
  for (std::size_t j = 0; j < calls.size(); ++j) {
    st.counters[names[j] + "_gflops"] = flops / r.seconds[j] / 1e9;
    if (j > 0) st.counters["vs_" + names[j]] = r.seconds[j] / r.seconds[0];
    if (j > 0) st.counters["vs_" + names[j] + "_fastest"] = r.fastest[j] / r.fastest[0];
  }
  st.counters["macs"] = double(M * N * K);
}
// ---- grouped ----
// A mixture of experts' expert GEMMs as one grouped launch, against one GEMM with the same total
// FLOPs (the bound: the group should run at >= 0.9 of its rate) and against one gemm call
// per expert (what a caller does without the group), alternated in one loop (run_rotated).
// Args: kind (0: forward, problem e is (rows_e, N) = (rows_e, K)·(K, N); 1: weight gradient,
// problem e is (M, N) = X_eᵀ·dY_e over K = rows_e, X_e stored (rows_e, M)), experts, rows (all
// experts' rows; their split is uneven, seeded: expert e is chosen with weight 1/sqrt(e+1)), the
// two other dimensions, threads, bf16. vs_single = single time / grouped time (above 1: the group
// is faster per FLOP), vs_loop = loop time / grouped time.
template <class T>
void gemm_grouped_bench(benchmark::State& st) {
  const int kind = static_cast<int>(st.range(0));
  const std::size_t E = st.range(1), rows = st.range(2), D1 = st.range(3), D2 = st.range(4);
  const unsigned th = static_cast<unsigned>(st.range(5));
  std::vector<std::size_t> per(E, 0);
  {
    std::vector<double> w(E);
    for (std::size_t e = 0; e < E; ++e) w[e] = 1.0 / std::sqrt(double(e + 1));
    std::mt19937 g(5);
    std::discrete_distribution<std::size_t> pick(w.begin(), w.end());
    for (std::size_t r = 0; r < rows; ++r) ++per[pick(g)];
  }
  // forward: X (rows, K=D2) times W_e (K, N=D1) per expert; gradient: X (rows, M=D1), dY (rows, N=D2)
  const std::size_t a_cols = kind == 0 ? D2 : D1;
  auto X = random_buffer<T>(rows * a_cols, 1);
  auto W = random_buffer<T>(kind == 0 ? E * D2 * D1 : rows * D2, 2);
  tessel_bench::huge_buffer<float> C(kind == 0 ? rows * D1 : E * D1 * D2, 2), C1(kind == 0 ? rows * D1 : D1 * D2, 2);
  std::vector<gemm_problem<T, T, float>> q;
  std::size_t off = 0;
  for (std::size_t e = 0; e < E; ++e) {
    if (kind == 0)
      q.push_back({transpose::none, transpose::none, per[e], D1, D2, 1.0f, X.data() + off * D2, D2, W.data() + e * D2 * D1, D1, 0.0f,
                   C.data() + off * D1, D1});
    else
      q.push_back({transpose::yes, transpose::none, D1, D2, per[e], 1.0f, X.data() + off * D1, D1, W.data() + off * D2, D2, 0.0f,
                   C.data() + e * D1 * D2, D2});
    off += per[e];
  }
  std::vector<std::function<void()>> calls;
  calls.emplace_back([&] { gemm_grouped(dev(th), q); });
  if (kind == 0)
    calls.emplace_back([&] { gemm(dev(th), transpose::none, transpose::none, rows, D1, D2, 1.0f, X.data(), D2, W.data(), D1, 0.0f, C1.data(), D1); });
  else
    calls.emplace_back([&] { gemm(dev(th), transpose::yes, transpose::none, D1, D2, rows, 1.0f, X.data(), D1, W.data(), D2, 0.0f, C1.data(), D2); });
  calls.emplace_back([&] {
    for (const auto& p : q) gemm(dev(th), p.ta, p.tb, p.M, p.N, p.K, p.alpha, p.A, p.lda, p.B, p.ldb, p.beta, p.C, p.ldc);
  });
  for (auto& c : calls) c();
  const auto r = tessel_bench::run_rotated(
      calls, std::chrono::microseconds(0), [&](std::size_t, const std::vector<double>&, double) { return st.KeepRunning(); },
      [&](std::size_t, double mine) {
        benchmark::ClobberMemory();
        st.SetIterationTime(mine);
      });
  const double flops = 2.0 * double(rows) * double(D1) * double(D2) * double(r.iterations);
  st.counters["grouped_gflops"] = flops / r.seconds[0] / 1e9;
  st.counters["single_gflops"] = flops / r.seconds[1] / 1e9;
  st.counters["loop_gflops"] = flops / r.seconds[2] / 1e9;
  st.counters["vs_single"] = r.seconds[1] / r.seconds[0];
  st.counters["vs_loop"] = r.seconds[2] / r.seconds[0];
  st.counters["fastest_vs_single"] = r.fastest[1] / r.fastest[0];
  st.counters["of_limit"] =
      flops / r.seconds[0] / 1e9 / (std::is_same_v<T, bf16> ? tessel_bench::peak_bf16_gflops(th) : tessel_bench::peak_fp32_gflops(th));
}

// Mixtral-like (8 experts, hidden 1024, FFN 2816) and fine-grained (64 experts of FFN 512) groups,
// forward and weight gradient, 1 and 2 threads.
void grouped_shapes(benchmark::internal::Benchmark* b) {
  for (long th : {1, 2}) {
    b->Args({0, 8, 2048, 2816, 1024, th});  // up/gate projection
    b->Args({0, 8, 2048, 1024, 2816, th});  // down projection
    b->Args({1, 8, 2048, 1024, 2816, th});  // dW of the up projection: X_eᵀ·dY_e
    b->Args({0, 64, 4096, 512, 1024, th});  // fine-grained experts, ~64 rows each
    b->Args({1, 64, 4096, 1024, 512, th});
  }
  b->ArgNames({"kind", "E", "rows", "D1", "D2", "threads"})->Unit(benchmark::kMillisecond)->UseManualTime();
}

void direct_shapes(benchmark::internal::Benchmark* b) {
  for (long bf : {0, 1}) {
    for (long n : {4, 8, 16, 24, 32, 40, 48, 64, 96})
      for (long t : {0, 1, 2, 3}) b->Args({n, n, n, t, bf});
    for (auto [m, n, k] : std::vector<std::array<long, 3>>{{1, 64, 64},
                                                           {1, 256, 128},
                                                           {1, 1024, 64},
                                                           {4, 512, 32},
                                                           {16, 64, 32},
                                                           {64, 16, 32},
                                                           {128, 8, 32},
                                                           {2, 16, 1024},
                                                           {8, 128, 64},
                                                           {32, 256, 8},
                                                           {256, 256, 1}})
      for (long t : {0, 1}) b->Args({m, n, k, t, bf});
  }
  b->ArgNames({"M", "N", "K", "trans", "bf16"})->Unit(benchmark::kMicrosecond)->UseManualTime()->MinTime(0.05);
}

void big_shapes(benchmark::internal::Benchmark* b) {
  for (long th : {1, 2}) {
    b->Args({2048, 2048, 2048, th});
    b->Args({2048, 4096, 4096, th});
    b->Args({2048, 11008, 4096, th});
  }
  b->ArgNames({"M", "N", "K", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}
void bf16_shapes(benchmark::internal::Benchmark* b) {
  for (long th : {1, 2}) {
    b->Args({2048, 2048, 2048, th});
    b->Args({2048, 4096, 4096, th});
  }
  b->ArgNames({"M", "N", "K", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(gemm_f32_tessel<true>)->Name("gemm_f32/tessel")->Apply(big_shapes);
#if defined(TESSEL_HAVE_OPENBLAS)
BENCHMARK(gemm_f32_openblas<true>)->Name("gemm_f32/openblas")->Apply(big_shapes);
#endif
#if defined(TESSEL_HAVE_ONEDNN)
BENCHMARK(gemm_onednn<dnnl::memory::data_type::f32, float>)->Name("gemm_f32/onednn")->Apply(big_shapes);
#endif
BENCHMARK(gemm_f32_tessel<false>)
    ->Name("gemm_f32_4k/tessel")
    ->ArgsProduct({{2048}, {4096}, {4096}, {1, 2}})
    ->ArgNames({"M", "N", "K", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
#if defined(TESSEL_HAVE_OPENBLAS)
BENCHMARK(gemm_f32_openblas<false>)
    ->Name("gemm_f32_4k/openblas")
    ->ArgsProduct({{2048}, {4096}, {4096}, {1, 2}})
    ->ArgNames({"M", "N", "K", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
#endif
BENCHMARK(gemm_f32_eigen)
    ->Name("gemm_f32/eigen")
    ->Args({2048, 2048, 2048, 1})
    ->ArgNames({"M", "N", "K", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(gemm_bf16_tessel)->Name("gemm_bf16/tessel")->Apply(bf16_shapes);
#if defined(TESSEL_HAVE_ONEDNN)
BENCHMARK(gemm_onednn<dnnl::memory::data_type::bf16, bf16>)->Name("gemm_bf16/onednn")->Apply(bf16_shapes);
#endif
BENCHMARK(gemm_direct_vs_packed)->Name("gemm_direct")->Apply(direct_shapes);
BENCHMARK(gemm_paired<false>)->Name("gemm_f32_paired")->Apply(paired_shapes);
BENCHMARK(gemm_paired<true>)->Name("gemm_bf16_paired")->Apply(paired_bf16_shapes);
BENCHMARK(gemm_fp8_block_tessel)->Name("gemm_fp8_block/tessel")->Apply(bf16_shapes);
BENCHMARK(gemm_bf16_fused_tessel)
    ->Name("gemm_bf16_epilogue/tessel")
    ->ArgsProduct({{2048}, {4096}, {4096}, {1, 2}, {0, 1}})
    ->ArgNames({"M", "N", "K", "threads", "fused"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(gemm_user_vs_library)
    ->Name("gemm_bf16_epilogue/user_vs_library")
    ->ArgsProduct({{2048}, {4096}, {4096}, {1, 2}})
    ->ArgNames({"M", "N", "K", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime()
    ->Iterations(6);
BENCHMARK(gemm_fused_vs_plain)
    ->Name("gemm_bf16_epilogue/fused_vs_plain")
    ->ArgsProduct({{2048}, {4096}, {4096}, {1, 2}})
    ->ArgNames({"M", "N", "K", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime()
    ->Iterations(6);
BENCHMARK(gemm_grouped_bench<float>)->Name("gemm_grouped_f32")->Apply(grouped_shapes);
BENCHMARK(gemm_grouped_bench<bf16>)->Name("gemm_grouped_bf16")->Apply(grouped_shapes);
BENCHMARK(gemm_skinny_tessel)
    ->Name("gemm_skinny_bf16/tessel")
    ->ArgsProduct({{1, 16}, {4096}, {4096}, {1, 2}})
    ->ArgNames({"M", "N", "K", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

BENCHMARK_MAIN();
