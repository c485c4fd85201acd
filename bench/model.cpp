// bench_model: one training step of a ~20M-parameter Llama-style decoder (issue 17's small model:
// d 512, 4 layers, 8 heads, 4 kv heads, vocab 8192, intermediate 1408, batch 4 x sequence 512):
// zero_grad + forward + cross-entropy + backward + one fused AdamW step, in f32 and in bf16 (bf16
// GEMMs/attention, f32 masters), on 1 and 2 threads; and the forward alone (prefill).
//
// Counters: tokens/s, model FLOP/s = 6·N_matmul per token (N_matmul: every weight a GEMM reads,
// the LM head included, embeddings' lookups excluded) + causal attention 6·S·q_dim per token and
// layer (forward 2 matmuls over S/2 keys on average, backward twice that), and of_limit = that
// rate / the machine's measured peak (bf16 dot for bf16, FP32 FMA for f32) on the same threads
// (bench/common/limits.hpp). Prefill counts 2·N_matmul + 2·S·q_dim per token and layer.
//
// PyTorch's step on the same model: tools/torch/bench_model.py; tools/bench-model runs both in
// alternation and prints the paired ratios. Run with --benchmark_repetitions=3 for min/median.
#include <benchmark/benchmark.h>

// tessel first: arch/target.hpp must be the first to include the intrinsic headers (GCC 12 warning).
#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/limits.hpp"

namespace {
using namespace tessel;

constexpr std::size_t batch = 4, seq = 512;

io::model_config small_model() {
  return io::parse_model_config(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": false})");
}

struct flops {
  double train = 0, prefill = 0;  // per token
};
flops model_flops(const io::model_config& c) {
  const double d = double(c.hidden_size), I = double(c.intermediate_size), qd = double(c.num_attention_heads * c.head_dim),
               kvd = double(c.num_key_value_heads * c.head_dim), L = double(c.num_hidden_layers), V = double(c.vocab_size);
  const double n_matmul = L * (d * qd + 2 * d * kvd + qd * d + 3 * d * I) + V * d;
  const double attn = L * double(seq) * qd;  // per token: 2 matmuls x 2 flops x S/2 keys x q_dim
  return {6 * n_matmul + 6 * attn, 2 * n_matmul + 2 * attn};
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

template <class T>
double peak(unsigned threads) {
  return std::is_same_v<T, bf16> ? tessel_bench::peak_bf16_gflops(threads) : tessel_bench::peak_fp32_gflops(threads);
}

template <class T>
void BM_train_step(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  host_device dev(threads);
  const auto cfg = small_model();
  nn::decoder_lm<host_device, T> m(dev, cfg);
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
  const double tokens = double(batch * seq) * double(st.iterations());
  const double rate = tokens * model_flops(cfg).train;
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["flops"] = benchmark::Counter(rate, benchmark::Counter::kIsRate);
  st.counters["of_limit"] = benchmark::Counter(rate / (peak<T>(threads) * 1e9), benchmark::Counter::kIsRate);
  st.counters["params"] = double(m.params().numel());
}

template <class T>
void BM_prefill(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  host_device dev(threads);
  const auto cfg = small_model();
  nn::decoder_lm<host_device, T> m(dev, cfg);
  m.init(1);
  const batch_data b;
  benchmark::DoNotOptimize(m.forward(b.ids, batch, seq).data());
  for (auto _ : st) benchmark::DoNotOptimize(m.forward(b.ids, batch, seq).data());
  const double tokens = double(batch * seq) * double(st.iterations());
  const double rate = tokens * model_flops(cfg).prefill;
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["flops"] = benchmark::Counter(rate, benchmark::Counter::kIsRate);
  st.counters["of_limit"] = benchmark::Counter(rate / (peak<T>(threads) * 1e9), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_train_step<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_train_step<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_prefill<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_prefill<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
