// Collective benchmarks. Threads transport, 2 ranks (2 threads of this process), all_reduce f32
// sum, with the bound measured side by side in every repetition.
//
// The bound. An all_reduce of S bytes per rank on 2 ranks sharing one memory must read both inputs
// (2S) and write both outputs (2S) at least once: 4S bytes of memory traffic, half reads, half
// writes. Exactly that traffic is what the same 2 threads moving their own rank's input to its
// output cost: thread r copies in_r -> out_r (S read + S written each, 4S in all, same 1:1 mix, same
// buffers and pages). So no all_reduce can beat that copy: t_ar >= t_copy, i.e.
//   busbw (= algbw = S / t for n = 2) <= S / t_copy =: bound,   of_limit = busbw / bound.
// The copy is timed right after each repetition's all_reduce loop (same process, same minute,
// same buffers), the best of 3 passes each of streaming-store copy (arch::copy_streaming: 4S of
// traffic) and memcpy (glibc; ordinary stores also read each destination line, 6S, unless glibc
// streams): the fastest pass sets the bound, which makes of_limit conservative. Machine-wide
// STREAM copy on 2 threads (bench/common/limits.hpp, 128 MiB arrays) is measured in the same place
// and reported as `stream` with of_stream4 = busbw / (stream / 4), last session's bound (STREAM
// counts 2 bytes per element copied, not the write-allocate read; whether its loop allocates
// depends on the compiler, which is one reason the paired copy is the honest bound). On this VM
// the 2-thread STREAM figure swings between ~45 and ~85 GB/s from minute to minute, so only the
// paired bound is meaningful for the 70% target; for messages that fit in the cache (1-4 MiB) the
// copy runs from cache too and the bound is the cache's, not memory's, and at 16 MiB part of the
// 32 MiB of inputs stays in the 32 MiB L3 between iterations, so of_limit can pass 1 there.
// The threads2_nostream cases run the same algorithm with ordinary stores only (16, 64 MiB).
//
// busbw = algbw * 2(n-1)/n (nccl-tests), = algbw for n = 2.
//
// MPI side by side: run the same binary under `mpirun -np 2 bench_collectives`: it then times
// OpenMPI's MPI_Allreduce (impl "mpi") and tessel over the MPI transport (impl "tessel", transport
// mpi) on 2 processes. Names: all_reduce/<impl>/<transport>2/f32/<bytes>.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <tessel/arch/copy.hpp>
#include <tessel/collectives.hpp>
#if TESSEL_HAVE_MPI
#include <tessel/collectives/transport/mpi.hpp>
#endif

#include "common/limits.hpp"

using namespace tessel;

namespace {

constexpr int warmup = 2;

int iterations_for(std::size_t bytes) { return bytes >= (std::size_t{64} << 20) ? 8 : bytes >= (std::size_t{16} << 20) ? 20 : 60; }

// bytes_per_second = algbw; busbw = algbw * 2(n-1)/n (nccl-tests); of_limit = busbw / (STREAM copy(2 threads) / 4).
void set_counters(benchmark::State& state, std::size_t bytes, int n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  const double factor = 2.0 * (n - 1) / n;
  state.counters["busbw"] =
      benchmark::Counter(static_cast<double>(bytes) * factor, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  const double bound = tessel_bench::stream_copy_gbs(2) * 1e9 / 4;  // bytes/s
  state.counters["of_limit"] = benchmark::Counter(static_cast<double>(bytes) * factor / bound, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bound_GBps"] = bound / 1e9;
}

// The paired bound (see the top of this file): best time of 2 threads each copying its rank's
// input to its output, streaming stores or memcpy.
double paired_copy_seconds(float* const in[2], float* const out[2], std::size_t bytes) {
  double best = 1e30;
  for (int streaming = 0; streaming < 2; ++streaming)
    for (int pass = 0; pass < 3; ++pass)
      best = std::min(best, tessel_bench::run_threads(2, [&](unsigned t) {
                        if (streaming) {
                          tessel::arch::copy_streaming(out[t], in[t], bytes);
                          tessel::arch::store_fence();
                        } else {
                          std::memcpy(out[t], in[t], bytes);
                        }
                      }));
  return best;
}

// Threads transport: this thread is rank 0, a helper thread is rank 1; both run warmup + the
// fixed iteration count so they always pair up. TESSEL_BENCH_SPIN_US sets the transport's spin
// time (experiments; default: the transport's).
void bm_threads(benchmark::State& state, algorithm algo, bool streaming = true) {
  // streaming == false: the same algorithm with ordinary stores only (what streaming stores buy)
  tessel::detail::ar_stream_above = streaming ? 0 : SIZE_MAX;
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t count = bytes / sizeof(float);
  const int iters = static_cast<int>(state.max_iterations);
  threads_world w(2);
  if (const char* e = std::getenv("TESSEL_BENCH_SPIN_US")) w.set_spin(std::chrono::microseconds(std::atoi(e)));
  tessel_bench::huge_buffer<float> s0(count), r0(count), s1(count), r1(count);
  for (std::size_t i = 0; i < count; ++i) s0[i] = s1[i] = static_cast<float>(i % 13);
  std::thread peer([&] {
    communicator c(w.transport(1));
    for (int i = 0; i < warmup + iters; ++i) c.all_reduce(s1.data(), r1.data(), count, dtype::f32, reduce_op::sum, {algo});
  });
  communicator c(w.transport(0));
  for (int i = 0; i < warmup; ++i) c.all_reduce(s0.data(), r0.data(), count, dtype::f32, reduce_op::sum, {algo});
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    c.all_reduce(s0.data(), r0.data(), count, dtype::f32, reduce_op::sum, {algo});
    benchmark::ClobberMemory();
  }
  const double t_ar = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  peer.join();
  float* const in[2] = {s0.data(), s1.data()};
  float* const out[2] = {r0.data(), r1.data()};
  const double t_copy = paired_copy_seconds(in, out, bytes);
  double stream = 0;
  for (int k = 0; k < 2; ++k) stream = std::max(stream, tessel_bench::measure_stream(tessel_bench::stream_kind::copy, 2));
  const double busbw = static_cast<double>(bytes) / t_ar;  // n = 2: factor 2(n-1)/n = 1
  const double bound = static_cast<double>(bytes) / t_copy;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["busbw"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  // same units as busbw (binary prefixes, as Google Benchmark prints rates with kIs1024)
  state.counters["bound"] = benchmark::Counter(bound, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  state.counters["of_limit"] = busbw / bound;
  state.counters["stream"] = benchmark::Counter(stream * 1e9, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  state.counters["of_stream4"] = busbw / (stream * 1e9 / 4);
  tessel::detail::ar_stream_above = 0;
}

#if TESSEL_HAVE_MPI
void bm_mpi_native(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)), count = bytes / sizeof(float);
  tessel_bench::huge_buffer<float> s(count), r(count);
  for (int i = 0; i < warmup; ++i) MPI_Allreduce(s.data(), r.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  for (auto _ : state) MPI_Allreduce(s.data(), r.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  set_counters(state, bytes, 2);
}
void bm_mpi_tessel(benchmark::State& state) {
  static communicator c(mpi_transport(MPI_COMM_WORLD));
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)), count = bytes / sizeof(float);
  tessel_bench::huge_buffer<float> s(count), r(count);
  for (int i = 0; i < warmup; ++i) c.all_reduce(s.data(), r.data(), count, dtype::f32, reduce_op::sum);
  for (auto _ : state) c.all_reduce(s.data(), r.data(), count, dtype::f32, reduce_op::sum);
  set_counters(state, bytes, 2);
}

class silent_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};
#endif

const std::size_t sizes[] = {std::size_t{1} << 20, std::size_t{4} << 20, std::size_t{16} << 20, std::size_t{64} << 20};

}  // namespace

int main(int argc, char** argv) {
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  if (!under_mpi) {
    (void)tessel_bench::limits();  // measure the machine first, outside any timing
    for (std::size_t b : sizes) {
      const std::string tail = "/f32/" + std::to_string(b);
      benchmark::RegisterBenchmark(("all_reduce/tessel/threads2" + tail).c_str(), bm_threads, algorithm::automatic, true)
          ->Arg(static_cast<std::int64_t>(b))
          ->Iterations(iterations_for(b))
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("all_reduce/tessel/threads2_ring" + tail).c_str(), bm_threads, algorithm::ring, true)
          ->Arg(static_cast<std::int64_t>(b))
          ->Iterations(iterations_for(b))
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      if (b >= (std::size_t{16} << 20))
        benchmark::RegisterBenchmark(("all_reduce/tessel/threads2_nostream" + tail).c_str(), bm_threads, algorithm::automatic, false)
            ->Arg(static_cast<std::int64_t>(b))
            ->Iterations(iterations_for(b))
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
    }
    benchmark::Initialize(&argc, argv);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  }
#if TESSEL_HAVE_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (std::size_t b : sizes) {
    const std::string tail = "/f32/" + std::to_string(b);
    benchmark::RegisterBenchmark(("all_reduce/mpi/mpi2" + tail).c_str(), bm_mpi_native)
        ->Arg(static_cast<std::int64_t>(b))
        ->Iterations(iterations_for(b))
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("all_reduce/tessel/mpi2" + tail).c_str(), bm_mpi_tessel)
        ->Arg(static_cast<std::int64_t>(b))
        ->Iterations(iterations_for(b))
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // only rank 0 reports: the others drop --benchmark_out* (they would truncate rank 0's file)
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (rank == 0 || std::strncmp(argv[i], "--benchmark_out", 15) != 0) args.push_back(argv[i]);
  int nargs = static_cast<int>(args.size());
  benchmark::Initialize(&nargs, args.data());
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    silent_reporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
#else
  std::fprintf(stderr, "bench_collectives: built without MPI\n");
  return 1;
#endif
}
