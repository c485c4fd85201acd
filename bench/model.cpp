// bench_model: one training step of a ~20M-parameter Llama-style decoder (issue 17's small model:
// d 512, 4 layers, 8 heads, 4 kv heads, vocab 8192, intermediate 1408, batch 4 x sequence 512):
// zero_grad + forward + cross-entropy + backward + one fused AdamW step, in f32 and in bf16 (bf16
// GEMMs/attention, f32 masters), on 1 and 2 threads; and the forward alone (prefill). The same for
// its Mixtral-style twin (_moe: 8 experts of the same width, top 2), the dense model with FP8
// projections (_fp8) and the Mixtral-style one with FP8 projections and experts (_moe_fp8); the
// bf16 step under each activation recompute mode (_recompute); decode with the KV cache for 1
// to 16 sequences at once (BM_decode; BM_decode_large on a ~160M-parameter model whose weights
// do not fit in cache); and a 64-token turn after a cached history, one extend against 64 decode
// steps (BM_turn).
//
// Counters: tokens/s, model FLOP/s = 6·N_matmul per token (N_matmul: every weight a GEMM reads,
// the LM head included, embeddings' lookups excluded) + causal attention 6·S·q_dim per token and
// layer (forward 2 matmuls over S/2 keys on average, backward twice that), and of_limit = that
// rate / the machine's measured peak (bf16 dot for bf16, FP32 FMA for f32) on the same threads
// (bench/common/limits.hpp). Prefill counts 2·N_matmul + 2·S·q_dim per token and layer.
// peak_MiB (training steps): the process's peak resident memory above its level before the device
// and model were built (bench/common/memory.hpp): masters, bf16 copies, gradients, moments,
// activations and workspaces; bench_model.py --memory measures PyTorch's step the same way. Run one
// such benchmark per process (--benchmark_filter): pages an earlier benchmark freed may stay
// resident and raise the next one's starting level (tools/bench-model does so).
//
// PyTorch's step on the same model: tools/torch/bench_model.py; tools/bench-model runs both in
// alternation and prints the paired ratios. Run with --benchmark_repetitions=3 for min/median.
#include <benchmark/benchmark.h>

// tessel first: arch/target.hpp must be the first to include the intrinsic headers (GCC 12 warning).
#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/limits.hpp"
#include "common/memory.hpp"
#include "common/small_llama.hpp"

namespace {
using namespace tessel;
using tessel_bench::small_batch, tessel_bench::small_seq;

template <class T>
double peak(unsigned threads) {
  return std::is_same_v<T, bf16> ? tessel_bench::peak_bf16_gflops(threads) : tessel_bench::peak_fp32_gflops(threads);
}

// The blocks' projections in the compute type, FP8 or fp16 (with a loss scaler, as fp16 needs).
template <nn::linear_precision P, class T>
void set_linears(nn::decoder_lm<host_device, T>& m) {
  m.set_fp8_linears(P == nn::linear_precision::fp8);
  if constexpr (P == nn::linear_precision::fp16) {
    m.set_fp16_linears(true);
    m.set_loss_scaler(loss_scaler());
  }
}

template <class T, bool Moe = false, nn::linear_precision P = nn::linear_precision::compute>
void BM_train_step(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  const tessel_bench::peak_meter mem;
  host_device dev(threads);
  const auto cfg = Moe ? tessel_bench::small_mixtral() : tessel_bench::small_llama();
  nn::decoder_lm<host_device, T> m(dev, cfg);
  m.init(1);
  set_linears<P>(m);
  const tessel_bench::small_batch_data b;
  std::uint64_t step = 0;
  tessel_bench::train_step(m, b, ++step);  // warm: buffers allocated, pages touched
  for (auto _ : st) tessel_bench::train_step(m, b, ++step);
  const double tokens = double(small_batch * small_seq) * double(st.iterations());
  const double rate = tokens * tessel_bench::flops_per_token(cfg).train;
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["flops"] = benchmark::Counter(rate, benchmark::Counter::kIsRate);
  st.counters["of_limit"] = benchmark::Counter(rate / (peak<T>(threads) * 1e9), benchmark::Counter::kIsRate);
  st.counters["params"] = double(m.params().numel());
  st.counters["peak_MiB"] = mem.mib();
}

// The dense bf16 model's step under each recompute mode (range 0: 0 none, 1 attention, 2 blocks)
// and LM-head chunk (range 1: rows per chunk, 0 all), 2 threads; act_MiB = the step's planned
// activation arena (decoder_lm::activation_bytes), per_tensor_MiB = the same tensors with one
// buffer each, act_ratio = their ratio (the arena's saving is 1 - act_ratio), act_vs_bound = the
// arena over the most bytes live in one phase (1: no plan can take less).
void BM_train_step_recompute(benchmark::State& st) {
  const tessel_bench::peak_meter mem;
  host_device dev(2);
  const auto cfg = tessel_bench::small_llama();
  nn::decoder_lm<host_device, bf16> m(dev, cfg);
  m.init(1);
  m.set_recompute(static_cast<nn::recompute>(st.range(0)));
  m.set_head_chunk_rows(std::size_t(st.range(1)));
  const tessel_bench::small_batch_data b;
  std::uint64_t step = 0;
  tessel_bench::train_step(m, b, ++step);
  for (auto _ : st) tessel_bench::train_step(m, b, ++step);
  const double tokens = double(small_batch * small_seq) * double(st.iterations());
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["act_MiB"] = double(m.activation_bytes()) / double(1 << 20);
  st.counters["per_tensor_MiB"] = double(m.activation_bytes_per_tensor()) / double(1 << 20);
  st.counters["act_ratio"] = double(m.activation_bytes()) / double(m.activation_bytes_per_tensor());
  st.counters["act_vs_bound"] = m.activation_plan().vs_lower_bound();  // the arena over the most bytes live in one phase
  st.counters["peak_MiB"] = mem.mib();
}

template <class T, bool Moe = false, nn::linear_precision P = nn::linear_precision::compute>
void BM_prefill(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  host_device dev(threads);
  const auto cfg = Moe ? tessel_bench::small_mixtral() : tessel_bench::small_llama();
  nn::decoder_lm<host_device, T> m(dev, cfg);
  m.init(1);
  set_linears<P>(m);
  const tessel_bench::small_batch_data b;
  benchmark::DoNotOptimize(m.forward(b.ids, small_batch, small_seq).data());
  for (auto _ : st) benchmark::DoNotOptimize(m.forward(b.ids, small_batch, small_seq).data());
  const double tokens = double(small_batch * small_seq) * double(st.iterations());
  const double rate = tokens * tessel_bench::flops_per_token(cfg).prefill;
  st.counters["tokens"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  st.counters["flops"] = benchmark::Counter(rate, benchmark::Counter::kIsRate);
  st.counters["of_limit"] = benchmark::Counter(rate / (peak<T>(threads) * 1e9), benchmark::Counter::kIsRate);
}

// Decode with the KV cache: `batch` sequences (range 1) of the small model, each prefilled with a
// 256-token prompt, then one decode_step per iteration for all of them (every 224 steps the
// sequences start again from their prompts, outside the timing, so contexts stay in 257..480).
// A decode step reads every GEMM weight once (N_matmul elements of T, shared by the batch) and each
// sequence's cached K and V; bytes = those per step, and of_stream = bytes/s over the machine's
// measured STREAM copy rate on the same threads: the memory bound of the step. tokens = new
// tokens per second (batch per step): batched decode's scaling. The small model's bf16 weights
// (32 MB) partly stay in the last-level cache (32 MiB) between tokens, so its of_stream may pass 1;
// BM_decode_large's (medium_llama, 250 MB of bf16 weights) come from memory.
template <class T, bool Large = false>
void BM_decode(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  const std::size_t batch = std::size_t(st.range(1)), prompt = 256, steps = 224;
  host_device dev(threads);
  const auto cfg = Large ? tessel_bench::medium_llama() : tessel_bench::small_llama();
  nn::decoder_lm<host_device, T> m(dev, cfg);
  m.init(1);
  auto cache = m.make_cache(batch, batch * ((prompt + steps) / 16 + 1), 16);
  const tessel_bench::small_batch_data b;
  std::vector<std::int64_t> prompts, tokens(batch);
  for (std::size_t i = 0; i < batch; ++i)
    prompts.insert(prompts.end(), b.ids.begin() + std::ptrdiff_t(i % small_batch * small_seq),
                   b.ids.begin() + std::ptrdiff_t(i % small_batch * small_seq + prompt));
  const std::vector<std::size_t> lengths(batch, prompt);
  std::vector<std::size_t> seqs;
  auto restart = [&] {
    for (std::size_t id : seqs) cache.release(id);
    seqs.clear();
    for (std::size_t i = 0; i < batch; ++i) seqs.push_back(cache.add_sequence());
    (void)m.prefill(cache, seqs, prompts, lengths);
  };
  restart();
  const double kvd = double(cfg.num_key_value_heads * cfg.head_dim), L = double(cfg.num_hidden_layers);
  const double weights = tessel_bench::matmul_params(cfg) * double(sizeof(T));
  double bytes = 0;
  std::size_t step = 0;
  for (auto _ : st) {
    if (step == steps) {
      st.PauseTiming();
      restart();
      step = 0;
      st.ResumeTiming();
    }
    for (std::size_t i = 0; i < batch; ++i) tokens[i] = std::int64_t((step * 31 + i * 7) % cfg.vocab_size);
    benchmark::DoNotOptimize(m.decode_step(cache, seqs, tokens).data());
    // K and V of every layer, for the prompt, the steps so far and this token
    bytes += weights + double(batch) * L * 2 * double(prompt + step + 1) * kvd * double(sizeof(T));
    ++step;
  }
  const double tokens_done = double(batch) * double(st.iterations());
  st.counters["tokens"] = benchmark::Counter(tokens_done, benchmark::Counter::kIsRate);
  st.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kIsRate);
  st.counters["of_stream"] = benchmark::Counter(bytes / (tessel_bench::stream_copy_gbs(threads) * 1e9), benchmark::Counter::kIsRate);
}

// A conversation's next turn: after a 256-token history in the cache, a 64-token message goes in
// through one extend (range 1 = 1) or through 64 decode steps (0), 2 threads; the history's prefill
// is outside the timing. tokens = the turn's tokens per second.
template <class T>
void BM_turn(benchmark::State& st) {
  const bool one_pass = st.range(0) != 0;
  const std::size_t history = 256, turn = 64;
  host_device dev(2);
  const auto cfg = tessel_bench::small_llama();
  nn::decoder_lm<host_device, T> m(dev, cfg);
  m.init(1);
  auto cache = m.make_cache(1, (history + turn) / 16 + 1, 16);
  const tessel_bench::small_batch_data b;
  const std::vector<std::int64_t> hist(b.ids.begin(), b.ids.begin() + std::ptrdiff_t(history));
  const std::vector<std::int64_t> msg(b.ids.begin() + std::ptrdiff_t(small_seq), b.ids.begin() + std::ptrdiff_t(small_seq + turn));
  std::vector<std::size_t> seq;
  for (auto _ : st) {
    st.PauseTiming();
    if (!seq.empty()) cache.release(seq[0]);
    seq.assign(1, cache.add_sequence());
    (void)m.prefill(cache, seq[0], hist);
    st.ResumeTiming();
    if (one_pass) {
      benchmark::DoNotOptimize(m.extend(cache, seq[0], msg).data());
    } else {
      for (std::size_t i = 0; i < turn; ++i) benchmark::DoNotOptimize(m.decode_step(cache, seq, std::span<const std::int64_t>(&msg[i], 1)).data());
    }
  }
  st.counters["tokens"] = benchmark::Counter(double(turn) * double(st.iterations()), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_train_step<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_train_step<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_prefill<bf16>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_prefill<float>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
// the Mixtral-style model (8 experts, top 2): the experts' products are grouped GEMMs
BENCHMARK(BM_train_step<bf16, true>)->Name("BM_train_step_moe<bf16>")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_train_step<float, true>)->Name("BM_train_step_moe<float>")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_prefill<bf16, true>)->Name("BM_prefill_moe<bf16>")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_prefill<float, true>)->Name("BM_prefill_moe<float>")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
// the dense model with FP8 projections (DeepSeek-V3's block-scaled recipe; of_limit against the
// bf16 dot, which e4m3 products run on after widening: this CPU has no FP8 arithmetic)
BENCHMARK(BM_train_step<bf16, false, nn::linear_precision::fp8>)
    ->Name("BM_train_step_fp8<bf16>")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_prefill<bf16, false, nn::linear_precision::fp8>)
    ->Name("BM_prefill_fp8<bf16>")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// the Mixtral-style model with FP8 projections and experts (grouped block-scaled products)
BENCHMARK(BM_train_step<bf16, true, nn::linear_precision::fp8>)
    ->Name("BM_train_step_moe_fp8<bf16>")
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// fp16 projections (f32 atoms on this CPU: no AVX512-FP16) with dynamic loss scaling
BENCHMARK(BM_train_step<bf16, false, nn::linear_precision::fp16>)
    ->Name("BM_train_step_fp16<bf16>")
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_train_step<float, false, nn::linear_precision::fp16>)
    ->Name("BM_train_step_fp16<float>")
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_decode<bf16>)->ArgsProduct({{1, 2}, {1, 4, 16}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode<float>)->Args({2, 1})->Args({2, 16})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode<bf16, true>)->Name("BM_decode_large<bf16>")->ArgsProduct({{1, 2}, {1, 4}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_turn<bf16>)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_train_step_recompute)
    ->Args({0, 0})
    ->Args({0, 512})
    ->Args({0, 1024})
    ->Args({1, 1024})
    ->Args({2, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
