// Elementwise math shared by all operators (GEMM epilogues, activations, norms, attention,
// optimizers): GELU (tanh and erf forms), SiLU, ReLU, exp, in scalar form and as in-place span
// kernels vectorized with xsimd. The scalar forms are the references for the span forms.
#pragma once

#include <cmath>
#include <cstddef>

#include <tessel/arch/stream.hpp>
#include <tessel/arch/target.hpp>

namespace tessel::arch::math {

inline constexpr float sqrt_2_over_pi = 0.7978845608028654f;
inline constexpr float inv_sqrt_2 = 0.7071067811865476f;

// ---- scalar -----------------------------------------------------------------------------------
inline float relu(float x) { return x > 0.0f ? x : (x == x ? 0.0f : x); }
inline float gelu_tanh(float x) { return 0.5f * x * (1.0f + std::tanh(sqrt_2_over_pi * (x + 0.044715f * x * x * x))); }
inline float gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * inv_sqrt_2)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }

// ---- vector (one batch) -------------------------------------------------------------------------
// (NaN kept: xsimd::isnan, since xsimd 8's float `!=` is the ordered compare, false for NaN.)
template <class B>
B relu(const B& x) {
  return xsimd::select(x > B(0.0f), x, xsimd::select(xsimd::isnan(x), x, B(0.0f)));
}
// 0.5·x·(1 + tanh(u)) = x / (1 + e^(-2u)): one fast exp (arch/stream.hpp) instead of a tanh, so
// a fused GEMM epilogue stays within a few percent of the plain GEMM.
template <class B>
B gelu_tanh(const B& x) {
  const B inner = B(sqrt_2_over_pi) * xsimd::fma(B(0.044715f) * x, x * x, x);
  return x / (B(1.0f) + stream::exp_fast(B(-2.0f) * inner));
}
template <class B>
B gelu_erf(const B& x) {
  return B(0.5f) * x * (B(1.0f) + xsimd::erf(x * B(inv_sqrt_2)));
}
template <class B>
B silu(const B& x) {
  return x / (B(1.0f) + stream::exp_fast(-x));
}
template <class B>
B exp(const B& x) {
  return xsimd::exp(x);
}

// ---- in-place spans -----------------------------------------------------------------------------
namespace detail {
template <class VecF, class ScalarF>
inline void apply_inplace(float* x, std::size_t n, VecF vf, ScalarF sf) {
  using B = xsimd::batch<float>;
  std::size_t i = 0;
  for (; i + B::size <= n; i += B::size) vf(B::load_unaligned(x + i)).store_unaligned(x + i);
  for (; i < n; ++i) x[i] = sf(x[i]);
}
}  // namespace detail

inline void relu_inplace(float* x, std::size_t n) {
  detail::apply_inplace(
      x, n, [](auto v) { return relu(v); }, [](float v) { return relu(v); });
}
inline void gelu_tanh_inplace(float* x, std::size_t n) {
  detail::apply_inplace(
      x, n, [](auto v) { return gelu_tanh(v); }, [](float v) { return gelu_tanh(v); });
}
inline void gelu_erf_inplace(float* x, std::size_t n) {
  detail::apply_inplace(
      x, n, [](auto v) { return gelu_erf(v); }, [](float v) { return gelu_erf(v); });
}
inline void silu_inplace(float* x, std::size_t n) {
  detail::apply_inplace(
      x, n, [](auto v) { return silu(v); }, [](float v) { return silu(v); });
}
inline void exp_inplace(float* x, std::size_t n) {
  detail::apply_inplace(
      x, n, [](auto v) { return exp(v); }, [](float v) { return std::exp(v); });
}

}  // namespace tessel::arch::math
