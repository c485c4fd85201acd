// The machine's own limits, measured once per process and cached: peak FP32 FMA GFLOP/s (AVX-512
// and AVX2), peak BF16 dot GFLOP/s (vdpbf16ps), STREAM copy/triad GB/s on arrays far larger than
// the LLC, each on 1 and 2 threads. Benchmarks divide by these to report `of_limit`.
//
// Conventions: an FMA is 2 flops; a 512-bit vdpbf16ps does 32 bf16 products and 32 adds = 64 flops.
// STREAM bytes follow STREAM: copy counts 16 B per double element (read + write), triad 24 B; no
// write-allocate traffic is counted. Memory is 2 MiB-aligned, madvise(MADV_HUGEPAGE), touched first.
//
// Robust under load: each limit is the best of many short trials. Compute peaks are timed by each
// thread's own CPU clock (CLOCK_THREAD_CPUTIME_ID), which stops while the thread is descheduled: a
// wall clock on a shared, oversubscribed machine measures the other tenants as much as the core,
// and understated peaks would overstate every of_limit. STREAM stays on the wall clock (memory is
// shared by the threads, see measure_stream).
#pragma once

#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "common/peers.hpp"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessel_bench {

// ---- memory ----------------------------------------------------------------------------------
// A 2 MiB-aligned buffer backed by transparent huge pages, touched by `threads` threads (each its
// share) so timing never includes page faults.
template <class T>
class huge_buffer {
 public:
  huge_buffer() = default;
  explicit huge_buffer(std::size_t n, unsigned threads = 1) : n_(n) {
    constexpr std::size_t align = std::size_t(2) << 20;
    const std::size_t bytes = std::max<std::size_t>(align, (n * sizeof(T) + align - 1) / align * align);
    p_ = static_cast<T*>(std::aligned_alloc(align, bytes));
    if (!p_) throw std::bad_alloc();
    ::madvise(p_, bytes, MADV_HUGEPAGE);
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([this, bytes, t, threads] {
        const std::size_t lo = bytes * t / threads, hi = bytes * (t + 1) / threads;
        std::memset(reinterpret_cast<char*>(p_) + lo, 0, hi - lo);
      });
    for (auto& th : ts) th.join();
  }
  huge_buffer(huge_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  huge_buffer& operator=(huge_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~huge_buffer() { std::free(p_); }
  T* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  T& operator[](std::size_t i) const noexcept { return p_[i]; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

// Seconds of CPU time the calling thread has used.
inline double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

// Timing of one run_threads_timed call: wall seconds from the common start until all finished,
// and each thread's own CPU seconds for its f (descheduled time excluded).
struct thread_timing {
  double wall = 0;
  std::vector<double> cpu;
  double cpu_max() const { return cpu.empty() ? 0.0 : *std::max_element(cpu.begin(), cpu.end()); }
};

// Runs f(thread_index) on `threads` threads (the caller is thread 0) released together. Waits
// yield, so that a 2-core machine is never oversubscribed by spinning threads.
template <class F>
thread_timing run_threads_timed(unsigned threads, F&& f) {
  std::atomic<unsigned> ready{0};
  std::atomic<bool> go{false};
  thread_timing r;
  r.cpu.assign(threads, 0.0);
  auto body = [&](unsigned t) {
    const double c0 = thread_cpu_seconds();
    f(t);
    r.cpu[t] = thread_cpu_seconds() - c0;
  };
  std::vector<std::thread> ts;
  for (unsigned t = 1; t < threads; ++t)
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      body(t);
    });
  while (ready.load() + 1 < threads) std::this_thread::yield();
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  body(0u);
  for (auto& th : ts) th.join();
  r.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// As run_threads_timed; returns the wall seconds only.
template <class F>
double run_threads(unsigned threads, F&& f) {
  return run_threads_timed(threads, std::forward<F>(f)).wall;
}

namespace detail {
inline volatile float sink;
inline volatile float seed_a = 1.0000001f, seed_b = 0.9999999f;

// 16 independent accumulators hide the FMA latency on both FMA pipes.
#if defined(__AVX512F__)
__attribute__((noinline)) inline void fma_avx512(std::uint64_t iters) {
  const __m512 a = _mm512_set1_ps(seed_a), b = _mm512_set1_ps(seed_b);
  __m512 c[16];
  for (auto& x : c) x = _mm512_set1_ps(0.0f);
  for (std::uint64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm512_fmadd_ps(a, x, b);
  __m512 s = c[0];
  for (int k = 1; k < 16; ++k) s = _mm512_add_ps(s, c[k]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);  // (not _mm512_reduce_add_ps: GCC 12 warns inside it)
  sink = out[0];
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
__attribute__((noinline)) inline void fma_avx2(std::uint64_t iters) {
  const __m256 a = _mm256_set1_ps(seed_a), b = _mm256_set1_ps(seed_b);
  __m256 c[16];
  for (auto& x : c) x = _mm256_set1_ps(0.0f);
  for (std::uint64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm256_fmadd_ps(a, x, b);
  __m256 s = c[0];
  for (int k = 1; k < 16; ++k) s = _mm256_add_ps(s, c[k]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  sink = out[0];
}
#endif
#if defined(__AVX512BF16__)
__attribute__((noinline)) inline void dot_bf16(std::uint64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3F81);
  __m512 c[16];
  for (auto& x : c) x = _mm512_set1_ps(seed_a);
  for (std::uint64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm512_dpbf16_ps(x, a, b);
  __m512 s = c[0];
  for (int k = 1; k < 16; ++k) s = _mm512_add_ps(s, c[k]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);  // (not _mm512_reduce_add_ps: GCC 12 warns inside it)
  sink = out[0];
}
#endif
}  // namespace detail

// ---- compute peaks (GFLOP/s); 0 when the ISA is not compiled in ------------------------------
enum class peak_kind { fp32_fma_avx512, fp32_fma_avx2, bf16_dot };

// One timed run: `iters` inner iterations per thread. Returns GFLOP/s.
inline double measure_peak(peak_kind k, unsigned threads, std::uint64_t iters) {
  double flops_per_iter = 0;
  void (*fn)(std::uint64_t) = nullptr;
  switch (k) {
#if defined(__AVX512F__)
    case peak_kind::fp32_fma_avx512:
      fn = detail::fma_avx512;
      flops_per_iter = 16 * 16 * 2;
      break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case peak_kind::fp32_fma_avx2:
      fn = detail::fma_avx2;
      flops_per_iter = 16 * 8 * 2;
      break;
#endif
#if defined(__AVX512BF16__)
    case peak_kind::bf16_dot:
      fn = detail::dot_bf16;
      flops_per_iter = 16 * 64;
      break;
#endif
    default: return 0.0;
  }
  // each thread's rate on its own CPU clock, summed: cores do not share FMA units, so time a
  // thread spent descheduled (another tenant on its core) is not the core's limit
  const auto t = run_threads_timed(threads, [&](unsigned) { fn(iters); });
  double rate = 0;
  for (double c : t.cpu) rate += c > 0 ? flops_per_iter * double(iters) / c : 0.0;
  return rate * 1e-9;
}

// ---- STREAM (GB/s) -----------------------------------------------------------------------------
enum class stream_kind { copy, triad };

struct stream_arrays {
  static constexpr std::size_t n = (std::size_t(128) << 20) / sizeof(double);  // 128 MiB each
  huge_buffer<double> a, b, c;
  stream_arrays() : a(n, 2), b(n, 2), c(n, 2) {
    for (std::size_t i = 0; i < n; ++i) a[i] = 1.0, b[i] = 2.0, c[i] = 0.5;
  }
  static stream_arrays& get() {
    static stream_arrays s;
    return s;
  }
};

// One timed pass over the arrays split among `threads`. Returns GB/s (STREAM byte counting).
inline double measure_stream(stream_kind k, unsigned threads) {
  auto& s = stream_arrays::get();
  const std::size_t n = s.n;
  double* __restrict a = s.a.data();
  double* __restrict b = s.b.data();
  double* __restrict c = s.c.data();
  const double q = 3.0;
  const auto tm = run_threads_timed(threads, [&](unsigned t) {
    const std::size_t lo = n * t / threads, hi = n * (t + 1) / threads;
    if (k == stream_kind::copy)
      for (std::size_t i = lo; i < hi; ++i) c[i] = a[i];
    else
      for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + q * c[i];
  });
  // wall clock: memory is shared, so CPU clocks would credit a thread that ran while its peer was
  // descheduled with the whole bandwidth (2 threads read ~2x STREAM that way); the best of several
  // short passes is the undisturbed one
  const double bytes = double(n) * sizeof(double) * (k == stream_kind::copy ? 2 : 3);
  return bytes / tm.wall * 1e-9;
}

// ---- cached limits -----------------------------------------------------------------------------
struct machine_limits {
  double fp32_fma_avx512[2]{}, fp32_fma_avx2[2]{}, bf16_dot[2]{};  // GFLOP/s, [threads-1]
  double stream_copy[2]{}, stream_triad[2]{};                      // GB/s,     [threads-1]
};

// Measured on first use (about 2 s): the best of many short trials each (a trial a few ms long
// is more likely to run undisturbed than one long run).
inline const machine_limits& limits() {
  static const machine_limits m = [] {
    machine_limits r;
    constexpr std::uint64_t iters = 250'000;  // ~4-8 ms per trial at ~3-5 GHz
    constexpr int peak_trials = 12, stream_trials = 8;
    for (unsigned t = 1; t <= 2; ++t) {
      for (int rep = 0; rep < peak_trials; ++rep) {
        r.fp32_fma_avx512[t - 1] = std::max(r.fp32_fma_avx512[t - 1], measure_peak(peak_kind::fp32_fma_avx512, t, iters));
        r.fp32_fma_avx2[t - 1] = std::max(r.fp32_fma_avx2[t - 1], measure_peak(peak_kind::fp32_fma_avx2, t, iters));
        r.bf16_dot[t - 1] = std::max(r.bf16_dot[t - 1], measure_peak(peak_kind::bf16_dot, t, iters));
      }
      measure_stream(stream_kind::copy, t);  // warm
      for (int rep = 0; rep < stream_trials; ++rep) {
        r.stream_copy[t - 1] = std::max(r.stream_copy[t - 1], measure_stream(stream_kind::copy, t));
        r.stream_triad[t - 1] = std::max(r.stream_triad[t - 1], measure_stream(stream_kind::triad, t));
      }
    }
    return r;
  }();
  return m;
}

inline unsigned limit_index(unsigned threads) { return threads >= 2 ? 1 : 0; }
// Best FP32 peak for this build (AVX-512 when compiled in, else AVX2), GFLOP/s.
inline double peak_fp32_gflops(unsigned threads) {
  const auto& l = limits();
  return std::max(l.fp32_fma_avx512[limit_index(threads)], l.fp32_fma_avx2[limit_index(threads)]);
}
// BF16 dot peak where avx512_bf16 is compiled in, else the FP32 peak (the fallback's roof).
inline double peak_bf16_gflops(unsigned threads) {
  const double p = limits().bf16_dot[limit_index(threads)];
  return p > 0 ? p : peak_fp32_gflops(threads);
}
inline double stream_copy_gbs(unsigned threads) { return limits().stream_copy[limit_index(threads)]; }
inline double stream_triad_gbs(unsigned threads) { return limits().stream_triad[limit_index(threads)]; }

}  // namespace tessel_bench
