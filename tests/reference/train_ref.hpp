// Unfused simple-loop references for the training operators (optimizers, norms, activations,
// softmax, losses, RoPE). Optimizer references use the same operation order as the fused
// kernels (every multiply-add an explicit fma) so they must agree bit for bit; the layer
// references are in double and the tests state their ulp/relative bounds.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include <tessel/types/bf16.hpp>

namespace train_ref {

inline float bf16_round(float x) { return float(tessel::bf16(x)); }

struct adamw_consts {
  float lr, b1, b2, eps, wd;
  bool amsgrad;
};

// One AdamW step on f32 vectors, PyTorch's formula, unfused.
inline void adamw(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v, std::vector<float>& vmax,
                  const adamw_consts& h, std::uint64_t step, float gmul) {
  const double bc1 = 1.0 - std::pow(double(h.b1), double(step));
  const double bc2 = 1.0 - std::pow(double(h.b2), double(step));
  const float decay = 1.0f - h.lr * h.wd;
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  const float neg_step = float(-double(h.lr) / bc1);
  for (std::size_t i = 0; i < p.size(); ++i) {
    const float gi = g[i] * gmul;
    const float pd = p[i] * decay;
    m[i] = std::fma(h.b1, m[i], (1.0f - h.b1) * gi);
    v[i] = std::fma(h.b2, v[i], ((1.0f - h.b2) * gi) * gi);
    float vh = v[i];
    if (h.amsgrad) vh = vmax[i] = vmax[i] > v[i] ? vmax[i] : v[i];
    const float denom = std::fma(std::sqrt(vh), inv_sqrt_bc2, h.eps);
    p[i] = std::fma(neg_step, m[i] / denom, pd);
  }
}

inline void sgd(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& buf, float lr, float mom, float damp, float wd, bool nesterov,
                std::uint64_t step, float gmul) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    float gi = g[i] * gmul;
    if (wd != 0.0f) gi = std::fma(wd, p[i], gi);
    if (mom != 0.0f) {
      buf[i] = step <= 1 ? gi : std::fma(mom, buf[i], (1.0f - damp) * gi);
      gi = nesterov ? std::fma(mom, buf[i], gi) : buf[i];
    }
    p[i] = std::fma(-lr, gi, p[i]);
  }
}

inline void lion(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m, float lr, float b1, float b2, float wd, float gmul) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    const float gi = g[i] * gmul;
    const float c = std::fma(b1, m[i], (1.0f - b1) * gi);
    const float pd = p[i] * (1.0f - lr * wd);
    m[i] = std::fma(b2, m[i], (1.0f - b2) * gi);
    const float s = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    p[i] = std::fma(-lr, s, pd);
  }
}

inline std::vector<float> randn(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (auto& e : x) e = d(rng);
  return x;
}

// ---- layers, in double ---------------------------------------------------------------------------
inline void layernorm(const double* x, const double* w, const double* b, double* y, std::size_t n, double eps, bool rms) {
  double mean = 0.0;
  if (!rms) {
    for (std::size_t i = 0; i < n; ++i) mean += x[i];
    mean /= double(n);
  }
  double var = 0.0;
  for (std::size_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= double(n);
  const double r = 1.0 / std::sqrt(var + eps);
  for (std::size_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * r * w[i] + (b ? b[i] : 0.0);
}

inline void softmax(const double* x, double* y, std::size_t n) {
  double m = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) s += std::exp(x[i] - m);
  for (std::size_t i = 0; i < n; ++i) y[i] = std::exp(x[i] - m) / s;
}

inline double gelu_tanh(double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
inline double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
inline double silu(double x) { return x / (1.0 + std::exp(-x)); }

// Cross-entropy of one row with label smoothing eps: (1-eps)·(-log p_y) + eps·mean_j(-log p_j).
inline double cross_entropy(const double* z, std::size_t n, std::size_t label, double eps) {
  double m = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, z[i]);
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) s += std::exp(z[i] - m);
  const double lse = m + std::log(s);
  double mean_nll = 0.0;
  for (std::size_t i = 0; i < n; ++i) mean_nll += lse - z[i];
  mean_nll /= double(n);
  return (1.0 - eps) * (lse - z[label]) + eps * mean_nll;
}

}  // namespace train_ref
