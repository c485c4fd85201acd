// Data parallel training (tessel/dist/data_parallel.hpp): a tiny Llama on dp = 2 thread ranks, each
// with half of a 4 x 6 batch, against one device on the whole batch, for 3 AdamW steps.
//  * The replicas stay bitwise identical (fixed-order reductions, the same step on every rank).
//  * Step-1 gradients (same parameters): per token the forward and backward are the same rows of
//    the same GEMMs, and dlogits' 1/n scales differ by a power of two (exact), so what differs is
//    the split of the token sums of the weight gradients (N = 24 tokens into 2 x 12, plus the
//    average's one rounding): |Δg| <= 2·γ_24·Σ|terms|. Σ|terms| is not observable here; the test
//    bounds each tensor's max |Δg| by 2·γ_24·24·max|g| ≈ 7e-5·max|g|, which holds when terms do
//    not cancel by more than a factor 24 (measured margin reported).
//  * After 3 steps: each AdamW update is at most lr·(1 − β1)/√(1 − β2)·(bias corrections) ≈ 3.2·lr
//    in magnitude, so two runs whose gradients differ in rounding can differ by at most 2·3.2·lr
//    per step per element (a worst case: near-zero gradients whose sign flips); the test checks
//    that rigorous bound and reports the measured max, far below it. Losses: rel. diff <= 1e-5.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"
#include "dist/thread_check.hpp"
#include "dist/token_batch.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_data_parallel {

using namespace tessel;
using tessel_test::is_error;

namespace {

io::model_config tiny_llama() {
  return io::parse_model_config(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 37, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false})");
}

constexpr std::size_t B = 4, S = 6, STEPS = 3;

using batch = tessel_test::token_batch;
batch make_batch(std::uint64_t seed) { return tessel_test::make_batch(seed, B, S, 37); }

using grads = std::vector<std::vector<float>>;
grads grads_of(nn::decoder_lm<host_device>& m) {
  grads g;
  for (auto& p : m.params()) g.emplace_back(p.grad.data(), p.grad.data() + p.numel);
  return g;
}
grads values_of(nn::decoder_lm<host_device>& m) {
  grads g;
  for (auto& p : m.params()) g.emplace_back(p.value.data(), p.value.data() + p.numel);
  return g;
}

}  // namespace

TEST_CASE("dp=2 AdamW steps of a tiny Llama equal one device on the full batch, replicas bitwise identical", "[dist][data_parallel]") {
  const auto cfg = tiny_llama();
  nn::adamw_config h;
  h.hyper.lr = 1e-3f;
  h.hyper.weight_decay = 0.0f;
  std::vector<batch> data;
  for (std::size_t s = 0; s < STEPS; ++s) data.push_back(make_batch(100 + s));

  // one device
  host_device d1(1);
  nn::decoder_lm<host_device> one(d1, cfg);
  one.init(3, 0.1);
  std::vector<double> loss1;
  grads g1;
  for (std::size_t s = 0; s < STEPS; ++s) {
    one.params().zero_grad();
    loss1.push_back(one.forward_backward(data[s].ids, data[s].targets, B, S));
    if (s == 0) g1 = grads_of(one);
    one.adamw(h, s + 1);
  }
  const grads p1 = values_of(one);

  std::vector<grads> gdp(2), pdp(2);
  std::vector<std::vector<double>> lossdp(2);
  threads_world::run(2, [&](threads_transport t) {
    dist::process_groups grp(t, {.dp = 2, .tp = 1});
    const int r = grp.dp().rank();
    host_device dv(1);
    nn::decoder_lm<host_device> m(dv, cfg);
    m.init(3 + std::uint64_t(r) * 17, 0.1);                           // different on each rank: broadcast_parameters makes them rank 0's
    dist::data_parallel dp(m, grp.dp(), {.bucket_bytes = 16 << 10});  // several buckets
    dp.broadcast_parameters(0);
    const std::size_t b = B / 2, off = std::size_t(r) * b * S;
    for (std::size_t s = 0; s < STEPS; ++s) {
      const std::span<const std::int64_t> ids(data[s].ids.data() + off, b * S), tg(data[s].targets.data() + off, b * S);
      lossdp[std::size_t(r)].push_back(dp.forward_backward(ids, tg, b, S));
      if (s == 0) gdp[std::size_t(r)] = grads_of(m);
      m.adamw(h, s + 1);
    }
    pdp[std::size_t(r)] = values_of(m);
  });

  // replicas: the same bits
  for (std::size_t i = 0; i < pdp[0].size(); ++i) {
    CHECK(std::memcmp(pdp[0][i].data(), pdp[1][i].data(), pdp[0][i].size() * sizeof(float)) == 0);
    CHECK(std::memcmp(gdp[0][i].data(), gdp[1][i].data(), gdp[0][i].size() * sizeof(float)) == 0);
  }
  CHECK(lossdp[0] == lossdp[1]);
  // against one device
  const double u = std::ldexp(1.0, -24), g24 = 24 * u / (1 - 24 * u);
  double worst_g = 0, worst_p = 0, worst_l = 0;
  std::size_t i = 0;
  for (auto& p : one.params()) {
    INFO(p.name);
    float gmax = 0;
    for (float v : g1[i]) gmax = std::max(gmax, std::fabs(v));
    double dg = 0, dpar = 0;
    for (std::size_t k = 0; k < g1[i].size(); ++k) {
      dg = std::max(dg, std::fabs(double(gdp[0][i][k]) - double(g1[i][k])));
      dpar = std::max(dpar, std::fabs(double(pdp[0][i][k]) - double(p1[i][k])));
    }
    const double gbound = 2 * g24 * 24 * double(gmax) + 1e-30, pbound = 2 * 3.2 * double(h.hyper.lr) * STEPS;
    CHECK(dg <= gbound);
    CHECK(dpar <= pbound);
    worst_g = std::max(worst_g, dg / gbound);
    worst_p = std::max(worst_p, dpar);
    ++i;
  }
  for (std::size_t s = 0; s < STEPS; ++s) {
    const double rel = std::fabs(lossdp[0][s] - loss1[s]) / std::fabs(loss1[s]);
    CHECK(rel <= 1e-5);
    worst_l = std::max(worst_l, rel);
  }
  WARN("dp=2 vs one device: step-1 grads worst |dg| / bound = " << worst_g << "; params after " << STEPS << " steps max |dp| = " << worst_p
                                                                << " (bound " << 2 * 3.2 * h.hyper.lr * STEPS
                                                                << "); loss max rel diff = " << worst_l);
}

namespace {

// One dp run of STEPS AdamW steps over `dp` thread ranks (each with batch / dp sequences), at a
// ZeRO stage: every rank's parameters after the last step, the losses, and what memory() reports.
struct zero_run {
  std::vector<grads> params;  // per rank
  std::vector<std::vector<double>> losses, norms;
  std::vector<dist::memory_use> memory;
  std::vector<std::pair<std::size_t, std::size_t>> owned;
  std::vector<std::vector<float>> scales;  // the loss scale after each step (with a scaler)
  std::vector<std::vector<int>> skipped;
  std::size_t total = 0;
};

// A run's fp16 setup: fp16 projections and a loss scaler starting at init_scale (0: neither).
struct fp16_setup {
  float init_scale = 0;
};

template <class T>
zero_run run_zero(int dp, int stage, const nn::adamw_config& h, std::size_t batch_n, const std::vector<batch>& data, fp16_setup f = {}) {
  const auto cfg = tiny_llama();
  zero_run out;
  const std::size_t n = std::size_t(dp);
  out.params.resize(n);
  out.losses.resize(n);
  out.norms.resize(n);
  out.memory.resize(n);
  out.owned.resize(n);
  out.scales.resize(n);
  out.skipped.resize(n);
  threads_world::run(dp, [&](threads_transport t) {
    dist::process_groups grp(t, {.dp = dp, .tp = 1, .zero_stage = stage});
    const std::size_t r = std::size_t(grp.dp().rank());
    host_device dv(1);
    nn::decoder_lm<host_device, T> m(dv, cfg);
    m.init(3, 0.1);
    if (f.init_scale > 0) {
      m.set_fp16_linears(true);
      m.set_loss_scaler(loss_scaler(f.init_scale, 2.0f, 0.5f, 2));
    }
    // 4 KiB chunks: many reduce-scatter / all-gather rounds, shards cut inside tensors
    dist::data_parallel d(m, grp.dp(), {.bucket_bytes = 4 << 10, .zero_stage = stage});
    const std::size_t b = batch_n / n, off = r * b * S;
    for (std::size_t s = 0; s < data.size(); ++s) {
      const std::span<const std::int64_t> ids(data[s].ids.data() + off, b * S), tg(data[s].targets.data() + off, b * S);
      out.losses[r].push_back(d.forward_backward(ids, tg, b, S));
      const auto res = d.adamw(h, s + 1);
      out.norms[r].push_back(res.grad_norm);
      out.skipped[r].push_back(res.skipped);
      out.scales[r].push_back(m.loss_scale());
    }
    grads v;
    for (auto& p : m.params()) v.emplace_back(p.value.data(), p.value.data() + p.numel);
    out.params[r] = std::move(v);
    out.memory[r] = d.memory();
    out.owned[r] = d.owned_range();
    if (r == 0) out.total = m.params().numel();
  });
  return out;
}

bool same_bits(const grads& a, const grads& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  return true;
}

}  // namespace

// ZeRO-1 reduce-scatters the gradients (each element summed in the same dp-rank order as the
// all-reduce), updates each shard with the same per-element AdamW arithmetic, and all-gathers: so
// without clipping it must give plain DP's bits exactly, on shards that cut tensors anywhere (dp = 3
// does not divide the parameter count). Its memory is the closed form: moments 8·|shard| bytes.
TEMPLATE_TEST_CASE("ZeRO-1 data parallel gives plain DP's bits, with 1/dp of the optimizer state", "[dist][data_parallel][zero]", float, bf16) {
  constexpr std::size_t BN = 6;
  std::vector<batch> data;
  for (std::size_t s = 0; s < STEPS; ++s) data.push_back(tessel_test::make_batch(300 + s, BN, S, 37));
  nn::adamw_config h;
  h.hyper.lr = 1e-3f;
  h.hyper.weight_decay = 0.01f;
  for (int dp : {2, 3}) {
    INFO("dp = " << dp);
    const zero_run z0 = run_zero<TestType>(dp, 0, h, BN, data), z1 = run_zero<TestType>(dp, 1, h, BN, data);
    const std::size_t P = z0.total;
    std::size_t shard_sum = 0;
    for (std::size_t r = 0; r < std::size_t(dp); ++r) {
      INFO("rank " << r);
      CHECK(same_bits(z1.params[r], z0.params[r]));
      CHECK(same_bits(z1.params[r], z1.params[0]));
      CHECK(z1.losses[r] == z0.losses[r]);
      // memory: the same parameters and gradients, the moments of the shard only
      const auto [lo, hi] = z1.owned[r];
      CHECK(hi - lo ==
            std::min(P, (P + std::size_t(dp) - 1) / std::size_t(dp) * (r + 1)) - std::min(P, (P + std::size_t(dp) - 1) / std::size_t(dp) * r));
      shard_sum += hi - lo;
      CHECK(z1.memory[r].optimizer_state == 8 * (hi - lo));
      CHECK(z0.memory[r].optimizer_state == 8 * P);
      CHECK(z1.memory[r].parameters == z0.memory[r].parameters);
      CHECK(z1.memory[r].gradients == 4 * P);
      CHECK(z1.memory[r].parameters == (std::is_same_v<TestType, bf16> ? 6 : 4) * P);
    }
    CHECK(shard_sum == P);
    CHECK(z1.owned[0].first == 0);
  }
}

// The model's loss scaler under ZeRO-1: the shard step divides the scale out and tells the scaler
// (skips included), as the model's own adamw does under plain DP: the same bits and scales. fp16
// projections with a scale of 2^40 overflow the first steps' gradients (skipped, the scale halved)
// and 2^12 trains (the scale grows every 2 clean steps).
TEST_CASE("ZeRO-1 data parallel with the model's fp16 loss scaler gives plain DP's bits and scales", "[dist][data_parallel][zero]") {
  constexpr std::size_t BN = 4, steps = 6;
  std::vector<batch> data;
  for (std::size_t s = 0; s < steps; ++s) data.push_back(tessel_test::make_batch(700 + s, BN, S, 37));
  nn::adamw_config h;
  h.hyper.lr = 1e-3f;
  for (float init : {std::ldexp(1.0f, 40), std::ldexp(1.0f, 12)}) {
    INFO("initial scale " << init);
    const zero_run z0 = run_zero<float>(2, 0, h, BN, data, {init}), z1 = run_zero<float>(2, 1, h, BN, data, {init});
    for (std::size_t r = 0; r < 2; ++r) {
      INFO("rank " << r);
      CHECK(same_bits(z1.params[r], z0.params[r]));
      CHECK(z1.scales[r] == z0.scales[r]);
      CHECK(z1.skipped[r] == z0.skipped[r]);
    }
    const auto& sk = z0.skipped[0];
    if (init > 1e10f) {
      CHECK(sk.front() == 1);
    } else {
      CHECK(std::count(sk.begin(), sk.end(), 1) == 0);
      CHECK(z0.scales[0].back() == init * 8);  // 6 clean steps: grown 3 times
    }
  }
}

// With the gradient norm clipped, ZeRO-1 sums the squared norm shard by shard in double (plain DP:
// the optimizer's f32 chunk sums), so the clipping coefficients differ in rounding: the norms agree
// to f32 accumulation accuracy and the parameters within the AdamW update bound (2·3.2·lr per step).
TEST_CASE("ZeRO-1 with gradient clipping: one global norm on every rank, parameters within the update bound of plain DP",
          "[dist][data_parallel][zero]") {
  constexpr std::size_t BN = 6;
  std::vector<batch> data;
  for (std::size_t s = 0; s < STEPS; ++s) data.push_back(tessel_test::make_batch(400 + s, BN, S, 37));
  nn::adamw_config h;
  h.hyper.lr = 1e-3f;
  h.max_grad_norm = 0.05f;  // below the measured norms: every step clips
  const zero_run z0 = run_zero<float>(3, 0, h, BN, data), z1 = run_zero<float>(3, 1, h, BN, data);
  double worst_p = 0, worst_n = 0;
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(same_bits(z1.params[r], z1.params[0]));
    CHECK(z1.norms[r] == z1.norms[0]);
    for (std::size_t s = 0; s < STEPS; ++s) {
      CHECK(z0.norms[r][s] > double(h.max_grad_norm));
      const double rel = std::fabs(z1.norms[r][s] - z0.norms[r][s]) / z0.norms[r][s];
      CHECK(rel <= 1e-5);
      worst_n = std::max(worst_n, rel);
    }
    for (std::size_t i = 0; i < z0.params[r].size(); ++i)
      for (std::size_t k = 0; k < z0.params[r][i].size(); ++k)
        worst_p = std::max(worst_p, std::fabs(double(z1.params[r][i][k]) - double(z0.params[r][i][k])));
  }
  CHECK(worst_p <= 2 * 3.2 * h.hyper.lr * STEPS);
  WARN("ZeRO-1 vs plain DP with clipping: norm max rel diff " << worst_n << ", params max |diff| " << worst_p << " (bound "
                                                              << 2 * 3.2 * h.hyper.lr * STEPS << ")");
}

// dp × tp: data_parallel over tensor-parallel replicas (dp = 2, tp = 2 on 4 thread ranks), each
// loaded from one one-device checkpoint, 3 AdamW steps with weight decay.
//  * ZeRO-1 without clipping gives plain DP's bits (as on one-device replicas).
//  * With clipping, the global norm must span both axes: every rank reports the same norm, and
//    ZeRO-1's (dp shards, then tp) equals plain DP's (the model's own, over tp) to f32
//    accumulation (1e-6 relative; a norm over one tp rank's shards only would be off by ~30%).
//  * Against tp = 2 alone on the whole batch: the losses within 1e-5 relative and the parameters
//    within the AdamW update bound (see the top of this file).
TEST_CASE("dp x tp: data_parallel over tp_decoder_lm replicas, ZeRO-1 bitwise equal to plain DP, one global norm", "[dist][data_parallel][zero]") {
  constexpr std::size_t BN = 4;
  std::vector<batch> data;
  for (std::size_t s = 0; s < STEPS; ++s) data.push_back(tessel_test::make_batch(700 + s, BN, S, 37));
  const auto cfg = tiny_llama();
  const auto path = std::filesystem::temp_directory_path() / ("dist_dpxtp_" + std::to_string(::getpid()) + ".safetensors");
  {
    host_device d1(1);
    nn::decoder_lm<host_device> one(d1, cfg);
    one.init(3, 0.1);
    one.params().save(path);
  }
  struct result {
    std::vector<std::vector<double>> losses, norms;
    std::vector<grads> params;  // by world rank
  };
  // dp = 0: tp_decoder_lm alone on the whole batch
  auto run = [&](int dp, int stage, float clip) {
    const int world = 2 * std::max(dp, 1);
    result out;
    out.losses.resize(std::size_t(world));
    out.norms.resize(std::size_t(world));
    out.params.resize(std::size_t(world));
    threads_world::run(world, [&](threads_transport t) {
      const std::size_t w = std::size_t(t.rank());
      dist::process_groups grp(t, {.dp = std::max(dp, 1), .tp = 2});
      host_device dv(1);
      dist::tp_decoder_lm<host_device> m(dv, cfg, grp.tp());
      m.load(path);
      nn::adamw_config h;
      h.hyper.lr = 1e-3f;
      h.hyper.weight_decay = 0.01f;
      h.max_grad_norm = clip;
      const std::size_t b = dp ? BN / std::size_t(dp) : BN, off = dp ? std::size_t(grp.dp().rank()) * b * S : 0;
      std::optional<dist::data_parallel<dist::tp_decoder_lm<host_device>>> d;
      if (dp) d.emplace(m, grp.dp(), dist::data_parallel_options{.bucket_bytes = 4 << 10, .zero_stage = stage});
      for (std::size_t s = 0; s < STEPS; ++s) {
        const std::span<const std::int64_t> ids(data[s].ids.data() + off, b * S), tg(data[s].targets.data() + off, b * S);
        if (d) {
          out.losses[w].push_back(d->forward_backward(ids, tg, b, S));
          out.norms[w].push_back(d->adamw(h, s + 1).grad_norm);
        } else {
          m.params().zero_grad();
          out.losses[w].push_back(m.forward_backward(ids, tg, b, S));
          out.norms[w].push_back(m.adamw(h, s + 1).grad_norm);
        }
      }
      grads v;
      for (auto& p : m.params()) v.emplace_back(p.value.data(), p.value.data() + p.numel);
      out.params[w] = std::move(v);
    });
    return out;
  };
  const result z0 = run(2, 0, 0.0f), z1 = run(2, 1, 0.0f);
  for (std::size_t w = 0; w < 4; ++w) {
    INFO("world rank " << w);
    CHECK(z1.losses[w] == z0.losses[w]);
    CHECK(same_bits(z1.params[w], z0.params[w]));
  }
  // clipping active: this model's gradient norm is above 0.05
  const result c0 = run(2, 0, 0.05f), c1 = run(2, 1, 0.05f), tp_only = run(0, 0, 0.05f);
  double worst_norm = 0;
  for (std::size_t w = 0; w < 4; ++w)
    for (std::size_t s = 0; s < STEPS; ++s) {
      INFO("world rank " << w << ", step " << s + 1);
      CHECK(c1.norms[w][s] == c1.norms[0][s]);
      CHECK(c0.norms[w][s] == c0.norms[0][s]);
      CHECK(c0.norms[w][s] > 0.05);
      const double rel = std::fabs(c1.norms[w][s] - c0.norms[w][s]) / c0.norms[w][s];
      CHECK(rel <= 1e-6);
      worst_norm = std::max(worst_norm, rel);
    }
  // against tp = 2 alone on the whole batch: tp rank r of the world of 2 is world rank r of dp x tp
  // when tp is the inner axis (process_groups' order), and every dp replica holds the same values
  const double pbound = 2 * 3.2 * 1e-3 * STEPS;
  double worst_p = 0, worst_l = 0;
  for (std::size_t w = 0; w < 4; ++w) {
    const std::size_t r = w % 2;
    REQUIRE(c0.params[w].size() == tp_only.params[r].size());
    for (std::size_t i = 0; i < c0.params[w].size(); ++i)
      for (std::size_t j = 0; j < c0.params[w][i].size(); ++j)
        worst_p = std::max(worst_p, std::fabs(double(c0.params[w][i][j]) - double(tp_only.params[r][i][j])));
    for (std::size_t s = 0; s < STEPS; ++s) worst_l = std::max(worst_l, std::fabs(c0.losses[w][s] - tp_only.losses[r][s]) / tp_only.losses[r][s]);
  }
  CHECK(worst_p <= pbound);
  CHECK(worst_l <= 1e-5);
  WARN("dp2 x tp2: ZeRO-1 vs plain DP clipped norm max rel diff " << worst_norm << "; vs tp2 alone: params max |dp| " << worst_p << " (bound "
                                                                  << pbound << "), loss max rel diff " << worst_l);
  std::filesystem::remove(path);
}

TEST_CASE("data_parallel: ZeRO stages that are not built are typed errors", "[dist][data_parallel][zero][errors]") {
  host_device dv(1);
  nn::decoder_lm<host_device> m(dv, tiny_llama());
  threads_world::run(1, [&](threads_transport t) {
    communicator c(std::move(t));
    CHECK_THROWS_MATCHES((dist::data_parallel(m, c, {.bucket_bytes = 1024, .zero_stage = 2})), dist::dist_error,
                         is_error(errc::unsupported, "dist", "ZeRO stage 2 is not built yet"));
    CHECK_THROWS_MATCHES((dist::data_parallel(m, c, {.bucket_bytes = 1024, .zero_stage = -1})), dist::dist_error,
                         is_error(errc::config, "dist", "ZeRO stage -1"));
  });
}

// Compressed gradient buckets: a tiny Llama trained 30 AdamW steps on dp = 2 with its gradients
// all-reduced as BF16, FP8 (E4M3) and INT4 with and without error feedback, against uncompressed.
// Reported: the evaluation loss after training and the gradient bytes each rank sent. Asserted:
// every run learns (loss below the first step's), the BF16 and E4M3 evaluation losses stay within
// 2% of uncompressed (measured: 0.04%, 0.07%), INT4 with error feedback within 10% (measured 6.8%
// with 256-element chunks: AdamW's per-element normalisation magnifies what INT4 rounds away, and
// error feedback's delayed residuals do not help it here; the seeds' < 0.3% is not reached on this
// model), and the bytes shrink as the formats say (bits per element plus one f32 scale per chunk).
TEST_CASE("data_parallel: compressed gradient buckets train as uncompressed, with a fraction of the traffic", "[dist][data_parallel][compression]") {
  constexpr std::size_t STEPS_C = 30;
  struct result {
    double first = 0, eval = 0;
    std::size_t bytes = 0;
  };
  auto train = [&](compression_options co, bool ef) {
    result r;
    std::mutex mu;
    threads_world::run(2, [&](threads_transport t) {
      dist::process_groups grp(std::move(t), {.dp = 2});
      host_device dv(1);
      nn::decoder_lm<host_device> m(dv, tiny_llama());
      m.init(5, 0.1);
      dist::data_parallel dp(m, grp.dp(), {.bucket_bytes = 16 << 10, .compression = co, .error_feedback = ef});
      nn::adamw_config h;
      h.hyper.lr = 3e-3f;
      const std::size_t b = B / 2, off = std::size_t(grp.dp().rank()) * b * S;
      double first = 0;
      for (std::size_t s = 0; s < STEPS_C; ++s) {
        const auto data = make_batch(500 + s % 5);
        const double l = dp.forward_backward(std::span(data.ids).subspan(off, b * S), std::span(data.targets).subspan(off, b * S), b, S);
        if (s == 0) first = l;
        dp.adamw(h, s + 1);
      }
      double eval = 0;
      for (std::size_t s = 0; s < 5; ++s) {
        const auto data = make_batch(500 + s);
        eval += m.loss(data.ids, data.targets, B, S) / 5.0;
      }
      if (grp.dp().rank() == 0) {
        std::lock_guard lk(mu);
        r = {first, eval, dp.wire_bytes()};
      }
    });
    return r;
  };
  const result none = train({.format = wire_format::none}, false);
  const result bf = train({.format = wire_format::bf16}, true), e4 = train({.format = wire_format::e4m3}, true);
  const result i4 = train({.format = wire_format::int4}, true), i4_plain = train({.format = wire_format::int4}, false);
  const result i4_64 = train({.format = wire_format::int4, .chunk = 64}, true);
  WARN("dp = 2, " << STEPS_C << " steps: evaluation loss / gradient bytes sent per rank\n"
                  << "  none        " << none.eval << "  " << none.bytes << "\n"
                  << "  bf16 + EF   " << bf.eval << "  " << bf.bytes << "\n"
                  << "  e4m3 + EF   " << e4.eval << "  " << e4.bytes << "\n"
                  << "  int4 + EF   " << i4.eval << "  " << i4.bytes << "\n"
                  << "  int4        " << i4_plain.eval << "  " << i4_plain.bytes << "\n"
                  << "  int4/64 + EF " << i4_64.eval << "  " << i4_64.bytes);
  for (const result* r : {&none, &bf, &e4, &i4, &i4_plain, &i4_64}) CHECK(r->eval < 0.8 * r->first);
  CHECK(std::fabs(bf.eval - none.eval) <= 0.02 * none.eval);
  CHECK(std::fabs(e4.eval - none.eval) <= 0.02 * none.eval);
  CHECK(std::fabs(i4.eval - none.eval) <= 0.10 * none.eval);
  // bits per element over f32's 32, plus a 4-byte scale per 256 elements (+ slack for chunk tails)
  CHECK(double(bf.bytes) <= (16.0 / 32 + 4.0 / 256 / 4) * 1.02 * double(none.bytes));
  CHECK(double(e4.bytes) <= (8.0 / 32 + 4.0 / 256 / 4) * 1.02 * double(none.bytes));
  CHECK(double(i4.bytes) <= (4.0 / 32 + 4.0 / 256 / 4) * 1.02 * double(none.bytes));
  CHECK(i4.bytes == i4_plain.bytes);
}

TEST_CASE("data_parallel: compressed gradients with ZeRO-1 are a typed error", "[dist][data_parallel][compression][errors]") {
  threads_world::run(2, [&](threads_transport t) {
    dist::process_groups grp(std::move(t), {.dp = 2});
    host_device dv(1);
    nn::decoder_lm<host_device> m(dv, tiny_llama());
    bool ok = false;
    try {
      dist::data_parallel dp(m, grp.dp(), {.zero_stage = 1, .compression = {.format = wire_format::int4}});
    } catch (const dist::dist_error& e) { ok = is_error(errc::unsupported, "dist", "compressed gradients with ZeRO stage 1").match(e); }
    TS_CHECK(ok);
  });
}

// The fp16 policy under data parallelism: replicas see different data, so their projections'
// overflow records differ, and a replica deciding on its own would move projections the others
// keep (one "model" computing in two precisions). Here layer 0's input norm is scaled to 1e4 and
// token 36's embedding is one spike (1000 in its first element, 1e-3 elsewhere), so its normalized
// row reaches ~8e4 > fp16's 65504 at q, k and v while other tokens' (|z| < ~4) stay below; only
// replica 1's batches hold token 36. Both replicas must move the same projections at the same steps
// (q, k, v of layer 0 among them), keep the same bits and scales, and only dp rank 0 logs; for
// ZeRO stages 0 and 1.
TEST_CASE("data_parallel with fp16 projections: replicas share overflow records and move the same projections at the same step",
          "[dist][data_parallel]") {
  const auto cfg = tiny_llama();
  constexpr std::size_t steps = 8, BN = 4;
  nn::adamw_config h;
  h.hyper.lr = 1e-3f;
  for (int stage : {0, 1}) {
    INFO("ZeRO stage " << stage);
    struct record {
      std::vector<std::size_t> fp16;
      std::vector<int> skipped;
      std::vector<float> scale;
      std::vector<std::string> log;
      grads params;
    };
    std::vector<record> rec(2);
    threads_world::run(2, [&](threads_transport t) {
      dist::process_groups grp(t, {.dp = 2, .tp = 1, .zero_stage = stage});
      const std::size_t r = std::size_t(grp.dp().rank());
      record& out = rec[r];
      host_device dv(1);
      nn::decoder_lm<host_device, float> m(dv, cfg);
      m.init(3, 0.1);
      auto& g = m.params().at("model.layers.0.input_layernorm.weight");
      std::fill_n(g.value.data(), g.numel, 1e4f);
      auto& e = m.params().at("model.embed_tokens.weight");
      std::fill_n(e.value.data() + 36 * 64, 64, 1e-3f);
      e.value.data()[36 * 64] = 1000.0f;
      m.set_fp16_linears(true, {.patience = 3, .log = [&](const std::string& l) { out.log.push_back(l); }});
      m.set_loss_scaler(loss_scaler(1024.0f));
      dist::data_parallel d(m, grp.dp(), {.bucket_bytes = 4 << 10, .zero_stage = stage});
      for (std::size_t s = 0; s < steps; ++s) {
        batch b = tessel_test::make_batch(800 + 2 * s + r, BN / 2, S, 36);  // ids in [0, 36)
        if (r == 1) b.ids[3] = 36;
        m.params().zero_grad();
        (void)d.forward_backward(b.ids, b.targets, BN / 2, S);
        out.skipped.push_back(d.adamw(h, s + 1).skipped);
        out.fp16.push_back(m.fp16_linears());
        out.scale.push_back(m.loss_scale());
      }
      for (auto& p : m.params()) out.params.emplace_back(p.value.data(), p.value.data() + p.numel);
    });
    CHECK(rec[1].fp16 == rec[0].fp16);
    CHECK(rec[1].skipped == rec[0].skipped);
    CHECK(rec[1].scale == rec[0].scale);
    CHECK(same_bits(rec[1].params, rec[0].params));
    CHECK(rec[1].log.empty());
    const record& r = rec[0];
    CHECK(r.fp16[0] == 2 * 7);
    CHECK(r.fp16[1] == 2 * 7);  // two strikes: still fp16
    CHECK(r.fp16[2] < 2 * 7);   // the third moves them
    CHECK(r.skipped[0] == 1);   // replica 1's overflow is every replica's step
    CHECK(r.log.size() == 2 * 7 - r.fp16.back());
    std::set<std::string> moved;
    for (const auto& l : r.log) {
      const auto a = l.find("model."), z = l.find(".weight");
      REQUIRE(a != std::string::npos);
      moved.insert(l.substr(a, z - a));
    }
    for (const char* p : {"q_proj", "k_proj", "v_proj"}) CHECK(moved.count(std::string("model.layers.0.self_attn.") + p) == 1);
    CHECK_FALSE(r.skipped.back());  // the switched model trains
  }
}

}  // namespace tessel_test_dist_data_parallel
