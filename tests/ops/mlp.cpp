// End to end: a 2-layer MLP (Linear -> GELU -> Linear -> cross-entropy) trained with the library
// GEMM and the fused training operators on a synthetic teacher task reaches a loss threshold in a
// fixed number of AdamW steps, with f32 parameters and with bf16 parameters + f32 master weights.
// (examples/10_train_mlp.cpp is the narrated version of this loop.)
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/optim.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_mlp {

using namespace tessel;

namespace {

constexpr std::size_t D = 32, H = 64, C = 8, N = 1024, B = 128;

struct task {
  std::vector<float> x;              // (N, D)
  std::vector<std::int64_t> labels;  // N
  task() : x(N * D), labels(N) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    std::vector<float> teacher(D * C);
    for (auto& t : teacher) t = nd(rng);
    for (auto& v : x) v = nd(rng);
    for (std::size_t i = 0; i < N; ++i) {
      std::size_t best = 0;
      float bv = -1e30f;
      for (std::size_t c = 0; c < C; ++c) {
        float s = 0;
        for (std::size_t d = 0; d < D; ++d) s += x[i * D + d] * teacher[d * C + c];
        if (s > bv) bv = s, best = c;
      }
      labels[i] = std::int64_t(best);
    }
  }
};

// One training run; returns the mean loss over the last 10 steps.
template <class P>  // float or bf16: the dtype the GEMMs see
double train(unsigned threads, int steps) {
  host_device dev(threads);
  const task t;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> w1(D * H), w2(H * C);  // f32 parameters or masters
  for (auto& w : w1) w = nd(rng) / std::sqrt(float(D));
  for (auto& w : w2) w = nd(rng) / std::sqrt(float(H));
  std::vector<P> w1p(w1.size()), w2p(w2.size()), xb(B * D), hb(B * H), dlog(B * C), dpre(B * H);
  for (std::size_t i = 0; i < w1.size(); ++i) w1p[i] = P(w1[i]);
  for (std::size_t i = 0; i < w2.size(); ++i) w2p[i] = P(w2[i]);
  std::vector<float> pre(B * H), logits(B * C), dh(B * H), g1(w1.size()), g2(w2.size());
  std::vector<float> m1(w1.size()), v1(w1.size()), m2(w2.size()), v2(w2.size());
  adamw_params h;
  h.lr = 1e-2f;
  h.weight_decay = 1e-4f;
  double tail = 0;
  for (int step = 1; step <= steps; ++step) {
    const std::size_t off = (std::size_t(step - 1) * B) % N;
    for (std::size_t i = 0; i < B * D; ++i) xb[i] = P(t.x[off * D + i]);
    const std::span<const std::int64_t> lab(t.labels.data() + off, B);
    auto cv = [](const std::vector<P>& v, std::size_t r, std::size_t c) { return tensor<const P, 2>(v.data(), r, c); };
    // forward
    gemm(dev, cv(xb, B, D), cv(w1p, D, H), tensor<float, 2>(pre.data(), B, H));
    gelu_forward(dev, std::span<const float>(pre), std::span<P>(hb));
    gemm(dev, cv(hb, B, H), cv(w2p, H, C), tensor<float, 2>(logits.data(), B, C));
    const auto ce = cross_entropy(dev, tensor<const float, 2>(logits.data(), B, C), lab, tensor<P, 2>(dlog.data(), B, C));
    if (step > steps - 10) tail += ce.loss / 10.0;
    // backward
    gemm(dev, cv(hb, B, H).transposed(), cv(dlog, B, C), tensor<float, 2>(g2.data(), H, C));
    gemm(dev, cv(dlog, B, C), cv(w2p, H, C).transposed(), tensor<float, 2>(dh.data(), B, H));
    gelu_backward(dev, std::span<const float>(dh), std::span<const float>(pre), std::span<P>(dpre));
    gemm(dev, cv(xb, B, D).transposed(), cv(dpre, B, H), tensor<float, 2>(g1.data(), D, H));
    // update: one launch for both tensors
    step_options o;
    std::vector<optim_tensor<float, float>> ts(2);
    ts[0].grad = g1;
    ts[0].m = m1;
    ts[0].v = v1;
    ts[1].grad = g2;
    ts[1].m = m2;
    ts[1].v = v2;
    if constexpr (std::is_same_v<P, float>) {
      ts[0].param = w1p;
      ts[1].param = w2p;
    } else {
      o.storage = param_storage::bf16_master;
      ts[0].param_bf16 = w1p;
      ts[0].master = w1;
      ts[1].param_bf16 = w2p;
      ts[1].master = w2;
    }
    const auto r = adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), h, std::uint64_t(step), o);
    REQUIRE_FALSE(r.skipped);
  }
  return tail;
}

}  // namespace

TEST_CASE("MLP trained with the fused operators reaches the loss threshold (f32 and bf16 + master)", "[ops][mlp]") {
  const int steps = 150;
  const double f32_loss = train<float>(2, steps);
  const double bf16_loss = train<bf16>(2, steps);
  INFO("f32 loss " << f32_loss << ", bf16+master loss " << bf16_loss << " after " << steps << " steps (start ~ ln 8 = 2.08)");
  CHECK(f32_loss < 0.1);
  CHECK(bf16_loss < 0.1);
  // deterministic: the same run on one worker gives the same loss
  CHECK(train<float>(1, 20) == train<float>(2, 20));
}

}  // namespace tessel_test_ops_mlp
