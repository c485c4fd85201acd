// One short training run of a tiny 4-layer Llama on a (dp, tp, pp, ZeRO) layout over any
// transport, for the tests that prove the transports interchangeable: the communicator's
// collectives reduce in a fixed rank order on every transport, so a layout's losses and final
// parameters must be the same bits on threads, on the emulated cluster and under MPI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <array>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "dist/token_batch.hpp"

namespace tessel_test {

inline tessel::io::model_config layout_run_mixtral() {
  auto c = tessel::io::parse_model_config(R"({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 37, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": false})");
  c.router_aux_loss_coef = 0.02;
  return c;
}

inline tessel::io::model_config layout_run_llama() {
  return tessel::io::parse_model_config(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 37, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false})");
}

struct layout_run_spec {
  int dp = 1, tp = 1, pp = 1, zero = 0, ep = 1;  // ep > 1: the Mixtral model with its experts over ep
  std::size_t micro = 1;
  int world() const { return dp * tp * pp; }
  std::string name() const {
    return "dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + " x ep " + std::to_string(ep) + ", ZeRO-" +
           std::to_string(zero) + ", " + std::to_string(micro) + " micro-batches";
  }
};

struct layout_run_rank {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> params;  // this rank's tensors after the steps, by name
};

constexpr std::size_t layout_run_batch = 4, layout_run_seq = 6, layout_run_steps = 3;

// A one-device initialisation saved to a file every rank loads (a file per process: MPI ranks too).
inline std::filesystem::path layout_run_checkpoint_path(bool moe) {
  return std::filesystem::temp_directory_path() / ("layout_run_" + std::string(moe ? "moe_" : "") + std::to_string(::getpid()) + ".safetensors");
}
inline void layout_run_cleanup() {
  std::filesystem::remove(layout_run_checkpoint_path(false));
  std::filesystem::remove(layout_run_checkpoint_path(true));
}
inline std::filesystem::path layout_run_checkpoint(bool moe = false) {
  const auto path = layout_run_checkpoint_path(moe);
  if (!std::filesystem::exists(path)) {
    tessel::host_device d1(1);
    tessel::nn::decoder_lm<tessel::host_device> one(d1, moe ? layout_run_mixtral() : layout_run_llama());
    one.init(3, 0.1);
    one.params().save(path);
  }
  return path;
}

// A checkpoint of the tiny Llama (saved on any layout; a delta with its chain) gathered onto one
// device: every parameter ("value/<name>") and its moments ("m/<name>", "v/<name>").
inline std::map<std::string, std::vector<float>> checkpoint_gathered(const std::filesystem::path& dir) {
  using namespace tessel;
  std::map<std::string, std::vector<float>> t;
  threads_world::run(1, [&](threads_transport tr) {
    dist::process_groups grp(std::move(tr), {});
    host_device dv(1);
    dist::tp_decoder_lm<host_device> m(dv, layout_run_llama(), grp.tp());
    dist::load_checkpoint(dir, m);
    for (auto& p : m.params()) {
      t["value/" + p.name].assign(p.value.data(), p.value.data() + p.numel);
      if (p.m.size() == p.numel) {
        t["m/" + p.name].assign(p.m.data(), p.m.data() + p.numel);
        t["v/" + p.name].assign(p.v.data(), p.v.data() + p.numel);
      }
    }
  });
  return t;
}

// This rank's part of the run: build the groups, the model stage and the schedule, train.
// (`path`: layout_run_checkpoint(sp.ep > 1).)
template <class Transport>
layout_run_rank layout_run(Transport t, const layout_run_spec& sp, const std::filesystem::path& path) {
  using namespace tessel;
  constexpr std::size_t B = layout_run_batch, S = layout_run_seq;
  dist::process_groups grp(std::move(t), {.dp = sp.dp, .tp = sp.tp, .pp = sp.pp, .ep = sp.ep, .zero_stage = sp.zero});
  host_device dv(1);
  const bool moe = sp.ep > 1;
  dist::tp_decoder_lm<host_device> m(dv, moe ? layout_run_mixtral() : layout_run_llama(), grp.tp(),
                                     {.pp = sp.pp > 1 ? &grp.pp() : nullptr, .ep = moe ? &grp.ep() : nullptr});
  nn::load_options lo;
  lo.allow_unexpected = true;  // a stage loads its own layers
  m.load(path, lo);
  dist::pipeline pipe(m, {.micro_batches = sp.micro});
  nn::adamw_config h;
  h.hyper.lr = 1e-3f;
  h.hyper.weight_decay = 0.01f;
  h.max_grad_norm = 1.0f;
  std::optional<dist::data_parallel<dist::pipeline<dist::tp_decoder_lm<host_device>>>> dp;
  std::optional<dist::data_parallel<dist::tp_decoder_lm<host_device>>> edp;  // experts over ep: data parallelism over the model itself
  if (moe)
    edp.emplace(m, grp.dp(), dist::data_parallel_options{.bucket_bytes = 4 << 10, .expert_dp = &grp.edp()});
  else if (sp.dp > 1)
    dp.emplace(pipe, grp.dp(), dist::data_parallel_options{.bucket_bytes = 4 << 10, .zero_stage = sp.zero});
  const std::size_t b = B / std::size_t(sp.dp), off = std::size_t(grp.coords().dp) * b * S;
  layout_run_rank out;
  for (std::size_t s = 0; s < layout_run_steps; ++s) {
    const auto data = make_batch(100 + s, B, S, 37);
    const std::span<const std::int64_t> ids(data.ids.data() + off, b * S), tg(data.targets.data() + off, b * S);
    if (edp) {
      out.losses.push_back(edp->forward_backward(ids, tg, b, S));
      edp->adamw(h, s + 1);
    } else if (dp) {
      out.losses.push_back(dp->forward_backward(ids, tg, b, S));
      dp->adamw(h, s + 1);
    } else {
      m.params().zero_grad();
      out.losses.push_back(pipe.forward_backward(ids, tg, b, S));
      pipe.adamw(h, s + 1);
    }
  }
  for (auto& p : m.params()) out.params[p.name].assign(p.value.data(), p.value.data() + p.numel);
  return out;
}

// The layouts the transport tests run on 4 ranks: every group kind (dp with ZeRO-1's
// reduce-scatter and all-gather, tp's all-reduces, pp's point-to-point activations, ep's
// dispatch and return all-to-alls).
inline std::vector<layout_run_spec> layout_run_specs() {
  return {{.dp = 2, .tp = 2, .zero = 1}, {.tp = 2, .pp = 2, .micro = 2}, {.dp = 2, .pp = 2, .micro = 2}, {.dp = 4, .ep = 2}};
}

// Both results of one rank the same bits (losses and every tensor)?
inline std::string layout_run_diff(const layout_run_rank& a, const layout_run_rank& b) {
  if (a.losses.size() != b.losses.size()) return "step counts differ";
  for (std::size_t s = 0; s < a.losses.size(); ++s)
    if (std::memcmp(&a.losses[s], &b.losses[s], sizeof(double)) != 0) return "loss of step " + std::to_string(s + 1) + " differs";
  if (a.params.size() != b.params.size()) return "tensor counts differ";
  for (const auto& [name, v] : a.params) {
    const auto it = b.params.find(name);
    if (it == b.params.end()) return "tensor " + name + " missing";
    if (it->second.size() != v.size() || std::memcmp(v.data(), it->second.data(), v.size() * sizeof(float)) != 0)
      return "tensor " + name + " differs";
  }
  return {};
}

// The expert-parallel block (8 experts over 4 ranks, 9 tokens each): per rank its output, input
// gradient and its experts' and the router's weight gradients, concatenated.
template <class Transport>
std::vector<float> ep_block_run(Transport t) {
  using namespace tessel;
  using nn::cview;
  using nn::mview;
  constexpr std::size_t E = 8, K = 2, d = 32, I = 24, n = 9;
  communicator c(std::move(t));
  host_device dv(1);
  nn::parameters<host_device> pr(dv);
  auto fill = [](nn::parameter<host_device>& p, std::uint64_t seed) {
    nn::normal_rng g(seed);
    for (std::size_t i = 0; i < p.numel; ++i) p.value.data()[i] = float(g() * 0.4);
  };
  auto& router = pr.add("gate.weight", {E, d});
  fill(router, 1);
  const auto [e0, ne] = dist::local_experts(E, c.size(), c.rank());
  std::vector<std::array<nn::parameter<host_device>*, 3>> ex;
  for (std::size_t j = e0; j < e0 + ne; ++j) {
    auto& w1 = pr.add("w1." + std::to_string(j), {I, d});
    auto& w3 = pr.add("w3." + std::to_string(j), {I, d});
    auto& w2 = pr.add("w2." + std::to_string(j), {d, I});
    fill(w1, 10 + j), fill(w3, 20 + j), fill(w2, 30 + j);
    ex.push_back({&w1, &w3, &w2});
  }
  dist::ep_moe<host_device, float> m(&router, ex, d, I, E, K, c);
  std::vector<float> x(n * d), dy(n * d), y(n * d), dx(n * d);
  nn::normal_rng g(50 + std::uint64_t(c.rank()));
  for (auto& v : x) v = float(g());
  for (auto& v : dy) v = float(g());
  m.forward(dv, cview<float>(x.data(), n, d), mview<float>(y.data(), n, d), true);
  m.backward(dv, cview<float>(dy.data(), n, d), mview<float>(dx.data(), n, d), {});
  std::vector<float> out = y;
  out.insert(out.end(), dx.begin(), dx.end());
  for (auto& p : pr) out.insert(out.end(), p.grad.data(), p.grad.data() + p.numel);
  return out;
}

}  // namespace tessel_test
