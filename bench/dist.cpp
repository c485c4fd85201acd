// bench_dist: a tensor-parallel training step on thread ranks against the one-device step, side by
// side in one process (issue 18: "a tp=2 training step reaches at least 0.85 of the single-device
// step's throughput per core at a size where compute dominates").
//
// The model is bench_model's (common/small_llama.hpp: ~20M-parameter Llama, batch 4 x sequence
// 512), one step = zero_grad + forward + loss + backward + AdamW, in f32 and bf16:
//   BM_one_device/<threads>  nn::decoder_lm on one host_device of 1 or 2 threads;
//   BM_tp/<tp>/<sp>          dist::tp_decoder_lm on tp thread ranks (threads transport), each rank a
//                            host_device of 1 thread: tp cores in all; sp = 1 with sequence
//                            parallelism (the stream, norms and residual adds split by tokens);
//   BM_pp/<pp>/<micro>       the model cut into pp pipeline stages (one thread each), the batch into
//                            `micro` micro-batches, dist::pipeline's 1F1B schedule with recomputed
//                            activations: its ideal is (1 − bubble (p−1)/(m+p−1)) · 3/4 (one forward
//                            of four passes recomputed; the last stage's is not) of one device.
// Counters: tokens/s, tokens_per_core (tokens/s divided by the cores the step uses), model FLOP/s
// (bench_model's count) and MiB_per_rank (the device's peak bytes in use on rank 0: parameters,
// gradients, moments, activations and scratch). The claim is the ratio tokens_per_core(BM_tp/2) /
// tokens_per_core(BM_one_device/1) within one run: run with --benchmark_repetitions=3 and read
// the min and the median.
//
// The tp ranks live for the whole benchmark (persistent threads): each iteration releases them
// through a barrier and waits for both to finish the step, so thread start-up is not timed.
#include <benchmark/benchmark.h>

// tessel first: arch/target.hpp must be the first to include the intrinsic headers (GCC 12 warning).
#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "common/small_llama.hpp"

namespace {
using namespace tessel;

using tessel_bench::small_batch, tessel_bench::small_seq;

void report(benchmark::State& st, double cores, std::size_t peak_bytes) {
  st.counters["MiB_per_rank"] = double(peak_bytes) / double(1 << 20);
  const double tokens = double(small_batch * small_seq) * double(st.iterations());
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["tokens_per_core"] = benchmark::Counter(tokens / cores, benchmark::Counter::kIsRate);
  st.counters["flops"] = benchmark::Counter(tokens * tessel_bench::flops_per_token(tessel_bench::small_llama()).train, benchmark::Counter::kIsRate);
}

template <class T>
void BM_one_device(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  host_device dev(threads);
  nn::decoder_lm<host_device, T> m(dev, tessel_bench::small_llama());
  m.init(1);
  const tessel_bench::small_batch_data b;
  std::uint64_t step = 0;
  tessel_bench::train_step(m, b, ++step);  // warm: buffers allocated, pages touched
  for (auto _ : st) tessel_bench::train_step(m, b, ++step);
  report(st, double(threads), dev.memory().peak_in_use);
}

// tp x pp ranks on persistent threads, driven one step at a time by the benchmark loop.
template <class T>
class tp_rig {
 public:
  tp_rig(int tp, int pp, bool sp, std::size_t micro) : go_(tp * pp + 1), done_(tp * pp + 1), tp_(tp), pp_(pp), sp_(sp), micro_(micro) {
    runner_ = std::thread([this] {
      try {
        threads_world::run(tp_ * pp_, [this](threads_transport t) { rank_main(std::move(t)); });
      } catch (...) {
        fail(std::current_exception());
      }
    });
    try {
      step();  // warm: buffers allocated, pages touched
    } catch (...) {
      finish();
      throw;
    }
  }
  ~tp_rig() { finish(); }
  std::size_t peak_bytes() const { return peak_; }
  void step() {
    go_.arrive_and_wait();
    done_.arrive_and_wait();
    std::lock_guard lk(mu_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void rank_main(threads_transport t) {
    try {
      const bool first = t.rank() == 0;
      dist::process_groups grp(std::move(t), {.tp = tp_, .pp = pp_});
      host_device dev(1);
      dist::tp_decoder_lm<host_device, T> m(dev, tessel_bench::small_llama(), grp.tp(), {.sequence_parallel = sp_, .pp = pp_ > 1 ? &grp.pp() : nullptr});
      m.init(1);
      dist::pipeline pipe(m, {.micro_batches = micro_});
      const tessel_bench::small_batch_data b;
      for (std::uint64_t step = 1;; ++step) {
        go_.arrive_and_wait();
        if (stop_) return;
        tessel_bench::train_step(pipe, b, step);
        if (first) peak_ = dev.memory().peak_in_use;
        done_.arrive_and_wait();
      }
    } catch (...) {
      // Leave both barriers (an arrival in the current phase of each, one participant fewer
      // after), so the driver never waits for this rank again; the world then aborts its peers,
      // which leave the same way.
      fail(std::current_exception());
      go_.arrive_and_drop();
      done_.arrive_and_drop();
      throw;
    }
  }
  void finish() {
    if (!runner_.joinable()) return;
    stop_ = true;
    go_.arrive_and_wait();
    runner_.join();
  }
  void fail(std::exception_ptr e) {
    std::lock_guard lk(mu_);
    if (!error_) error_ = e;
  }
  std::barrier<> go_, done_;
  const int tp_, pp_;
  const bool sp_;
  const std::size_t micro_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> peak_{0};
  std::mutex mu_;
  std::exception_ptr error_;
  std::thread runner_;
};

template <class T>
void BM_tp(benchmark::State& st) {
  const int tp = int(st.range(0));
  tp_rig<T> rig(tp, 1, st.range(1) != 0, 1);
  for (auto _ : st) rig.step();
  report(st, double(tp), rig.peak_bytes());
}

BENCHMARK(BM_one_device<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_tp<float>)->Args({2, 0})->Args({2, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
template <class T>
void BM_pp(benchmark::State& st) {
  const int pp = int(st.range(0));
  tp_rig<T> rig(1, pp, false, std::size_t(st.range(1)));
  for (auto _ : st) rig.step();
  report(st, double(pp), rig.peak_bytes());
}

BENCHMARK(BM_pp<float>)->Args({2, 4})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_one_device<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_tp<bf16>)->Args({2, 0})->Args({2, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
