// fp64 GEMM reference and the DESIGN.md tolerance: |C - C_ref| <= gamma_K (|A||B|) + u_out |C_ref|,
// gamma_K = K u / (1 - K u), u the accumulation unit roundoff.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <tessel/arch/unpack.hpp>

namespace tessel::ref {

template <class T>
double to_d(T x) {
  return static_cast<double>(tessel::arch::to_f32(x));
}

// op(X)(r, c) for a row-major stored X with leading dimension ld.
template <class T>
double op_at(const T* x, bool trans, std::size_t r, std::size_t c, std::size_t ld) {
  return trans ? to_d(x[c * ld + r]) : to_d(x[r * ld + c]);
}

struct gemm_result {
  std::vector<double> c;    // exact-ish product (M*N), including alpha/beta
  std::vector<double> mag;  // |alpha| * (|A||B|) + |beta||C| (for the error bound)
};

// C = alpha op(A) op(B) + beta C0 in fp64. Optional per-tensor scales and block scales (128).
template <class TA, class TB, class TC>
gemm_result gemm(bool ta, bool tb, std::size_t M, std::size_t N, std::size_t K, double alpha, const TA* A, std::size_t lda, const TB* B,
                 std::size_t ldb, double beta, const TC* C0, std::size_t ldc, double sa = 1, double sb = 1, const float* a_block = nullptr,
                 const float* b_block = nullptr) {
  gemm_result r;
  r.c.assign(M * N, 0.0);
  r.mag.assign(M * N, 0.0);
  const std::size_t kb = (K + 127) / 128, nbk = (N + 127) / 128;
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j) {
      double s = 0, m = 0;
      for (std::size_t k = 0; k < K; ++k) {
        double p = op_at(A, ta, i, k, lda) * op_at(B, tb, k, j, ldb);
        if (a_block) p *= double(a_block[i * kb + k / 128]) * double(b_block[(k / 128) * nbk + j / 128]);
        s += p;
        m += std::fabs(p);
      }
      double c = alpha * sa * sb * s;
      double mg = std::fabs(alpha * sa * sb) * m;
      if (beta != 0) {
        c += beta * to_d(C0[i * ldc + j]);
        mg += std::fabs(beta * to_d(C0[i * ldc + j]));
      }
      r.c[i * N + j] = c;
      r.mag[i * N + j] = mg;
    }
  return r;
}

inline double gamma(std::size_t k, double u) { return k * u / (1 - k * u); }

// Unit roundoff of an output type (0 for f32/f64 accumulate-only checks handled by caller).
template <class T>
double unit_roundoff() {
  if constexpr (std::is_same_v<T, float>)
    return std::ldexp(1.0, -24);
  else if constexpr (std::is_same_v<T, bf16>)
    return std::ldexp(1.0, -8);
  else if constexpr (std::is_same_v<T, fp16>)
    return std::ldexp(1.0, -11);
  else if constexpr (std::is_same_v<T, e4m3>)
    return std::ldexp(1.0, -4);
  else
    return std::ldexp(1.0, -3);
}

// Elements of C (M,N; leading dimension ldc) farther from the fp64 reference than DESIGN's bound
// gamma_{K+2}·(|alpha||A||B| + |beta||C0|) + u_out·|C_ref| (u_out: C's unit roundoff, f32's for f32).
template <class TC>
std::size_t gemm_violations(const std::vector<TC>& C, std::size_t ldc, const gemm_result& r, std::size_t M, std::size_t N, std::size_t K) {
  const double g = gamma(K + 2, std::ldexp(1.0, -24)), uo = unit_roundoff<TC>();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j) {
      const double got = to_d(C[i * ldc + j]), want = r.c[i * N + j];
      const double tol = g * r.mag[i * N + j] + uo * std::fabs(want) + 1e-30;
      if (!(std::fabs(got - want) <= tol)) ++bad;
    }
  return bad;
}

// Fills with integers in [-r, r] (exactly representable in every type for r <= 8 when the
// products' partial sums stay small).
template <class T>
void fill_int(std::vector<T>& v, std::mt19937& g, int r = 3) {
  std::uniform_int_distribution<int> d(-r, r);
  for (auto& x : v) x = T(static_cast<float>(d(g)));
}
template <class T>
void fill_real(std::vector<T>& v, std::mt19937& g, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  for (auto& x : v) x = T(d(g));
}

}  // namespace tessel::ref
