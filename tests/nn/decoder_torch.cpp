// Decoder models against PyTorch (tools/torch/reference_models.py, label torch): every model of
// the fixtures loads by Hugging Face's names and gives the fp64 reference's logits, loss and every
// parameter's gradient, in f32 and in bf16, and 20 AdamW steps follow torch's trajectory. Mixtral
// also gives the router logits and the aux loss, and its gradients include coef · d aux.
//
// Bounds. f32: each logit is the end of about 2 layers x 4 dependent GEMMs with K <= 256 and
// norms/softmaxes; first-order error analysis gives a relative error of a few γ_K = K·u (u = 2^-24,
// γ_256 = 1.5e-5) per GEMM that mostly cancel in the 2-norm, so we allow γ_256 · (1 + max|logit|)
// on logits and γ_256 relative (in the 2-norm, per tensor, floored at 1e-4 of the largest tensor's
// norm) on gradients (measured: 3e-7 and 2e-6). bf16: every GEMM operand is rounded to 8 bits
// (u = 2^-9 = 2e-3) and ~10 roundings lie in series, so 10u = 2e-2 · (1 + max|logit|) on logits
// and 30u = 6e-2 relative on gradients, whose backward chains are twice as long (measured: 4e-3
// and 3e-2). AdamW: per tensor,
// the distance to the fp64 trajectory may be at most 4x torch's own f32 distance to it plus 1e-6
// of the tensor's norm (AdamW's normalised steps make parameters with near-zero gradients move by
// rounding noise, so only a trajectory-relative bound is meaningful).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_nn_decoder_torch {

using namespace tessel;
namespace fs = std::filesystem;

namespace {

fs::path fixtures() {
  if (const char* env = std::getenv("TESSEL_TORCH_FIXTURES"); env != nullptr && *env != '\0') return env;
  return TESSEL_TORCH_FIXTURES;
}

struct reference {
  io::safetensors_reader inputs, ref;
  std::vector<std::int64_t> ids, targets;
  std::size_t b = 0, s = 0;
  explicit reference(const fs::path& dir)
      : inputs(io::safetensors_reader::open(dir / "inputs.safetensors")), ref(io::safetensors_reader::open(dir / "reference.safetensors")) {
    const auto t = inputs.tensor("input_ids");
    b = t.shape()[0];
    s = t.shape()[1];
    const auto i = t.data<std::int64_t>();
    ids.assign(i.span().begin(), i.span().end());
    const auto g = inputs.tensor("targets").data<std::int64_t>();
    targets.assign(g.span().begin(), g.span().end());
  }
  std::vector<float> get(const std::string& name) const {
    const auto d = ref.tensor(name).data<float>();
    return {d.span().begin(), d.span().end()};
  }
};

double norm2(const float* a, std::size_t n) {
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) s += double(a[i]) * a[i];
  return std::sqrt(s);
}
double dist2(const float* a, const float* b, std::size_t n) {
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(s);
}

const char* models[] = {"llama", "llama_bias", "llama3_rope", "mistral", "qwen2", "mixtral", "gpt2"};

template <class T>
void check_model(const std::string& name, double logit_tol, double grad_tol) {
  host_device dev(2);
  const fs::path dir = fixtures() / name;
  INFO("model " << name << (std::is_same_v<T, float> ? " f32" : " bf16"));
  auto m = nn::decoder_lm<host_device, T>::from_pretrained(dev, dir);
  reference r(dir);
  const std::size_t V = m->config().vocab_size;
  const auto want = r.get("logits");
  REQUIRE(want.size() == r.b * r.s * V);
  const auto got = m->forward(r.ids, r.b, r.s);
  double max_ref = 0.0, max_err = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(double(want[i])));
    max_err = std::max(max_err, std::fabs(double(got[i]) - want[i]));
  }
  INFO("logits: max error " << max_err << ", max |logit| " << max_ref);
  CHECK(max_err <= logit_tol * (1.0 + max_ref));
  m->params().zero_grad();
  const double loss = m->forward_backward(r.ids, r.targets, r.b, r.s);
  const double want_loss = r.get("loss")[0];
  INFO("loss " << loss << " vs " << want_loss);
  CHECK(std::fabs(loss - want_loss) <= logit_tol * (1.0 + std::fabs(want_loss)));
  // Mixtral: the gradient holds coef · d aux as well (the config's router_aux_loss_coef is 0.02).
  const bool moe = m->config().is_moe();
  const std::string grad = moe && m->config().router_aux_loss_coef > 0.0 ? "grad_total." : "grad.";
  if (moe) {
    const double want_aux = r.get("aux_loss")[0];
    INFO("aux loss " << m->last_aux_loss() << " vs " << want_aux);
    if (std::getenv("TESSEL_REPORT"))
      std::printf("| %s | %s | aux loss error %.2e |\n", name.c_str(), std::is_same_v<T, float> ? "f32" : "bf16",
                  std::fabs(m->last_aux_loss() - want_aux));
    CHECK(std::fabs(m->last_aux_loss() - want_aux) <= logit_tol * (1.0 + want_aux));
    for (std::size_t l = 0; l < m->config().num_hidden_layers; ++l) {
      const auto want_r = r.get("router_logits." + std::to_string(l));
      const auto got_r = m->router_logits(l);
      REQUIRE(got_r.size() == want_r.size());
      double rmax = 0.0, rerr = 0.0;
      for (std::size_t i = 0; i < want_r.size(); ++i) {
        rmax = std::max(rmax, std::fabs(double(want_r[i])));
        rerr = std::max(rerr, std::fabs(double(got_r[i]) - want_r[i]));
      }
      INFO("router logits of layer " << l << ": max error " << rerr << ", max |logit| " << rmax);
      CHECK(rerr <= logit_tol * (1.0 + rmax));
    }
  }
  double max_norm = 0.0;
  for (auto& p : m->params()) max_norm = std::max(max_norm, norm2(r.get(grad + p.name).data(), p.numel));
  double worst = 0.0;
  std::string worst_name;
  for (auto& p : m->params()) {
    const auto g = r.get(grad + p.name);
    REQUIRE(g.size() == p.numel);
    const double e = dist2(p.grad.data(), g.data(), p.numel) / std::max(norm2(g.data(), p.numel), 1e-4 * max_norm);
    if (e > worst) worst = e, worst_name = p.name;
  }
  INFO("worst gradient " << worst_name << ": relative error " << worst);
  if (std::getenv("TESSEL_REPORT"))  // the conformance table of the closing notes
    std::printf("| %s | %s | %.2e | %.2e | %.2e | %s |\n", name.c_str(), std::is_same_v<T, float> ? "f32" : "bf16", max_err / (1.0 + max_ref),
                std::fabs(loss - want_loss), worst, worst_name.c_str());
  CHECK(worst <= grad_tol);
}

}  // namespace

TEST_CASE("f32 decoders give PyTorch's fp64 logits, loss and gradients", "[nn][torch]") {
  for (const char* name : models) check_model<float>(name, 1.5e-5, 1.5e-5);
}

TEST_CASE("bf16 decoders stay within bf16 bounds of PyTorch's fp64 logits and gradients", "[nn][torch][bf16]") {
  for (const char* name : models) check_model<bf16>(name, 2e-2, 6e-2);
}

TEST_CASE("20 AdamW steps follow PyTorch's trajectory", "[nn][torch][train]") {
  host_device dev(2);
  for (const char* name : models) {
    INFO("model " << name);
    const fs::path dir = fixtures() / name;
    // torch's trajectory is cross-entropy only (Mixtral without the aux term): coefficient 0
    auto cfg = io::load_model_config(dir / "config.json");
    cfg.router_aux_loss_coef = 0.0;
    auto m = std::make_unique<nn::decoder_lm<host_device>>(dev, cfg);
    m->load(dir);
    reference r(dir);
    nn::adamw_config h;
    h.hyper = adamw_params{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
    const auto losses = r.get("losses20");
    for (std::uint64_t step = 1; step <= 20; ++step) {
      m->params().zero_grad();
      const double l = m->forward_backward(r.ids, r.targets, r.b, r.s);
      INFO("step " << step << ": loss " << l << " vs torch f32 " << losses[step - 1]);
      CHECK(std::fabs(l - losses[step - 1]) <= 1e-4 * (1.0 + std::fabs(l)));
      REQUIRE_FALSE(m->adamw(h, step).skipped);
    }
    for (auto& p : m->params()) {
      // A key bias's exact gradient is zero (it adds q·b_k to every score of a query row, which
      // the softmax cancels), so its gradient is rounding noise in every precision and AdamW's
      // normalised step turns that noise into ±lr moves: its trajectory is a random walk in f64
      // too, and no distance to it measures anything. (Its gradient is checked against fp64 in
      // the gradient test above.)
      if (p.name.ends_with("k_proj.bias")) continue;
      const auto t32 = r.get("adamw20." + p.name), t64 = r.get("adamw20_f64." + p.name);
      const double ours = dist2(p.value.data(), t64.data(), p.numel), torch = dist2(t32.data(), t64.data(), p.numel);
      INFO(p.name << ": distance to the f64 trajectory " << ours << ", torch f32's " << torch);
      CHECK(ours <= 4.0 * torch + 1e-6 * norm2(t64.data(), p.numel));
    }
  }
}

TEST_CASE("a sharded Hugging Face checkpoint loads to the same logits", "[nn][torch][io]") {
  host_device dev(2);
  auto a = nn::decoder_lm<host_device>::from_pretrained(dev, fixtures() / "llama");
  auto b = nn::decoder_lm<host_device>::from_pretrained(dev, fixtures() / "llama_sharded");
  reference r(fixtures() / "llama");
  const auto la = a->forward(r.ids, r.b, r.s);
  const std::vector<float> va(la.begin(), la.end());
  const auto lb = b->forward(r.ids, r.b, r.s);
  CHECK(std::equal(va.begin(), va.end(), lb.begin()));
}

TEST_CASE("Mixtral's loss without the aux coefficient has the cross-entropy gradient", "[nn][torch][moe]") {
  host_device dev(2);
  const fs::path dir = fixtures() / "mixtral";
  auto cfg = io::load_model_config(dir / "config.json");
  REQUIRE(cfg.router_aux_loss_coef == 0.02);
  cfg.router_aux_loss_coef = 0.0;
  nn::decoder_lm<host_device> m(dev, cfg);
  m.load(dir);
  reference r(dir);
  m.params().zero_grad();
  (void)m.forward_backward(r.ids, r.targets, r.b, r.s);
  for (auto& p : m.params()) {
    const auto g = r.get("grad." + p.name);
    INFO(p.name);
    CHECK(dist2(p.grad.data(), g.data(), p.numel) <= 1.5e-5 * std::max(norm2(g.data(), p.numel), 1e-6));
  }
}

}  // namespace tessel_test_nn_decoder_torch
