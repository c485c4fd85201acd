// The small models of the training benchmarks (bench_model, bench_dist): issue 17's ~20M-parameter
// Llama-style decoder (and a Mixtral-style one with 8 experts, top 2) (d 512, 4 layers, 8 heads, 4 kv heads, vocab 8192, intermediate 1408) on a
// batch of 4 x 512 tokens, its FLOP count, a fixed batch, and one AdamW training step.
//
// FLOPs per token: training 6·N_matmul (N_matmul: every weight a GEMM reads, the LM head included,
// embeddings' lookups excluded) + causal attention 6·S·q_dim per layer (forward 2 matmuls over S/2
// keys on average, backward twice that); prefill 2·N_matmul + 2·S·q_dim per layer.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include <tessel/io/model_config.hpp>
#include <tessel/nn/decoder.hpp>

namespace tessel_bench {

constexpr std::size_t small_batch = 4, small_seq = 512;

inline tessel::io::model_config small_llama() {
  return tessel::io::parse_model_config(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": false})");
}

// A Llama-style decoder of ~160M parameters (d 1024, 8 layers, 16 heads, 8 kv heads, vocab 32000,
// intermediate 2816) whose bf16 GEMM weights (250 MB) are 8x the last-level cache of the machines
// this runs on (32 MiB): decode with it reads its weights from memory, where the small model's
// (32 MB in bf16) partly stay in cache between tokens (BM_decode_large).
inline tessel::io::model_config medium_llama() {
  return tessel::io::parse_model_config(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 8, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": false})");
}

// The same decoder with a Mixtral MoE block in every layer: 8 experts of intermediate 1408, top 2
// (each token's expert products are those of two dense MLPs).
inline tessel::io::model_config small_mixtral() {
  return tessel::io::parse_model_config(R"({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": false, "num_local_experts": 8, "num_experts_per_tok": 2})");
}

// N_matmul: the weights one token's GEMMs read (the LM head included, embedding lookups excluded;
// an MoE layer's: its top-k experts' and the router's).
inline double matmul_params(const tessel::io::model_config& c) {
  const double d = double(c.hidden_size), I = double(c.intermediate_size), qd = double(c.num_attention_heads * c.head_dim),
               kvd = double(c.num_key_value_heads * c.head_dim), L = double(c.num_hidden_layers), V = double(c.vocab_size);
  const double mlp = c.is_moe() ? double(c.num_experts_per_tok) * 3 * d * I + d * double(c.num_local_experts) : 3 * d * I;
  return L * (d * qd + 2 * d * kvd + qd * d + mlp) + V * d;
}

struct model_flops {
  double train = 0, prefill = 0;  // per token
};
inline model_flops flops_per_token(const tessel::io::model_config& c, std::size_t seq = small_seq) {
  const double n_matmul = matmul_params(c);
  const double attn =
      double(c.num_hidden_layers) * double(seq) * double(c.num_attention_heads * c.head_dim);  // 2 matmuls x 2 flops x S/2 keys x q_dim
  return {6 * n_matmul + 6 * attn, 2 * n_matmul + 2 * attn};
}

// Fixed pseudo-random ids and targets in [0, 8192).
struct small_batch_data {
  std::vector<std::int64_t> ids, targets;
  small_batch_data() : ids(small_batch * small_seq), targets(small_batch * small_seq) {
    std::uint64_t s = 1;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      ids[i] = std::int64_t((s >> 33) % 8192);
      targets[i] = std::int64_t((s >> 13) % 8192);
    }
  }
};

// One training step of any model with the decoder_lm interface (params, forward_backward, adamw).
template <class Model>
void train_step(Model& m, const small_batch_data& b, std::uint64_t step) {
  tessel::nn::adamw_config h;
  h.hyper.lr = 1e-4f;
  m.params().zero_grad();
  benchmark::DoNotOptimize(m.forward_backward(b.ids, b.targets, small_batch, small_seq));
  m.adamw(h, step);
}

}  // namespace tessel_bench
