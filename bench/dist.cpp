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

#include <array>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
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

// Ranks on persistent threads, driven one step at a time by the benchmark loop. setup(t) runs once
// on each rank's thread and returns that rank's step, which returns its device's peak bytes.
class rank_rig {
 public:
  using step_fn = std::function<std::size_t()>;
  rank_rig(int ranks, std::function<step_fn(threads_transport)> setup) : go_(ranks + 1), done_(ranks + 1), ranks_(ranks), setup_(std::move(setup)) {
    runner_ = std::thread([this] {
      try {
        threads_world::run(ranks_, [this](threads_transport t) { rank_main(std::move(t)); });
      } catch (...) { fail(std::current_exception()); }
    });
    try {
      step();  // warm: buffers allocated, pages touched
    } catch (...) {
      finish();
      throw;
    }
  }
  ~rank_rig() { finish(); }
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
      const step_fn run = setup_(std::move(t));
      for (;;) {
        go_.arrive_and_wait();
        if (stop_) return;
        const std::size_t peak = run();
        if (first) peak_ = peak;
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
  const int ranks_;
  std::function<step_fn(threads_transport)> setup_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> peak_{0};
  std::mutex mu_;
  std::exception_ptr error_;
  std::thread runner_;
};

// A tp x pp replica of the model: each rank a stage's tp shard on a host_device of one thread.
template <class T>
struct tp_replica {
  tp_replica(threads_transport t, int tp, int pp, bool sp, std::size_t micro)
      : grp(std::move(t), {.tp = tp, .pp = pp}),
        dev(1),
        m(dev, tessel_bench::small_llama(), grp.tp(), {.sequence_parallel = sp, .pp = pp > 1 ? &grp.pp() : nullptr}),
        pipe((m.init(1), m), {.micro_batches = micro}) {}
  dist::process_groups grp;
  host_device dev;
  dist::tp_decoder_lm<host_device, T> m;
  dist::pipeline<dist::tp_decoder_lm<host_device, T>> pipe;
  tessel_bench::small_batch_data b;
  std::uint64_t step = 0;
};

template <class T>
rank_rig tp_rig(int tp, int pp, bool sp, std::size_t micro) {
  return rank_rig(tp * pp, [=](threads_transport t) -> rank_rig::step_fn {
    auto r = std::make_shared<tp_replica<T>>(std::move(t), tp, pp, sp, micro);
    return [r] {
      tessel_bench::train_step(r->pipe, r->b, ++r->step);
      return r->dev.memory().peak_in_use;
    };
  });
}

template <class T>
void BM_tp(benchmark::State& st) {
  const int tp = int(st.range(0));
  auto rig = tp_rig<T>(tp, 1, st.range(1) != 0, 1);
  for (auto _ : st) rig.step();
  report(st, double(tp), rig.peak_bytes());
}

BENCHMARK(BM_one_device<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_tp<float>)->Args({2, 0})->Args({2, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
template <class T>
void BM_pp(benchmark::State& st) {
  const int pp = int(st.range(0));
  auto rig = tp_rig<T>(1, pp, false, std::size_t(st.range(1)));
  for (auto _ : st) rig.step();
  report(st, double(pp), rig.peak_bytes());
}

BENCHMARK(BM_pp<float>)->Args({2, 4})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_one_device<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_tp<bf16>)->Args({2, 0})->Args({2, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

// Expert parallelism: a Mixtral block (8 SwiGLU experts, top 2, hidden 512, intermediate 1024) in
// f32, forward and backward on 1024 tokens per core:
//   BM_moe_one_device   nn::sparse_moe on one thread, every expert;
//   BM_ep/<ep>          dist::ep_moe over ep thread ranks of one thread each, every rank with its own
//                       1024 tokens and 8/ep experts (weak scaling: the tokens grow with the cores).
// The claim is tokens_per_core(BM_ep/2) / tokens_per_core(BM_moe_one_device): what dispatch,
// return and the routing exchanges cost.
constexpr std::size_t moe_d = 512, moe_inter = 1024, moe_experts = 8, moe_top_k = 2, moe_tokens = 1024;

template <class Block, class... Extra>
struct moe_rank {
  moe_rank(std::size_t first, std::size_t count, Extra&... extra) : dev(1), reg(dev) {
    nn::parameter<host_device>& router = reg.add("gate.weight", {moe_experts, moe_d});
    std::vector<std::array<nn::parameter<host_device>*, 3>> ex;
    for (std::size_t j = first; j < first + count; ++j) {
      const std::string e = "experts." + std::to_string(j) + ".";
      auto* w1 = &reg.add(e + "w1.weight", {moe_inter, moe_d});
      auto* w3 = &reg.add(e + "w3.weight", {moe_inter, moe_d});
      ex.push_back({w1, w3, &reg.add(e + "w2.weight", {moe_d, moe_inter})});
    }
    reg.init_normal(first + 1, 0.05);
    if constexpr (sizeof...(Extra) == 0)
      block = Block(&router, std::move(ex), moe_d, moe_inter, moe_top_k);
    else
      block = Block(&router, std::move(ex), moe_d, moe_inter, moe_experts, moe_top_k, extra...);
    nn::normal_rng g(first + 7);
    for (auto* v : {&x, &dy}) {
      v->resize(moe_tokens * moe_d);
      for (float& f : *v) f = float(g());
    }
    y.resize(x.size()), dx.resize(x.size());
  }
  std::size_t step() {
    block.forward(dev, nn::cview<float>(x.data(), moe_tokens, moe_d), nn::mview<float>(y.data(), moe_tokens, moe_d), true);
    block.backward(dev, nn::cview<float>(dy.data(), moe_tokens, moe_d), nn::mview<float>(dx.data(), moe_tokens, moe_d), {});
    return dev.memory().peak_in_use;
  }
  host_device dev;
  nn::parameters<host_device> reg;
  Block block;
  std::vector<float> x, dy, y, dx;
};

void moe_report(benchmark::State& st, double cores, std::size_t peak) {
  st.counters["MiB_per_rank"] = double(peak) / double(1 << 20);
  const double tokens = double(moe_tokens) * cores * double(st.iterations());
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["tokens_per_core"] = benchmark::Counter(tokens / cores, benchmark::Counter::kIsRate);
}

void BM_moe_one_device(benchmark::State& st) {
  moe_rank<nn::sparse_moe<host_device, float>> r(0, moe_experts);
  r.step();
  for (auto _ : st) r.step();
  moe_report(st, 1.0, r.dev.memory().peak_in_use);
}

void BM_ep(benchmark::State& st) {
  const int ep = int(st.range(0));
  rank_rig rig(ep, [ep](threads_transport t) -> rank_rig::step_fn {
    auto c = std::make_shared<communicator>(std::move(t));
    const auto [first, count] = dist::local_experts(moe_experts, ep, c->rank());
    auto r = std::make_shared<moe_rank<dist::ep_moe<host_device, float>, communicator>>(first, count, *c);
    return [r, c] { return r->step(); };
  });
  for (auto _ : st) rig.step();
  moe_report(st, double(ep), rig.peak_bytes());
}

BENCHMARK(BM_moe_one_device)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ep)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// Checkpoints (issue 20): the small Llama's training state after one AdamW step (f32 masters and
// both moments: 12 bytes a parameter, ~242 MB) saved to and loaded from a directory under the temp
// directory on one rank (dist::save_checkpoint / load_checkpoint: safetensors pieces, the manifest,
// the content hash written and verified), against writing and reading the same number of bytes as
// one plain file the same way (write(2), fsync, rename: the storage's own bound, measured in the
// same run). Counter: bytes_per_second.
struct ckpt_rig {
  ckpt_rig() : dev(1), world(1), comm(world.transport(0)), m(dev, tessel_bench::small_llama()) {
    m.init(1);
    tessel_bench::train_step(m, tessel_bench::small_batch_data{}, 1);
    for (auto& p : m.params()) bytes += 3 * p.numel * sizeof(float);
    dir = std::filesystem::temp_directory_path() / "tessel_bench_checkpoint";
  }
  ~ckpt_rig() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  host_device dev;
  threads_world world;
  communicator comm;
  nn::decoder_lm<host_device> m;
  std::size_t bytes = 0;
  std::filesystem::path dir;
};

void BM_checkpoint_save(benchmark::State& st) {
  ckpt_rig r;
  dist::save_checkpoint(r.dir, r.m, r.comm, {.step = 1});  // warm
  for (auto _ : st) dist::save_checkpoint(r.dir, r.m, r.comm, {.step = 1});
  st.counters["bytes_per_second"] = benchmark::Counter(double(r.bytes) * double(st.iterations()), benchmark::Counter::kIsRate);
}
void BM_checkpoint_load(benchmark::State& st) {
  ckpt_rig r;
  dist::save_checkpoint(r.dir, r.m, r.comm, {.step = 1});
  for (auto _ : st) benchmark::DoNotOptimize(dist::load_checkpoint(r.dir, r.m).step);
  st.counters["bytes_per_second"] = benchmark::Counter(double(r.bytes) * double(st.iterations()), benchmark::Counter::kIsRate);
}
void BM_file_write(benchmark::State& st) {
  ckpt_rig r;
  std::filesystem::create_directories(r.dir);
  std::vector<std::byte> buf;  // the same bytes as the checkpoint's tensors
  buf.reserve(r.bytes);
  for (auto& p : r.m.params())
    for (const auto* b : {&p.value, &p.m, &p.v}) {
      const auto bytes = std::as_bytes(b->cspan());
      buf.insert(buf.end(), bytes.begin(), bytes.end());
    }
  auto write = [&] {  // as a checkpoint file is written: write(2) to a temporary name, fsync, renamed over the old one
    io::detail::atomic_file f(r.dir / "plain.bin");
    for (std::size_t at = 0; at < buf.size(); at += std::size_t(4) << 20)  // in 4 MiB writes (one 242 MB write(2) ran 2-3x slower here)
      f.write(std::span<const std::byte>(buf).subspan(at, std::min(std::size_t(4) << 20, buf.size() - at)));
    f.commit();
  };
  write();  // warm: the first write of a new file costs the file system more (both benchmarks skip it)
  for (auto _ : st) write();
  st.counters["bytes_per_second"] = benchmark::Counter(double(r.bytes) * double(st.iterations()), benchmark::Counter::kIsRate);
}
void BM_file_read(benchmark::State& st) {
  ckpt_rig r;
  std::filesystem::create_directories(r.dir);
  std::vector<char> buf(r.bytes, 1);
  {
    std::ofstream f(r.dir / "plain.bin", std::ios::binary | std::ios::trunc);
    f.write(buf.data(), std::streamsize(buf.size()));
  }
  for (auto _ : st) {
    std::ifstream f(r.dir / "plain.bin", std::ios::binary);
    f.read(buf.data(), std::streamsize(buf.size()));
    benchmark::DoNotOptimize(buf.data());
  }
  st.counters["bytes_per_second"] = benchmark::Counter(double(r.bytes) * double(st.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_file_write)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_checkpoint_save)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_file_read)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_checkpoint_load)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
