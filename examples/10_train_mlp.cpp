// 10_train_mlp: train a small MLP end to end with tessel's operators.
//
//   logits = GELU(x · W1) · W2,  loss = cross_entropy(logits, labels)
//
// on a synthetic task (labels from a random linear "teacher"). Forward and backward use the
// library GEMM (transposes are just strided views), the fused GELU forward/backward and the fused
// cross-entropy (loss and d(logits) in one pass); the update is one multi-tensor AdamW launch with
// global grad-norm clipping and the inf/NaN check fused in. Run it twice: with f32 parameters, and
// with bf16 parameters (what the GEMMs read) plus f32 master weights (what AdamW updates).
//
//   ./10_train_mlp            # both precisions, 200 steps each
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/optim.hpp>

using namespace tessel;

constexpr std::size_t D = 32, H = 128, C = 10, N = 4096, B = 256;

struct dataset {
  std::vector<float> x;              // (N, D)
  std::vector<std::int64_t> labels;  // N
};

dataset make_task() {
  dataset t{std::vector<float>(N * D), std::vector<std::int64_t>(N)};
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> teacher(D * C);
  for (auto& w : teacher) w = nd(rng);
  for (auto& v : t.x) v = nd(rng);
  for (std::size_t i = 0; i < N; ++i) {
    std::size_t best = 0;
    float bv = -1e30f;
    for (std::size_t c = 0; c < C; ++c) {
      float s = 0;
      for (std::size_t d = 0; d < D; ++d) s += t.x[i * D + d] * teacher[d * C + c];
      if (s > bv) bv = s, best = c;
    }
    t.labels[i] = std::int64_t(best);
  }
  return t;
}

// P: the dtype of the parameters and activations the GEMMs read (float or bf16).
template <class P>
double train(host_device& dev, const dataset& t, int steps) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  // f32 weights: the parameters themselves (P = float) or the master copy (P = bf16)
  std::vector<float> w1(D * H), w2(H * C);
  for (auto& w : w1) w = nd(rng) / std::sqrt(float(D));
  for (auto& w : w2) w = nd(rng) / std::sqrt(float(H));
  std::vector<P> w1p(w1.size()), w2p(w2.size()), xb(B * D), hb(B * H), dlog(B * C), dpre(B * H);
  for (std::size_t i = 0; i < w1.size(); ++i) w1p[i] = P(w1[i]);
  for (std::size_t i = 0; i < w2.size(); ++i) w2p[i] = P(w2[i]);
  std::vector<float> pre(B * H), logits(B * C), dh(B * H), g1(w1.size()), g2(w2.size());
  std::vector<float> m1(w1.size()), v1(w1.size()), m2(w2.size()), v2(w2.size());  // AdamW state, f32

  adamw_params hp;
  hp.lr = 5e-3f;
  hp.weight_decay = 1e-4f;
  step_options opt;
  opt.max_grad_norm = 1.0f;
  if constexpr (!std::is_same_v<P, float>) opt.storage = param_storage::bf16_master;

  auto cv = [](const std::vector<P>& v, std::size_t r, std::size_t c) { return tensor<const P, 2>(v.data(), r, c); };
  double loss = 0;
  for (int step = 1; step <= steps; ++step) {
    const std::size_t off = (std::size_t(step - 1) * B) % N;
    for (std::size_t i = 0; i < B * D; ++i) xb[i] = P(t.x[off * D + i]);
    const std::span<const std::int64_t> labels(t.labels.data() + off, B);

    // forward: pre = x W1, h = gelu(pre), logits = h W2; loss and dlogits in one fused pass
    gemm(dev, cv(xb, B, D), cv(w1p, D, H), tensor<float, 2>(pre.data(), B, H));
    gelu_forward(dev, std::span<const float>(pre), std::span<P>(hb));
    gemm(dev, cv(hb, B, H), cv(w2p, H, C), tensor<float, 2>(logits.data(), B, C));
    loss = cross_entropy(dev, tensor<const float, 2>(logits.data(), B, C), labels, tensor<P, 2>(dlog.data(), B, C)).loss;

    // backward: dW2 = h^T dlogits, dh = dlogits W2^T, dpre = dh * gelu'(pre), dW1 = x^T dpre
    gemm(dev, cv(hb, B, H).transposed(), cv(dlog, B, C), tensor<float, 2>(g2.data(), H, C));
    gemm(dev, cv(dlog, B, C), cv(w2p, H, C).transposed(), tensor<float, 2>(dh.data(), B, H));
    gelu_backward(dev, std::span<const float>(dh), std::span<const float>(pre), std::span<P>(dpre));
    gemm(dev, cv(xb, B, D).transposed(), cv(dpre, B, H), tensor<float, 2>(g1.data(), D, H));

    // update: both tensors in one launch
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
      ts[0].param_bf16 = w1p;
      ts[0].master = w1;
      ts[1].param_bf16 = w2p;
      ts[1].master = w2;
    }
    const step_result r = adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), hp, std::uint64_t(step), opt);
    if (step == 1 || step % 25 == 0)
      std::printf("  step %3d  loss %.4f  grad norm %.3f%s\n", step, loss, r.grad_norm, r.skipped ? "  (skipped: non-finite gradient)" : "");
  }
  return loss;
}

int main() {
  host_device dev;  // all hardware threads
  const dataset t = make_task();
  const int steps = 200;
  std::printf("MLP %zu-%zu-%zu, batch %zu, %d AdamW steps, %u workers\n", D, H, C, B, steps, dev.capabilities().workers);
  std::printf("f32 parameters:\n");
  const double l32 = train<float>(dev, t, steps);
  std::printf("bf16 parameters + f32 master weights:\n");
  const double l16 = train<bf16>(dev, t, steps);
  std::printf("final loss: f32 %.4f, bf16+master %.4f (start: ln %zu = %.3f)\n", l32, l16, C, std::log(double(C)));
  return (l32 < 0.3 && l16 < 0.3) ? 0 : 1;
}
