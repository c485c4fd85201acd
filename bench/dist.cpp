// bench_dist: a tensor-parallel training step on thread ranks against the one-device step, side by
// side in one process (issue 18: "a tp=2 training step reaches at least 0.85 of the single-device
// step's throughput per core at a size where compute dominates").
//
// The model is bench_model's (~20M-parameter Llama: d 512, 4 layers, 8 heads, 4 kv heads, vocab
// 8192, intermediate 1408), batch 4 x sequence 512, one step = zero_grad + forward + loss +
// backward + AdamW, in f32 and bf16:
//   BM_one_device/<threads>  nn::decoder_lm on one host_device of 1 or 2 threads;
//   BM_tp/<tp>               dist::tp_decoder_lm on tp thread ranks (threads transport), each rank a
//                            host_device of 1 thread: tp cores in all.
// Counters: tokens/s, tokens_per_core (tokens/s divided by the cores the step uses) and
// model FLOP/s (bench_model's count). The claim is the ratio tokens_per_core(BM_tp/2) /
// tokens_per_core(BM_one_device/1) of one run; tools/bench-dist... is not needed: run with
// --benchmark_repetitions=3 --benchmark_report_aggregates_only=false and read min/median.
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
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace {
using namespace tessel;

constexpr std::size_t batch = 4, seq = 512;

io::model_config small_model() {
  return io::parse_model_config(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": false})");
}

// Per token: 6·(every weight a GEMM reads, the LM head included) + causal attention 6·S·q_dim per layer.
double train_flops_per_token(const io::model_config& c) {
  const double d = double(c.hidden_size), I = double(c.intermediate_size), qd = double(c.num_attention_heads * c.head_dim),
               kvd = double(c.num_key_value_heads * c.head_dim), L = double(c.num_hidden_layers), V = double(c.vocab_size);
  return 6 * (L * (d * qd + 2 * d * kvd + qd * d + 3 * d * I) + V * d) + 6 * L * double(seq) * qd;
}

struct batch_data {
  std::vector<std::int64_t> ids, targets;
  batch_data() : ids(batch * seq), targets(batch * seq) {
    std::uint64_t s = 1;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      ids[i] = std::int64_t((s >> 33) % 8192);
      targets[i] = std::int64_t((s >> 13) % 8192);
    }
  }
};

void report(benchmark::State& st, double cores) {
  const double tokens = double(batch * seq) * double(st.iterations());
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["tokens_per_core"] = benchmark::Counter(tokens / cores, benchmark::Counter::kIsRate);
  st.counters["flops"] = benchmark::Counter(tokens * train_flops_per_token(small_model()), benchmark::Counter::kIsRate);
}

template <class T>
void BM_one_device(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  host_device dev(threads);
  nn::decoder_lm<host_device, T> m(dev, small_model());
  m.init(1);
  const batch_data b;
  nn::adamw_config h;
  h.hyper.lr = 1e-4f;
  std::uint64_t step = 0;
  auto one = [&] {
    m.params().zero_grad();
    benchmark::DoNotOptimize(m.forward_backward(b.ids, b.targets, batch, seq));
    m.adamw(h, ++step);
  };
  one();  // warm: buffers allocated, pages touched
  for (auto _ : st) one();
  report(st, double(threads));
}

// tp ranks on persistent threads, driven one step at a time by the benchmark loop.
template <class T>
class tp_rig {
 public:
  explicit tp_rig(int tp) : go_(tp + 1), done_(tp + 1) {
    runner_ = std::thread([this, tp] {
      try {
        threads_world::run(tp, [this](threads_transport t) { rank_main(std::move(t)); });
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
  void step() {
    go_.arrive_and_wait();
    done_.arrive_and_wait();
    std::lock_guard lk(mu_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void rank_main(threads_transport t) {
    try {
      communicator tp(std::move(t));
      host_device dev(1);
      dist::tp_decoder_lm<host_device, T> m(dev, small_model(), tp);
      m.init(1);
      const batch_data b;
      nn::adamw_config h;
      h.hyper.lr = 1e-4f;
      for (std::uint64_t step = 1;; ++step) {
        go_.arrive_and_wait();
        if (stop_) return;
        m.params().zero_grad();
        benchmark::DoNotOptimize(m.forward_backward(b.ids, b.targets, batch, seq));
        m.adamw(h, step);
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
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::exception_ptr error_;
  std::thread runner_;
};

template <class T>
void BM_tp(benchmark::State& st) {
  const int tp = int(st.range(0));
  tp_rig<T> rig(tp);
  for (auto _ : st) rig.step();
  report(st, double(tp));
}

BENCHMARK(BM_one_device<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_tp<float>)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_one_device<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_tp<bf16>)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
